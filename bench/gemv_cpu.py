"""Side by side on this CPU: the quantized matmuls of one decode token (M = 1) or of a prefill chunk
(--prefill: M = 512 rows), fuselm vs onnxruntime and torch.

    python bench/gemv_cpu.py                    # Qwen3-0.6B's shapes: 28 layers + the 8-bit lm_head
    python bench/gemv_cpu.py --shape 4b --layers 8
    python bench/gemv_cpu.py --prefill --layers 4

Random blocked weights (block 32, asymmetric) for every matmul of a decode token in model order
(fused qkv, o, gate_up, down per layer; the lm_head at 8 bits), so the bytes come from memory as
in a real token, through:
- fuselm's kernels (runtime_metal/backends/cpu_kernels.cpp) as the runtime calls them
  (torch_quant.prepare + matmul), on the instruction set it picks, 2 threads: `fuselm-int8` (int8
  activations, integer dots, the same kernel as an integer GEMM for prefill) and `fuselm-int16`
  (int16 activations; prefill dequantizes each weight to f32 for a BLAS GEMM);
  A prefill chunk runs the layers' matmuls only (the lm_head runs for the last position: a GEMV).
- torch's own CPU kernels, bf16 activations: `torch-int4pack` (4-bit weights through
  `_weight_int4pack_mm_for_cpu`; the 8-bit lm_head, which no torch kernel takes blocked, as bf16
  F.linear) and `torch-bf16` (every weight dequantized to bf16 for F.linear: oneDNN, AMX where there);
- onnxruntime on a graph of the same weights as blocked DequantizeLinear -> MatMul (what fuselm
  writes; onnxruntime fuses it into MatMulNBits), at its default accuracy level 4 (int8
  activations) and at level 1 (f32 activations, the reference fuselm validates against).
Each engine runs alone in a child process (no other engine's threads spinning beside it); median
of the runs per token (with --threads 1 also the process's CPU time, compared instead of wall
time: robust on a shared machine); GB/s counts the bytes each token must read (weights, scales, zero points as
fuselm stores them); the roof is a 2-thread torch sum over 512 MB. Also reports how far each
engine's outputs are from f64 math on the same weights. --rounds interleaves the engines (each round
runs every engine once, in a rotated order; medians over all runs). Writes bench/results/gemv-cpu.json
(--out elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fuselm.runtime_metal.backends import make_backend, torch_quant  # noqa: E402
from fuselm.runtime_metal.backends.torch_quant import cpu_kernels  # noqa: E402

from fuselm import contract  # noqa: E402

SHAPES = {  # layers, (K, N) per 4-bit weight of a layer, the 8-bit lm_head (K, N)
    "0.6b": (28, [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)], (1024, 151936)),
    "4b": (36, [(2560, 6144), (4096, 2560), (2560, 19456), (9728, 2560)], (2560, 151936)),
}
BLOCK = 32
RESULTS = Path(__file__).parent / "results"


def weights(k: int, n: int, bits: int, rng) -> tuple:
    q = rng.integers(0, 2**bits, (k, n), dtype=np.uint8)
    scale = (rng.random((k // BLOCK, n), dtype=np.float32) * 0.02 + 1e-3).astype(np.float32)
    zp = rng.integers(0, 2**bits, (k // BLOCK, n), dtype=np.uint8)
    return q, scale, zp


def onnx_model(mats: list, threads: int):
    """x{K} [M, K] -> DequantizeLinear(q, scale, zp, axis 0, block 32) -> MatMul, one output per weight."""
    import onnx
    from onnx import TensorProto, helper

    def tensor(name, a, dtype):
        t = TensorProto(name=name, data_type=dtype, dims=list(a.shape))
        if dtype == TensorProto.UINT4:  # element i in nibble i, low nibble first
            flat = a.reshape(-1)
            flat = np.concatenate([flat, np.zeros(len(flat) % 2, np.uint8)])
            t.raw_data = (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8).tobytes()
        else:
            t.raw_data = np.ascontiguousarray(a).tobytes()
        return t

    nodes, inits, outs, ks = [], [], [], sorted({m[0].shape[0] for m in mats})
    for i, (q, scale, zp, bits) in enumerate(mats):
        dt = TensorProto.UINT4 if bits == 4 else TensorProto.UINT8
        inits += [tensor(f"q{i}", q, dt), tensor(f"s{i}", scale, TensorProto.FLOAT), tensor(f"z{i}", zp, dt)]
        nodes += [helper.make_node("DequantizeLinear", [f"q{i}", f"s{i}", f"z{i}"], [f"w{i}"], axis=0, block_size=BLOCK),
                  helper.make_node("MatMul", [f"x{q.shape[0]}", f"w{i}"], [f"y{i}"])]
        outs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["M", q.shape[1]]))
    graph = helper.make_graph(nodes, "gemv", [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, ["M", k]) for k in ks],
                              outs, inits)
    return onnx.helper.make_model(graph, opset_imports=[helper.make_opsetid("", contract.OPSET)])


def torch_weight(engine: str, q, s, z, bits):
    """torch-int4pack: 4-bit weights through `_weight_int4pack_mm_for_cpu` (torch's packed int4 CPU
    kernel: dequantizes (q - 8) * scale + zero, so zero = (8 - zp) * scale); 8-bit weights, which no
    torch CPU kernel takes blocked (`_weight_int8pack_mm` is per channel), and every weight of
    torch-bf16: dequantized once to bf16 for F.linear (oneDNN; AMX where the CPU has it)."""
    if engine == "torch-int4pack" and bits == 4:
        packed = torch._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q.T.astype(np.int32)).contiguous(), 2)
        scale = torch.from_numpy(s)
        sz = torch.stack([scale, (8 - torch.from_numpy(z).float()) * scale], -1).to(torch.bfloat16).contiguous()
        return ("int4pack", packed, sz)
    w = (q.astype(np.float32) - np.repeat(z, BLOCK, 0)) * np.repeat(s, BLOCK, 0)
    return ("bf16", torch.from_numpy(w.T.copy()).to(torch.bfloat16))


def torch_matmul(x, w):
    if w[0] == "int4pack":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w[1], BLOCK, w[2])
    return torch.nn.functional.linear(x, w[1])


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def timed_cpu(fn) -> float:
    """CPU seconds of this process: with 1 thread, the work itself, whatever else the machine runs
    (with more threads it counts spin-waiting too)."""
    t = time.process_time()
    fn()
    return time.process_time() - t


def roof(threads: int, runs: int) -> float:
    torch.set_num_threads(threads)
    a = torch.ones(128 << 20)  # 512 MB
    a.sum()
    return a.numel() * 4 / statistics.median(timed(a.sum) for _ in range(runs)) / 1e9


def run_engine(engine: str, shape: str, layers: int, runs: int, threads: int, rows: int) -> dict:
    """One engine in this process (spawned alone: no other engine's threads spinning beside it)."""
    n_layers, per_layer, head = SHAPES[shape]
    rng = np.random.default_rng(0)
    mats = [(*weights(k, n, 4, rng), 4) for _ in range(layers or n_layers) for k, n in per_layer] + \
        [(*weights(*head, 8, rng), 8)]
    xs = {k: rng.standard_normal((rows, k), dtype=np.float32) for k in sorted({m[0].shape[0] for m in mats})}
    if rows > 1:  # prefill: the layers' matmuls; the lm_head runs for the last position only (a GEMV)
        mats = mats[:-1]
    if engine.startswith("fuselm") and cpu_kernels() is None:
        raise SystemExit("fuselm's CPU kernels are not available on this machine")
    # the bytes a token reads, counted as fuselm stores them (both engines read about the same): per
    # row, the weights padded to whole groups of 256, an f32 scale and a u8 zero point per 32 values
    nbytes = sum(q.shape[1] * (-(-q.shape[0] // 256) * 256) * (bits / 8 + 5 / 32) for q, _, _, bits in mats)
    kind = None
    if engine.startswith("fuselm"):
        os.environ["FUSELM_CPU_ACTIVATIONS"] = engine.removeprefix("fuselm-")
        torch.set_num_threads(threads)  # prefill's BLAS GEMM (int16); the kernels take `threads` below
        torch_quant.set_kernel_threads(threads)
        backend = make_backend("torch", "cpu")
        prepared = [(torch.from_numpy(xs[q.shape[0]]), torch_quant.prepare(backend, q, s, z, BLOCK, bits))
                    for q, s, z, bits in mats]
        kind = "/".join(sorted({w.kind for _, w in prepared}))

        def token():
            return [torch_quant.matmul(x, w).numpy() for x, w in prepared]
    elif engine.startswith("torch-"):  # torch's own CPU kernels, bf16 activations (their fast path)
        torch.set_num_threads(threads)
        prepared = [(torch.from_numpy(xs[q.shape[0]]).to(torch.bfloat16), torch_weight(engine, q, s, z, bits))
                    for q, s, z, bits in mats]
        kind = "/".join(sorted({w[0] for _, w in prepared}))

        def token():
            return [torch_matmul(x, w).float().numpy() for x, w in prepared]
    else:
        from fuselm.reference import ort_session

        sess = ort_session(onnx_model(mats, threads), optimize=True, threads=threads,
                           accuracy_level=int(engine.removeprefix("ort-level")))
        feeds = {f"x{k}": x for k, x in xs.items()}

        def token():
            return sess.run(None, feeds)

    outs = token()  # accuracy, and warm-up: first touch, onnxruntime's prepacking (the first few tokens are slow)
    for _ in range(3 if rows == 1 else 1):
        token()
    err = 0.0
    for i in sorted(set(range(4)) | {len(mats) - 1}):  # against f64 math on the same weights
        q, s, z, _ = mats[i]
        w = (q.astype(np.float64) - np.repeat(z, BLOCK, 0)) * np.repeat(s.astype(np.float64), BLOCK, 0)
        ref = xs[q.shape[0]].astype(np.float64) @ w
        err = max(err, float(np.abs(np.asarray(outs[i]).reshape(ref.shape) - ref).max() / np.abs(ref).max()))
    times = [timed(token) for _ in range(runs)]
    cpu = [timed_cpu(token) for _ in range(runs)] if threads == 1 else []
    return {"engine": engine, "kernel": kind, "ms_per_token": statistics.median(times) * 1e3,
            "cpu_ms_per_token": statistics.median(cpu) * 1e3 if cpu else None,
            "runs_ms": [t * 1e3 for t in times], "cpu_runs_ms": [t * 1e3 for t in cpu], "rows": rows, "bytes_per_token": nbytes, "matmuls": len(mats),
            "max_rel_error": err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    ap.add_argument("--layers", type=int, help="fewer layers than the model (memory)")
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--prefill", type=int, nargs="?", const=512, default=0, metavar="TOKENS",
                    help="rows of x per matmul (a prefill chunk; 512 if no number) instead of one decode token")
    ap.add_argument("--engines", nargs="+", default=["fuselm-int8", "fuselm-int16", "ort-level4", "ort-level1",
                                                     "torch-int4pack"])
    ap.add_argument("--out", type=Path, default=RESULTS / "gemv-cpu.json", help="results JSON (merged by key)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every engine (medians over all)")
    ap.add_argument("--engine", help=argparse.SUPPRESS)  # child process: run one engine, print JSON
    args = ap.parse_args()
    rows_x = args.prefill or 1
    if args.engine:
        print(json.dumps(run_engine(args.engine, args.shape, args.layers, args.runs, args.threads, rows_x)))
        return
    rows = {}
    for rnd in range(args.rounds):  # interleaved: each round runs every engine once, in a rotated order
        for engine in args.engines[rnd % len(args.engines):] + args.engines[:rnd % len(args.engines)]:
            # f32 activations through MLAS: ~1 s per decode token
            runs = 2 if engine == "ort-level1" and not args.prefill else args.runs
            load = os.getloadavg()[0]
            cmd = [sys.executable, __file__, "--engine", engine, "--shape", args.shape, "--runs", str(runs),
                   "--threads", str(args.threads), "--prefill", str(args.prefill)] + \
                (["--layers", str(args.layers)] if args.layers else [])
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"{engine} failed:\n{out.stderr[-3000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            if engine not in rows:
                rows[engine] = {**r, "runs_ms": [], "cpu_runs_ms": [], "load_before": []}
            rows[engine]["runs_ms"] += r["runs_ms"]
            rows[engine]["cpu_runs_ms"] += r["cpu_runs_ms"]
            rows[engine]["load_before"].append(load)
    rows = list(rows.values())
    for r in rows:  # medians over every run of every round
        r["ms_per_token"] = statistics.median(r["runs_ms"])
        r["cpu_ms_per_token"] = statistics.median(r["cpu_runs_ms"]) if r["cpu_runs_ms"] else None
    bw = roof(args.threads, 5)
    # 1 thread: compare CPU time (robust on a shared machine); more threads: wall time
    key = "cpu_ms_per_token" if args.threads == 1 else "ms_per_token"
    base = next((r[key] for r in rows if r["engine"] == "ort-level4"), None)
    for r in rows:
        r["gb_s"] = r["bytes_per_token"] / r["ms_per_token"] / 1e6
        r["share_of_roof"] = r["gb_s"] / bw
        r["tokens_per_s"] = rows_x / r["ms_per_token"] * 1e3
        r["speedup_vs_ort_level4"] = base / r[key] if base else None
    nbytes, mats = rows[0]["bytes_per_token"], rows[0]["matmuls"]
    result = {"shape": args.shape, "layers": args.layers or SHAPES[args.shape][0], "threads": args.threads,
              "rows_of_x": rows_x, "cpu": _cpu_name(), "roof_gb_s": bw, "rounds": args.rounds,
              "command": "python bench/gemv_cpu.py " + " ".join(sys.argv[1:]), "torch": torch.__version__,
              "rows": rows}
    from rich.console import Console
    from rich.table import Table

    what = f"prefill chunk of {rows_x} tokens" if args.prefill else "decode token"
    table = Table(title=f"{args.shape}-shaped {what}: {mats} quantized matmuls, {nbytes / 1e6:.0f} MB of weights, "
                        f"{args.threads} threads, roof {bw:.1f} GB/s (2-thread sum), {result['cpu']}")
    for col in ("engine", "kernel", "ms", "cpu ms", "tok/s" if args.prefill else "GB/s", "of roof", "vs ort level 4",
                "max rel. error", "load"):
        table.add_column(col, justify="left" if col in ("engine", "kernel") else "right")
    for r in rows:
        speed = f"{r['tokens_per_s']:.0f}" if args.prefill else f"{r['gb_s']:.1f}"
        table.add_row(r["engine"], r["kernel"] or "MatMulNBits", f"{r['ms_per_token']:.2f}",
                      f"{r['cpu_ms_per_token']:.2f}" if r["cpu_ms_per_token"] else "-", speed,
                      "-" if args.prefill else f"{r['share_of_roof']:.0%}",
                      f"{r['speedup_vs_ort_level4']:.2f}x" if base else "-", f"{r['max_rel_error']:.1e}",
                      "/".join(f"{x:.1f}" for x in r["load_before"]))
    Console(width=150).print(table)
    RESULTS.mkdir(exist_ok=True)
    out = args.out
    old = json.loads(out.read_text()) if out.exists() else {}
    old[args.shape + (f"-prefill{rows_x}" if args.prefill else "") + f"-{args.threads}t"] = result
    out.write_text(json.dumps(old, indent=2) + "\n")
    print(f"wrote {out}")


def _cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


if __name__ == "__main__":
    main()
