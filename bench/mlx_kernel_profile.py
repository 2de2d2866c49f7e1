"""Where a decode token's device time goes, kernel by kernel, fuselm's MLX backend against mlx-lm.

On MLX's CUDA backend (the lent H200) the kernels of one process are recorded by CUPTI through
torch.profiler (it records every CUDA kernel of the process, MLX's included); each engine runs in its
own process (bench/mlx_peer.py's engines), decodes N greedy tokens after a C-token prompt under the
profiler, and prints the kernels' summed device time per token by kernel name, the device's busy time
per token and the wall time per token. Run on a machine with a CUDA GPU, MLX's CUDA build and torch:

    python bench/mlx_kernel_profile.py --fuselm MODEL_DIR --mlx-lm MLX_DIR [--context 128] [--tokens 32]
    python bench/mlx_kernel_profile.py --shape 0.6b --group 32 --work DIR   # both made as bench/mlx_peer.py makes them
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def profile(engine: str, model: Path, context: int, tokens: int, dtype: str) -> dict:
    import mlx_peer
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    e = mlx_peer.MlxLmEngine(model) if engine == "mlx-lm" else mlx_peer.FuselmEngine(model, dtype, compile_=True)
    prompt = mlx_peer._ids(context, e.vocab, 3)
    for _ in e.tokens(prompt, 8):  # warm-up: compile, the checked step
        pass
    torch.cuda.init()
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        stamps = []
        for _ in e.tokens(prompt, tokens):
            stamps.append(time.perf_counter())
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    kernels = [ev for ev in events if ev.get("cat") == "kernel"]
    by_name, count = defaultdict(float), defaultdict(int)
    for k in kernels:
        name = k["name"][:90]  # (a template kernel's name runs to kilobytes)
        by_name[name] += k["dur"]
        count[name] += 1
    wall = (stamps[-1] - stamps[0]) / (tokens - 1) * 1e6  # between the first token (the prefill's) and the last
    busy = sum(by_name.values()) / tokens
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:25]
    return {"engine": engine, "what": e.what(), "tokens": tokens, "context": context,
            "wall_us_per_token": wall, "kernel_us_per_token_incl_prefill": busy,
            "kernels_per_token_incl_prefill": len(kernels) / tokens,
            "top": [{"kernel": n, "us_per_token": d / tokens, "calls_per_token": count[n] / tokens,
                     "us_per_call": d / count[n]} for n, d in top]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fuselm", type=Path)
    ap.add_argument("--mlx-lm", type=Path)
    ap.add_argument("--shape", default=None, help="prepare both models as bench/mlx_peer.py does (0.6b, 4b, ...)")
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--work", type=Path, default=Path("/tmp/fuselm-bench-mlx"))
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(profile(args.child, args.model, args.context, args.tokens, args.dtype)))
        return 0
    if args.shape:
        import mlx_peer

        made = mlx_peer.prepare(args.shape, args.group, args.work, args.dtype)
        args.fuselm, args.mlx_lm = made["fuselm"], made["mlx-lm"]
    rows = []
    for engine, model in (("mlx-lm", args.mlx_lm), ("fuselm", args.fuselm)):
        if model is None:
            continue
        out = subprocess.run([sys.executable, __file__, "--child", engine, "--model", str(model), "--context",
                              str(args.context), "--tokens", str(args.tokens), "--dtype", args.dtype],
                             capture_output=True, text=True)
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if not line:
            print(f"{engine} failed:\n{out.stderr[-3000:]}", file=sys.stderr)
            continue
        row = json.loads(line[-1][7:])
        rows.append(row)
        print(f"== {engine}: wall {row['wall_us_per_token']:.0f} us/token, kernels "
              f"{row['kernel_us_per_token_incl_prefill']:.0f} us/token over "
              f"{row['kernels_per_token_incl_prefill']:.0f} kernels (the prefill's spread over the tokens)")
        for t in row["top"]:
            print(f"   {t['us_per_token']:8.1f} us/token {t['calls_per_token']:6.1f} calls {t['us_per_call']:7.2f} us/call  {t['kernel']}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
