"""GGUF files (llama.cpp's format) as HF checkpoints: `fuselm convert MODEL.gguf` and the real-model tests.

transformers dequantizes a GGUF file's tensors (with the `gguf` package) into an ordinary model, whose
`save_pretrained` then refuses to write it (the gguf quantizer cannot be saved): a fresh model made from
the config without `quantization_config` takes the dequantized state dict and is saved as float32
safetensors beside the tokenizer (chat template included). The checkpoint is cached under fuselm's cache
folder `gguf`, keyed by the file's sha256, and written atomically (a temporary folder renamed into place),
so convert reads it like any HF checkpoint and writes the same graph.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import uuid
from collections import Counter
from pathlib import Path

from fuselm.errors import FuselmError
from fuselm.modeldir import file_sha256
from fuselm.switches import cache_folder

SOURCE_NAME = "fuselm-gguf.json"  # what the checkpoint was made from (convert copies it into fuselm.json)


def find_gguf(path: str | os.PathLike) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one .gguf of a directory without config.json;
    None for anything else (an HF checkpoint directory)."""
    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise FuselmError(f"{path} holds {len(found)} GGUF files ({', '.join(p.name for p in found[:4])}); "
                          "pass the one to convert as MODEL.gguf")
    return found[0] if found else None


def checkpoint_for(gguf: str | os.PathLike, quiet: bool = True) -> Path:
    """The HF checkpoint made from the GGUF file `gguf` (built once, then read from the cache)."""
    gguf = Path(gguf)
    digest = file_sha256(gguf)
    out = cache_folder("gguf", "FUSELM_GGUF_CACHE") / digest[:32]
    if (out / SOURCE_NAME).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{digest[:32]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        if not quiet:
            print(f"fuselm: dequantizing {gguf.name} into an HF checkpoint (once; cached in {out})")
        with contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext():
            write_checkpoint(gguf, tmp, digest)  # (transformers' GGUF reader draws its own progress bar)
        with contextlib.suppress(OSError):  # another process finished first: its copy is the same
            os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def source_info(gguf: Path, digest: str) -> dict:
    """What the GGUF file held: its file type and the storage type of its tensors (llama.cpp's names)."""
    try:
        from gguf import GGMLQuantizationType, GGUFReader, LlamaFileType
    except ImportError:
        raise FuselmError("reading a GGUF file needs the `gguf` package: pip install gguf accelerate") from None
    try:
        reader = GGUFReader(str(gguf))
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: the reader raises several types
        raise FuselmError(f"{gguf} is not a readable GGUF file ({type(e).__name__}: {e}); download it again") from None
    kinds = dict(Counter(GGMLQuantizationType(t.tensor_type).name for t in reader.tensors))
    field = reader.fields.get("general.file_type")
    file_type = None
    if field is not None:
        value = int(field.parts[field.data[0]][0])
        file_type = LlamaFileType(value).name if value in LlamaFileType._value2member_map_ else str(value)
    return {"format": "gguf", "file": gguf.name, "sha256": digest, "file_type": file_type, "tensor_types": kinds}


def write_checkpoint(gguf: Path, out: Path, digest: str) -> None:
    """Dequantize `gguf` through transformers into a float32 HF checkpoint at `out` (a new folder)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    info = source_info(gguf, digest)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    name = gguf.name  # a GGUF file holds no pickle: transformers reads it with the gguf package
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, gguf_file=name,
                                                     local_files_only=True, trust_remote_code=False)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=name, local_files_only=True,
                                                  trust_remote_code=False)
    except ImportError as e:
        raise FuselmError(f"reading {gguf.name} needs {e.name or 'a package'}: pip install gguf accelerate") from None
    except Exception as e:  # noqa: BLE001 - an architecture transformers' GGUF reader lacks, a damaged file
        raise FuselmError(f"transformers cannot load {gguf} ({type(e).__name__}: {str(e)[:300]}); fuselm reads "
                          "the GGUF architectures transformers reads") from None
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=name, local_files_only=True,
                                        trust_remote_code=False)
    config.quantization_config = None
    del config.quantization_config
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(model.state_dict(), assign=True, strict=False)
    fresh.tie_weights()
    missing = [n for n, p in fresh.named_parameters() if p.is_meta]
    if missing:
        raise FuselmError(f"{gguf.name}: transformers left {len(missing)} tensors unset ({', '.join(missing[:3])}); "
                          "this GGUF architecture is not supported")
    out.mkdir(parents=True)
    fresh.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / SOURCE_NAME).write_text(json.dumps(info, indent=2) + "\n")


def source_of(hf_dir: Path) -> dict | None:
    """The GGUF source a checkpoint made by `checkpoint_for` records, else None."""
    path = Path(hf_dir) / SOURCE_NAME
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None
