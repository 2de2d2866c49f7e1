"""Two ways MLX can run a prompt chunk's 4-bit matmul, side by side on one device, per weight shape.

    python bench/mlx_qmm_forms.py                       # Qwen3-0.6B and 4B weights, M = 1 .. 2048, g32 and g64
    python bench/mlx_qmm_forms.py --shapes tiny --rows 1 64 --groups 32   # MLX's CPU backend (seconds)

For each weight [N, K] of one layer (fused qkv, o, gate/up, down) and each row count M, random
weights quantized by `mx.quantize` (affine, 4 bits) and x [M, K] in the compute dtype:
- `quantized`: `mx.quantized_matmul(x, wq, scales, biases, transpose=True)` (what fuselm and mlx-lm run);
- `dequantize`: `mx.dequantize(...)` to the compute dtype, then `x @ wᵀ` (a dense GEMM on a transient copy);
- `dense`: `x @ wᵀ` on a weight already in the compute dtype (the bound neither can beat).
Each is the median over `--iters` evaluations after a warm-up, every evaluation synchronised (`mx.eval`) and
holding `--per-eval` products (default mlx_forms.PER_EVAL, as the backend's probe times them: the wait for the
device is paid once per evaluation, as in a prompt chunk); times are per product.
Prints a table (TFLOP/s and the dequantize/quantized time ratio) and writes bench/results/mlx-qmm-forms-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
SHAPES = {  # (N out, K in) of one layer's matrices: fused qkv, o, fused gate/up, down
    "0.6b": [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)],
    "4b": [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)],
    "tiny": [(512, 256), (256, 256), (1024, 256), (256, 512)],
}


def timed(fn, iters: int, per_eval: int) -> float:
    """Seconds per product: the median evaluation of `per_eval` products, divided by per_eval."""
    import mlx.core as mx

    for _ in range(2):
        mx.eval(fn())
    seconds = []
    for _ in range(iters):
        t = time.perf_counter()
        mx.eval([fn() for _ in range(per_eval)])
        seconds.append(time.perf_counter() - t)
    return statistics.median(seconds) / per_eval


def measure(n: int, k: int, m: int, group: int, dtype, iters: int, per_eval: int) -> dict:
    import mlx.core as mx
    from fuselm.runtime_metal.backends import mlx_forms

    w = (mx.random.normal((n, k)) * 0.02).astype(dtype)
    wq, s, b = mx.quantize(w, group_size=group, bits=4)
    x = mx.random.normal((m, k)).astype(dtype)
    mx.eval(w, wq, s, b, x)
    # the two forms fuselm's MLX backend chooses between (runtime_metal/backends/mlx_forms.py), and the bound
    forms = {**mlx_forms.products(x, wq, s, b, group, 4), "dense": lambda: x @ w.T}
    row = {"n": n, "k": k, "m": m, "group": group}
    for name, fn in forms.items():
        sec = timed(fn, iters, per_eval)
        row[name + "_us"] = round(sec * 1e6, 1)
        row[name + "_tflops"] = round(2 * m * n * k / sec / 1e12, 2)
    row["dequantize_over_quantized"] = round(row["dequantize_us"] / row["quantized_us"], 3)
    err = mx.abs(forms["quantized"]().astype(mx.float32) - forms["dequantize"]().astype(mx.float32)).max().item()
    row["max_abs_diff"] = float(err)
    return row


def main(argv=None) -> int:
    import mlx.core as mx

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=["0.6b", "4b"], choices=list(SHAPES))
    ap.add_argument("--rows", nargs="*", type=int, default=[1, 128, 512, 2048])
    ap.add_argument("--groups", nargs="*", type=int, default=[32, 64])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--per-eval", type=int, default=None, help="products per evaluation (default: the backend "
                    "probe's, runtime_metal/backends/mlx_forms.py PER_EVAL; 1 times each kernel with its own wait)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from fuselm.runtime_metal.backends import mlx_forms

    per_eval = args.per_eval or mlx_forms.PER_EVAL
    dtype = getattr(mx, args.dtype)
    device = str(mx.default_device())
    rows = []
    for shape in args.shapes:
        for group in args.groups:
            for n, k in SHAPES[shape]:
                for m in args.rows:
                    row = {"shape": shape, **measure(n, k, m, group, dtype, args.iters, per_eval)}
                    rows.append(row)
                    print(f"{shape:5} g{group} [{n:5}x{k:5}] M={m:5}: quantized {row['quantized_us']:9.1f} us "
                          f"({row['quantized_tflops']:6.1f} TF/s)  dequantize+matmul {row['dequantize_us']:9.1f} us "
                          f"({row['dequantize_tflops']:6.1f})  dense {row['dense_us']:9.1f} us "
                          f"({row['dense_tflops']:6.1f})  ratio {row['dequantize_over_quantized']:.2f}", flush=True)
    gpu = "gpu" in device
    out = args.out or RESULTS / f"mlx-qmm-forms-{'gpu' if gpu else 'cpu'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "python bench/mlx_qmm_forms.py " + " ".join(argv or []),
                               "device": device, "mlx": mx.__version__, "machine": platform.platform(),
                               "dtype": args.dtype, "per_eval": per_eval, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
