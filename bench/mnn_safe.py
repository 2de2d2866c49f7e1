"""Run MNN's Python tools with their telemetry cut off: the only way bench/ runs MNN or llmexport.

    .venv-mnn/bin/python bench/mnn_safe.py .venv-mnn/lib/python3.11/site-packages/llmexport/llmexport.py --path CKPT ...
    .venv-mnn/bin/python bench/mnn_safe.py -m MNN.tools.mnnconvert -f ONNX --modelFile M.onnx ...
    .venv-mnn/bin/python bench/mnn_safe.py SCRIPT.py ARGS...

MNN's `MNN/tools/utils/log.py` posts usage data to a server of its own on import and, when the
`aliyun` package is missing, runs `pip install -U aliyun-log-python-sdk` with whatever `pip` is
first on PATH. Before anything of MNN's is imported this wrapper
- makes `import MNN.tools.utils.log` fail (`sys.modules[...] = None`), so `MNN.tools.mnnconvert` and
  `mnnquant` fall back to `mnn_logger = None`: no request, no pip,
- refuses every socket connection that is not a Unix socket or loopback (what else may try:
  llmexport's image/audio URL loaders, Hugging Face hub look-ups), with an error naming the address,
- checks that the `pip` first on PATH is the do-nothing stub bench/mnn_peer.py puts in
  .venv-mnn/safe-bin (mnn_peer.safe_env sets PATH so), and sets HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE.
bench/mnn_peer.safe_cmd also runs it under `unshare -n` (no network interface at all) where that works.
Never imported by the test suite. Run only with .venv-mnn's Python (bench/mnn_peer.py --setup).
"""

from __future__ import annotations

import os
import runpy
import shutil
import socket
import sys

sys.modules["MNN.tools.utils.log"] = None  # MNN's telemetry (and its `pip install`) never loads
os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"

_connect = socket.socket.connect
_connect_ex = socket.socket.connect_ex


def _local_only(address) -> None:
    host = address[0] if isinstance(address, tuple) else None
    if host is not None and host not in ("127.0.0.1", "::1", "localhost"):
        raise ConnectionRefusedError(f"bench/mnn_safe.py: outbound connection to {address!r} blocked")


def _guarded_connect(self, address):
    if self.family != socket.AF_UNIX:
        _local_only(address)
    return _connect(self, address)


def _guarded_connect_ex(self, address):
    if self.family != socket.AF_UNIX:
        _local_only(address)
    return _connect_ex(self, address)


socket.socket.connect = _guarded_connect
socket.socket.connect_ex = _guarded_connect_ex


def main() -> None:
    pip = shutil.which("pip")
    if pip is None or os.path.basename(os.path.dirname(pip)) != "safe-bin":
        sys.exit(f"bench/mnn_safe.py: the first pip on PATH is {pip}, not the stub in .venv-mnn/safe-bin; "
                 "run through bench/mnn_peer.py (its safe_env puts the stub first)")
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    if sys.argv[1] == "-m":
        module, sys.argv = sys.argv[2], [sys.argv[2], *sys.argv[3:]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        path, sys.argv = os.path.abspath(sys.argv[1]), sys.argv[1:]
        sys.path.insert(0, os.path.dirname(path))
        with open(path) as f:  # not runpy.run_path: llmexport empties sys.argv, which runpy then restores
            code = compile(f.read(), path, "exec")
        exec(code, {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__})


if __name__ == "__main__":
    main()
