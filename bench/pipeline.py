"""Host overhead of the pipeline: decode per-token time of one process vs a `fuselm split` run by
`mlx.launch` over MLX's ring backend, 2 (and 3) processes on this machine (the hop is local).

    python bench/pipeline.py                       # tiny shape, q4, 2 and 3 ranks
    python bench/pipeline.py --quant f32 --tokens 256 --ranks 2

One process: `fuselm.stream_generate` on the unsplit graph. N ranks: the split, each rank one stage
(runtime_metal/pipeline_run.py). Both on MLX's CPU backend with the same Session (static-shape decode,
compiled); the per-token time is the median interval between printed tokens after the first
--warmup tokens. Goal (issue 20): 2 ranks within 1.3x of 1. Writes bench/results/pipeline.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SHAPE = dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             intermediate_size=512, tie_word_embeddings=False)  # bench/convert.py's "tiny", untied
PROMPT = [5, 6, 7, 40, 41, 42, 9, 300]


def single(model: Path, tokens: int) -> list[float]:
    import fuselm

    stamps = []
    for _ in fuselm.stream_generate(str(model), prompt_ids=PROMPT, max_tokens=tokens, ignore_eos=True,
                                    backend="mlx", device="cpu"):
        stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def pipeline(split_dir: Path, ranks: int, tokens: int, work: Path) -> list[float]:
    from test_pipeline_run import DRIVER, launch

    cli = ["run", str(split_dir), "--prompt-ids", "5", "--max-tokens", "1", "--device", "cpu"]
    kw = {"prompt_ids": PROMPT, "max_tokens": tokens, "ignore_eos": True, "device": "cpu"}
    p = launch(ranks, "-c", DRIVER, str(work), json.dumps([(str(split_dir), kw), cli]), timeout=600)
    result = work / f"0-rank{ranks - 1}.json"
    if not result.is_file():
        raise SystemExit(f"the pipeline run failed:\n{p.stderr[-3000:]}")
    return json.loads(result.read_text())["token_seconds"]


# one hop's round trip: a [1, 1, hidden + 1] message there and back between two ranks, 200 times
HOP = """
import json, os, sys, time
import mlx.core as mx
g = mx.distributed.init(strict=True, backend="ring")
mx.set_default_device(mx.cpu)
x, ts = mx.zeros((1, 1, int(sys.argv[2]) + 1)), []
for i in range(200):
    t = time.perf_counter()
    if g.rank() == 0:
        mx.eval(mx.distributed.send(x + i, 1)); mx.eval(mx.distributed.recv_like(x, 1))
    else:
        y = mx.distributed.recv_like(x, 0); mx.eval(y); mx.eval(mx.distributed.send(y, 0))
    ts.append(time.perf_counter() - t)
if g.rank() == 0:
    json.dump(sorted(ts)[100], open(sys.argv[1], "w"))
"""


def hop(hidden: int, work: Path) -> float:
    from test_pipeline_run import launch

    launch(2, "-c", HOP, str(work / "hop.json"), str(hidden))
    return 1000 * json.loads((work / "hop.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quant", choices=["f32", "q4"], default="q4")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=8, help="first decode steps left out (checking, compiling)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "pipeline.json"))
    args = ap.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    import fuselm
    from fuselm.synth import make_checkpoint

    with tempfile.TemporaryDirectory(prefix="fuselm-bench-pipe-") as tmp:
        tmp = Path(tmp)
        ckpt = make_checkpoint(tmp / "hf", "qwen3", **SHAPE)
        fuselm.convert(ckpt, tmp / "exp", quant=args.quant, quiet=True)
        fuselm.optimize(tmp / "exp", tmp / "opt", quiet=True)
        rows = {}
        med = lambda xs: 1000 * statistics.median(xs[args.warmup:])  # noqa: E731
        rows[1] = med(single(tmp / "opt", args.tokens))
        for n in args.ranks:
            fuselm.split(tmp / "opt", tmp / f"split{n}", stages=n, quiet=True)
            work = tmp / f"run{n}"
            work.mkdir()
            rows[n] = med(pipeline(tmp / f"split{n}", n, args.tokens, work))
        rtt = hop(SHAPE["hidden_size"], tmp)
    load = os.getloadavg()[0]
    print(f"decode per token, MLX CPU, {args.quant}, hidden {SHAPE['hidden_size']}, {SHAPE['num_hidden_layers']} "
          f"layers, median of {args.tokens - 1 - args.warmup} steps ({platform.machine()}, {os.cpu_count()} cores, "
          f"load average {load:.1f})")
    for n, ms in rows.items():
        print(f"  {n} rank{'s' if n > 1 else ' '}: {ms:7.3f} ms/token  ({ms / rows[1]:.2f}x of 1 rank)")
    print(f"  one hop's round trip (ring over loopback, [1, 1, {SHAPE['hidden_size'] + 1}] f32 there and back): "
          f"{rtt:.3f} ms median")
    out = {"hop_round_trip_ms": rtt, "shape": SHAPE, "quant": args.quant, "tokens": args.tokens, "warmup": args.warmup,
           "machine": f"{platform.machine()}, {os.cpu_count()} cores", "load_average": load, "ms_per_token": rows,
           "ratio": {n: ms / rows[1] for n, ms in rows.items()}}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
