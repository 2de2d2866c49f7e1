"""The 8-bit KV cache on MLX's GPU: fuselm `--kv-bits 8` against mlx-lm's quantized cache (`kv_bits=8`).

    python bench/mlx_kv8.py --shapes 0.6b --contexts 8192 32768 --runs 3
    python bench/mlx_kv8.py --shapes tiny --contexts 512 --runs 1 --decode 8      # MLX's CPU backend

Same checkpoints and graphs as bench/mlx_peer.py (4-bit weights at --group for every matrix, its
`prepare`); each engine in its own process, interleaved run by run: C prompt tokens, then --decode
greedy tokens; decode tokens/s is the median interval between tokens, and each engine reports its
peak device memory. Both caches are affine 8-bit, groups of 64 channels, half-precision scales and
biases (mlx-lm's QuantizedKVCache; fuselm's kvcache.py). For reference each engine runs with its own
half-precision cache too (`mlx-lm-kv16`, `fuselm-kv16`): where a device's MLX has no kernel for mlx-lm's
8-bit attention (MLX's CUDA backend), its row records the error and fuselm's 8-bit cache is compared with
mlx-lm's default cache. Writes bench/results/mlx-kv8-<device>.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("bench_mlx_peer", HERE / "mlx_peer.py")
peer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer)
GROUP = 64


def child(engine: str, model: Path, dtype: str, contexts: list[int], decode: int, runs: int) -> dict:
    import mlx.core as mx

    kv8 = not engine.endswith("-kv16")  # "-kv16": the engine's own half-precision cache, for reference
    if engine.startswith("mlx-lm"):
        from mlx_lm import load
        from mlx_lm.generate import generate_step

        lm, _ = load(str(model))
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]

        def tokens(prompt, n):
            q = {"kv_bits": 8, "kv_group_size": GROUP, "quantized_kv_start": 0} if kv8 else {}
            return (t for t, _ in generate_step(mx.array(prompt), lm, max_tokens=n, **q))
        what = "mlx-lm generate_step" + (", kv_bits=8" if kv8 else "")
    else:
        from fuselm.runtime_metal.sampling import Sampler

        import fuselm

        sess = fuselm.load(model, backend="mlx", dtype=dtype, **({"kv_bits": 8, "kv_group_size": GROUP} if kv8 else {})).session
        vocab, sampler = sess.meta["dims"]["vocab"], Sampler()

        def tokens(prompt, n):
            sess.reset(len(prompt) + n + 1)
            return sess.generate(prompt, n, sampler)
        what = sess.describe()
    out = {}
    for c in contexts:
        rates = []
        for r in range(runs + 1):  # run 0 warms up
            times, t = [], time.perf_counter()
            for _ in tokens(peer._ids(c, vocab, r), decode):
                now = time.perf_counter()
                times.append(now - t)
                t = now
            if r:
                rates.append(1 / statistics.median(times[1:]))
        out[str(c)] = rates
    return {"decode_runs": out, "peak_memory_gb": mx.get_peak_memory() / 1e9, "what": what,
            "device": str(mx.default_device())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=["0.6b"], choices=["tiny", "0.6b", "4b"])
    ap.add_argument("--group", type=int, default=32, help="the weights' group size (as bench/mlx_peer.py)")
    ap.add_argument("--contexts", nargs="*", type=int, default=[8192, 32768])
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--work", type=Path, default=Path("/tmp/fuselm-bench-mlx"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args.child, Path(args.model), args.dtype, args.contexts, args.decode,
                                           args.runs)), flush=True)
        return 0
    import mlx.core as mx

    gpu = "gpu" in str(mx.default_device())
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if gpu else "f32")
    rows = []
    for shape in args.shapes:
        paths = peer.prepare(shape, args.group, args.work, dtype)
        for engine in ("mlx-lm", "fuselm", "mlx-lm-kv16", "fuselm-kv16"):
            model = paths["mlx-lm" if engine.startswith("mlx-lm") else "fuselm"]
            cmd = [sys.executable, __file__, "--child", engine, "--model", str(model), "--dtype", dtype, "--decode",
                   str(args.decode), "--runs", str(args.runs), "--contexts", *map(str, args.contexts)]
            res = subprocess.run(cmd, capture_output=True, text=True)
            line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
            row = json.loads(line[7:]) if line else {"error": res.stderr.strip()[-600:]}
            row.update(engine=engine, shape=shape, group=args.group)
            if "decode_runs" in row:
                row["decode_tok_s"] = {c: peer.spread(v) for c, v in row["decode_runs"].items()}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "decode_runs"}), flush=True)
    summary = {}
    for shape in args.shapes:
        got = {r["engine"]: r for r in rows if r["shape"] == shape and "decode_tok_s" in r}
        for ours, theirs in (("fuselm", "mlx-lm-kv16"), ("fuselm-kv16", "mlx-lm-kv16")):
            if ours in got and theirs in got:
                for c in map(str, args.contexts):
                    summary[f"{shape} {ours}/{theirs} decode@{c}"] = round(
                        got[ours]["decode_tok_s"][c]["median"] / got[theirs]["decode_tok_s"][c]["median"], 2)
        summary[f"{shape} peak memory GB"] = {e: round(r["peak_memory_gb"], 2) for e, r in got.items()}
        if "fuselm" in got and "mlx-lm" in got:
            for c in map(str, args.contexts):
                summary[f"{shape} fuselm/mlx-lm kv8 decode@{c}"] = round(
                    got["fuselm"]["decode_tok_s"][c]["median"] / got["mlx-lm"]["decode_tok_s"][c]["median"], 2)
    print(json.dumps(summary, indent=1))
    out = args.out or HERE / "results" / f"mlx-kv8-{'gpu' if gpu else 'cpu'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": {"platform": platform.platform(), "mlx": mx.__version__},
                               "command": " ".join(["python", "bench/mlx_kv8.py", *(argv or sys.argv[1:])]),
                               "rows": rows, "summary": summary}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
