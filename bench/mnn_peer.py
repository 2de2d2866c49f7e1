"""MNN 3.6 as a CPU peer: MNN's own 4-bit export of the checkpoint, run by `MNN.llm`.

    python bench/mnn_peer.py --setup            # .venv-mnn: MNN 3.6.1, llmexport 0.0.5, torch==2.13.0 (CPU)
    python bench/cpu_peer.py --engines fuselm genai mnn [--tiny]

An engine of bench/cpu_peer.py (same protocol, same JSON rows): `llmexport --path CKPT --export mnn
--quant_bit 4 --quant_block 32` (timed, with the export process's peak RSS), then `MNN.llm` on CPU
with the same thread count as the other engines, one process per benchmark and per fresh start.

SAFETY. MNN's Python tools phone home: `MNN/tools/utils/log.py` posts usage data to an MNN server
and, without the `aliyun` package, runs `pip install -U aliyun-log-python-sdk`. So MNN and llmexport
live only in `.venv-mnn` (git-ignored, made by --setup; torch pinned), and every process that runs
their code is `.venv-mnn/bin/python bench/mnn_safe.py ...` under `safe_env()`: MNN's log module is
blocked before import, non-loopback sockets are refused, and the first `pip` on PATH is a stub that
exits 0 doing nothing; and where `unshare -n` works (here: root) it runs in a network namespace with
no interface at all, which also covers MNN's native library (it links cpp-httplib, for image/audio
URLs). Nothing here is imported or run by the test suite.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _child import run_child  # noqa: E402 - bench/ is no package: its helpers sit beside each script

HERE = Path(__file__).parent
ROOT = HERE.parent
VENV = ROOT / ".venv-mnn"
PYTHON = VENV / "bin" / "python"
SAFE = HERE / "mnn_safe.py"
WHEELS = ROOT / ".mnn-wheels"  # mnn-3.6.1 and llmexport-0.0.5 wheels, if downloaded; else PyPI
PINS = ["torch==2.13.0", "mnn==3.6.1", "llmexport==0.0.5", "transformers==5.24.0", "sentencepiece", "onnx",
        "onnxslim", "onnxruntime", "yaspin", "numpy", "safetensors", "tqdm"]


def setup() -> int:
    """Make .venv-mnn (once): the pinned packages, and safe-bin/pip{,3}: stubs that do nothing."""
    if not PYTHON.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(PYTHON), "-m", "pip", "install", "-q"]
    if WHEELS.is_dir():
        pip += ["--find-links", str(WHEELS)]
    subprocess.run(pip + ["torch==2.13.0"], check=True)  # alone first: the CPU wheel, never a CUDA build
    subprocess.run(pip + PINS, check=True)
    stubs = VENV / "safe-bin"
    stubs.mkdir(exist_ok=True)
    for name in ("pip", "pip3", "pip3.11"):
        stub = stubs / name
        stub.write_text("#!/bin/sh\n# bench/mnn_peer.py: MNN's tools may run `pip install`; this pip does nothing\nexit 0\n")
        stub.chmod(0o755)
    print(f"ready: {PYTHON}")
    return 0


def safe_env() -> dict:
    """The environment of every MNN process: the stub pip first on PATH, hub access off."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(VENV / "safe-bin"), str(VENV / "bin"), env.get("PATH", "")])
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VIRTUAL_ENV=str(VENV))
    env.pop("PYTHONPATH", None)
    return env


def _no_network() -> list[str]:
    """`unshare -n` where it works (root, or user namespaces): the process gets a network namespace
    with no interface, which also stops MNN's native code (its C++ library links cpp-httplib for
    image/audio URLs) from reaching anything; else [] and bench/mnn_safe.py's Python guard alone."""
    unshare = shutil.which("unshare")
    for cmd in ([unshare, "-n"], [unshare, "-rn"]) if unshare else ():
        if subprocess.run([*cmd, "true"], capture_output=True).returncode == 0:
            return cmd
    return []


def safe_cmd(*args: str) -> list[str]:
    if not PYTHON.is_file():
        raise SystemExit("no .venv-mnn: run `python bench/mnn_peer.py --setup` first")
    return [*_no_network(), str(PYTHON), str(SAFE), *args]


def versions() -> dict:
    """The versions of what runs in .venv-mnn (read from package metadata: nothing of MNN's imported)."""
    code = ("import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
            "('mnn', 'llmexport', 'torch', 'transformers', 'onnx', 'onnxslim')}))")
    out = subprocess.run([str(PYTHON), "-c", code], capture_output=True, text=True, env=safe_env(), check=True)
    return json.loads(out.stdout)


def run_measured(cmd: list[str], cwd: Path | None = None) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run `cmd` under safe_env(); its output (stderr merged), wall seconds and the peak RSS (MB) of it and its
    children (bench/_child.py)."""
    c = run_child(cmd, safe_env(), cwd, merge=True)
    return subprocess.CompletedProcess(cmd, c.returncode, c.stdout), c.wall_s, c.peak_rss_mb


def export(ckpt: Path, work: Path, threads: int = 2) -> Path:
    """MNN's own 4-bit block-32 export of `ckpt` (once): `llmexport --export mnn --quant_bit 4
    --quant_block 32`; its time and peak RSS land in the model dir's bench-export.json."""
    out = work / f"{ckpt.name}-mnn-int4-b32"
    stats = out / "bench-export.json"
    if stats.is_file() and (out / "config.json").is_file():
        return out
    shutil.rmtree(out, ignore_errors=True)
    scratch = work / "mnn-export-scratch"  # its cwd: llmexport writes .export.log and onnx/ there
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    script = next(VENV.glob("lib/python*/site-packages/llmexport/llmexport.py"))  # it imports `utils` from its dir
    cmd = safe_cmd(str(script), "--path", str(ckpt), "--export", "mnn", "--quant_bit", "4",
                   "--quant_block", "32", "--dst_path", str(out), "--mnnconvert", str(scratch / "none"))
    proc, seconds, rss = run_measured(cmd, cwd=scratch)
    if proc.returncode != 0 or not (out / "config.json").is_file():
        tail = " | ".join(proc.stdout.strip().splitlines()[-5:])
        raise RuntimeError(f"llmexport failed (exit {proc.returncode}): {tail}")
    shutil.rmtree(scratch, ignore_errors=True)
    stats.write_text(json.dumps({"command": " ".join(cmd[2:]), "convert_s": round(seconds, 1),
                                 "convert_peak_rss_mb": rss, **versions()}, indent=2) + "\n")
    return out


def export_stats(model: Path) -> dict:
    s = json.loads((model / "bench-export.json").read_text())
    return {"convert_s": s["convert_s"], "convert_peak_rss_mb": s["convert_peak_rss_mb"]}


def _llm(model: Path, threads: int):
    import MNN.llm as mllm

    llm = mllm.create(str(model / "config.json"))
    llm.set_config({"thread_num": threads, "backend_type": "cpu"})  # the rest: llmexport's defaults
    llm.load()
    return llm


def _argmax(logits) -> int:
    """The greedy token of the last position's logits (an MNN Var, [..., vocab])."""
    import numpy as np

    return int(np.argmax(np.asarray(logits.read()).reshape(-1, logits.shape[-1])[-1]))


class MnnEngine:
    """bench/cpu_peer.py's engine protocol on MNN.llm: `forward(ids)` runs the prompt (or one token)
    against MNN's own KV cache and returns the last position's logits; `reset()` empties the cache."""

    def __init__(self, model: Path, threads: int):
        import MNN

        self.llm = _llm(model, threads)
        cfg = json.loads((model / "config.json").read_text())
        self.what = (f"MNN {MNN.version()} MNN.llm, CPU, llmexport 4-bit block 32 "
                     f"(precision {cfg.get('precision', 'default')}, memory {cfg.get('memory', 'default')})")

    def prefill(self, ids: list[int], room: int) -> int:
        self.llm.reset()
        return _argmax(self.llm.forward(ids))

    def step(self, token: int) -> int:
        return _argmax(self.llm.forward([token]))


FRESH_RUN = r"""
import sys, time
sys.path.insert(0, sys.argv[5])
import mnn_peer
model, ids, new, threads = mnn_peer.Path(sys.argv[1]), [int(i) for i in sys.argv[2].split(",")], int(sys.argv[3]), int(sys.argv[4])
engine = mnn_peer.MnnEngine(model, threads)  # a user's script: create, load (tokenizer included), run
out = [engine.prefill(ids, new)]
print("FIRST", time.time(), flush=True)
while len(out) < new:
    out.append(engine.step(out[-1]))
print(" ".join(map(str, out)))
"""


def fresh_cmd(model: Path, ids_arg: str, new: int, threads: int) -> list[str]:
    """A whole MNN user process for bench/cpu_peer.py's fresh-process rows."""
    script = Path(os.environ.get("TMPDIR", "/tmp")) / "fuselm-bench-mnn-fresh.py"
    script.write_text(FRESH_RUN)
    return safe_cmd(str(script), str(model), ids_arg, str(new), str(threads), str(HERE))


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setup", action="store_true", help="make .venv-mnn")
    ap.add_argument("--export", type=Path, default=None, help="export this HF checkpoint dir (to --work)")
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "fuselm-bench-mnn")
    args = ap.parse_args(argv)
    if args.setup:
        return setup()
    if args.export:
        model = export(args.export, args.work)
        print(model, json.dumps(export_stats(model)))
        return 0
    ap.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
