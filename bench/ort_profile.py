"""Where an onnxruntime graph spends its decode step: onnxruntime's profiler, per node type.

    python bench/ort_profile.py DIR [DIR ...] [--ctx 128] [--steps 16] [--threads 2] [--max-length 512]

The model directories (`fuselm optimize --target onnxruntime` outputs, onnxruntime-genai's builder
output) load in one child process and step in turn (a shared box's load falls on each alike), in plain
onnxruntime (SessionOptions.enable_profiling, all graph
optimizations on, as onnxruntime-genai creates its session): a prompt of --ctx random ids, then
--steps greedy decode steps, the past and present bound to one preallocated max-length buffer per
layer (as onnxruntime-genai's past_present_share_buffer does; GroupQueryAttention graphs only).
Per node type, the mean time per decode step (the prefill excluded), the node count per step and
the share of the step; plus the step's wall time. Prints a table per graph, side by side, and writes
bench/results/ort-profile.json (--out) with the command, the processor and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).parent


class Profiled:
    """One graph's session with onnxruntime's profiler on, the past/present bound to one max-length buffer."""

    def __init__(self, model_dir: Path, threads: int, max_length: int):
        import numpy as np
        import onnxruntime as ort

        self.np, self.model_dir = np, model_dir
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(tempfile.mkdtemp(prefix="ort-profile-"), "p")
        self.sess = ort.InferenceSession(
            str(model_dir / "model.onnx"), so, providers=["CPUExecutionProvider"]
        )
        self.inputs = {i.name for i in self.sess.get_inputs()}
        decoder = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]
        shape = (1, decoder["num_key_value_heads"], max_length, decoder["head_size"])
        self.cache = {
            n: ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32))
            for n in self.inputs
            if n.startswith("past_key_values")
        }
        self.wall: list[float] = []

    def run(self, new: list[int], start: int) -> int:
        np = self.np
        io = self.sess.io_binding()
        total = start + len(new)
        feeds = {
            "input_ids": np.array([new], np.int64),
            "attention_mask": np.ones((1, total), np.int64),
            "position_ids": np.arange(start, total, dtype=np.int64)[None],
        }
        for name, a in feeds.items():
            if name in self.inputs:
                io.bind_cpu_input(name, a)
        for name, v in self.cache.items():
            io.bind_ortvalue_input(name, v)
            io.bind_ortvalue_output(name.replace("past_key_values", "present"), v)
        io.bind_output("logits", "cpu")
        t = time.perf_counter()
        self.sess.run_with_iobinding(io)
        self.wall.append(time.perf_counter() - t)
        return int(np.argmax(io.copy_outputs_to_cpu()[0][0, -1]))

    def report(self) -> dict:
        """Per node type (and per MatMulNBits projection) the mean kernel time of a decode step (run 0,
        the prefill, left out) and the median step's wall time."""
        trace = json.loads(Path(self.sess.end_profiling()).read_text())
        runs = sorted(
            (e["ts"], e["ts"] + e["dur"])
            for e in trace
            if e.get("cat") == "Session" and e["name"] == "model_run"
        )[1:]
        by_type: dict = defaultdict(lambda: [0.0, 0])
        by_role: dict = defaultdict(lambda: [0.0, 0])  # MatMulNBits per projection (layer index dropped)
        for e in trace:
            if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
                continue
            if not any(a <= e["ts"] <= b for a, b in runs):
                continue
            op = e["args"].get("op_name", "?")
            by_type[op][0] += e["dur"]
            by_type[op][1] += 1
            if op == "MatMulNBits":
                role = re.sub(r"layers\.\d+/", "layers.*/", e["name"].removesuffix("_kernel_time"))
                by_role[role][0] += e["dur"]
                by_role[role][1] += 1
        n = len(runs)
        total = sum(v[0] for v in by_type.values())
        table = {
            op: {"us_per_step": round(us / n, 1), "nodes_per_step": c // n, "share": round(us / total, 3)}
            for op, (us, c) in sorted(by_type.items(), key=lambda kv: -kv[1][0])
        }
        roles = {
            r: {"us_per_step": round(us / n, 1), "nodes_per_step": c // n}
            for r, (us, c) in sorted(by_role.items(), key=lambda kv: -kv[1][0])
        }
        steps = sorted(self.wall[1:])
        return {
            "model": str(self.model_dir),
            "decode_step_ms_median": round(steps[len(steps) // 2] * 1e3, 2),
            "kernel_us_per_step": round(total / n, 1),
            "by_op_type": table,
            "matmul_nbits": roles,
        }


def profile(models: list[Path], ctx: int, steps: int, threads: int, max_length: int) -> list[dict]:
    """The graphs loaded in one process and stepped in turn (a shared box's load falls on each alike):
    the same prompt, then `steps` greedy decode steps each."""
    import numpy as np

    runners = [Profiled(m, threads, max_length) for m in models]
    ids = np.random.default_rng(0).integers(10, 5000, ctx).tolist()
    tokens = [r.run(ids, 0) for r in runners]
    for s in range(steps):
        tokens = [r.run([t], ctx + s) for r, t in zip(runners, tokens, strict=True)]
    return [r.report() for r in runners]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "ort-profile.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        rows = profile(args.models, args.ctx, args.steps, args.threads, args.max_length)
        print("RESULT " + json.dumps(rows), flush=True)
        return 0
    load = os.getloadavg()[0]
    proc = subprocess.run(
        [
            sys.executable,
            __file__,
            *map(str, args.models),
            "--child",
            "--ctx",
            str(args.ctx),
            "--steps",
            str(args.steps),
            "--threads",
            str(args.threads),
            "--max-length",
            str(args.max_length),
        ],
        capture_output=True,
        text=True,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        print(proc.stderr[-2000:], file=sys.stderr)
        return 1
    rows = json.loads(line[len("RESULT ") :])
    load_after = os.getloadavg()[0]
    for r in rows:
        print(
            f"{r['model']}: step {r['decode_step_ms_median']} ms (kernels {r['kernel_us_per_step'] / 1e3:.2f} ms)"
        )
        for op, v in r["by_op_type"].items():
            print(
                f"  {op:36s} {v['us_per_step']:9.1f} us  x{v['nodes_per_step']:<4d} {100 * v['share']:5.1f}%"
            )
        for role, v in r["matmul_nbits"].items():
            print(f"    {role:60s} {v['us_per_step']:9.1f} us  x{v['nodes_per_step']}")
    print(f"load average {load:.2f} before, {load_after:.2f} after")
    cpu = _machine()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": "python bench/ort_profile.py " + " ".join(argv or sys.argv[1:]),
                "machine": cpu,
                "load_before": round(load, 2),
                "load_after": round(load_after, 2),
                "ctx": args.ctx,
                "steps": args.steps,
                "threads": args.threads,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")
    return 0


def _machine() -> dict:
    """bench/cpu_peer.py's machine record (processor, SIMD flags, onnxruntime and genai versions)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_cpu_peer", HERE / "cpu_peer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.machine()


if __name__ == "__main__":
    sys.exit(main())
