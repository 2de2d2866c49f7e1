"""Host overhead of the pipeline: decode per-token time of one process vs a `fuselm split` run by
fuselm's own launch and by `mlx.launch`, over MLX's ring backend, 2 (and 3) processes on this machine (the hop is local).

    python bench/pipeline.py                       # tiny shape, q4, 2 and 3 ranks
    python bench/pipeline.py --quant f32 --tokens 256 --ranks 2

One process: `fuselm.stream_generate` on the unsplit graph, in its own process. N ranks: the split, each rank one stage
(runtime_metal/pipeline_run.py), started by fuselm itself (`fuselm run SPLIT` with no launcher:
runtime_metal/pipeline_launch.py) and by `mlx.launch`, side by side. Both on MLX's CPU backend with the same Session (static-shape decode,
compiled); the per-token time is the median interval between printed tokens after the first
--warmup tokens; the configurations run interleaved, --runs times, and the table gives the median run
(and the spread). Each rank also reports MLX's peak memory against its stage's weight bytes + its KV
cache. Aims: 2 ranks within 1.3x of 1; a rank's peak <= its weights + cache + 15 %.
Writes bench/results/pipeline.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SHAPES = {"tiny": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       intermediate_size=512, tie_word_embeddings=False),  # bench/convert.py's "tiny", untied
          # weights large enough that a rank's fixed costs (prefill activations, the logits) are small beside them
          "small": dict(num_hidden_layers=8, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                        head_dim=64, intermediate_size=3072, tie_word_embeddings=False),
          # Qwen3-0.6B's layers (the tiny tokenizer's vocabulary): for a GPU, where a stage's weights are
          # hundreds of MB and the fixed costs vanish beside them
          "0.6b": dict(num_hidden_layers=28, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, tie_word_embeddings=False)}
PROMPT = [5, 6, 7, 40, 41, 42, 9, 300]


SINGLE = """
import json, sys, time
import fuselm
stamps = []
for _ in fuselm.stream_generate(sys.argv[1], prompt=json.loads(sys.argv[2]), max_tokens=int(sys.argv[3]),
                                ignore_eos=True, backend="mlx", device=sys.argv[5], dtype=sys.argv[4]):
    stamps.append(time.perf_counter())
print(json.dumps([b - a for a, b in zip(stamps, stamps[1:])]))
"""


def single(model: Path, tokens: int, dtype: str, device: str = "cpu") -> list[float]:
    """One process on the unsplit graph (its own process, like each rank)."""
    p = subprocess.run([sys.executable, "-c", SINGLE, str(model), json.dumps(PROMPT), str(tokens), dtype, device],
                       capture_output=True, text=True, timeout=600)
    return json.loads(_result_line(p, "the single-process run"))


def _result_line(p: subprocess.CompletedProcess, what: str) -> str:
    """The child's last stdout line (its JSON); a child that printed it and then failed is said, not hidden."""
    lines = p.stdout.strip().splitlines()
    if not lines or not lines[-1].startswith(("[", "{")):
        raise SystemExit(f"{what} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    if p.returncode:
        print(f"  warning: {what} printed its result, then exited with {p.returncode}: {p.stderr[-300:].strip()}",
              file=sys.stderr)
    return lines[-1]


# fuselm's own one-host launch: `fuselm.run(SPLIT)` in a process no launcher started (pipeline_launch.py)
LOCAL = """
import json, os, sys
import fuselm
r = fuselm.run(sys.argv[1], prompt=json.loads(sys.argv[2]), max_tokens=int(sys.argv[3]), ignore_eos=True,
               device=sys.argv[5], dtype=sys.argv[4], quiet=True, stream=open(os.devnull, "w"))
print(json.dumps(r))
"""


def pipeline(split_dir: Path, ranks: int, tokens: int, work: Path, launcher: str,
             dtype: str, device: str = "cpu") -> tuple[list[float], list[dict]]:
    """(token intervals on the last rank, each rank's memory report) of one run started by fuselm itself
    (`launcher` "fuselm") or by `mlx.launch` ("mlx.launch")."""
    from test_pipeline_run import DRIVER, launch

    if launcher == "fuselm":
        p = subprocess.run([sys.executable, "-c", LOCAL, str(split_dir), json.dumps(PROMPT), str(tokens), dtype,
                            device],
                           capture_output=True, text=True, timeout=600)
        last = json.loads(_result_line(p, "the pipeline run"))
        seconds, reports = last["token_seconds"], last["ranks"]
    else:
        for f in work.glob("*.json"):
            f.unlink()
        cli = ["run", str(split_dir), "--prompt-ids", "5", "--max-tokens", "1", "--device", device]
        kw = {"prompt_ids": PROMPT, "max_tokens": tokens, "ignore_eos": True, "device": device, "dtype": dtype}
        p = launch(ranks, "-c", DRIVER, str(work), json.dumps([(str(split_dir), kw), cli]), timeout=600)
        results = [work / f"0-rank{r}.json" for r in range(ranks)]
        if not all(r.is_file() for r in results):
            raise SystemExit(f"the pipeline run failed:\n{p.stderr[-3000:]}")
        results = [json.loads(r.read_text()) for r in results]
        seconds, reports = results[-1]["token_seconds"], [r["memory"] for r in results]
    stages = json.loads((split_dir / "split.json").read_text())["stages"]
    memory = [{**m, "weight_bytes": st["bytes"], "ratio": m["mlx_peak_bytes"] / (st["bytes"] + m["cache_bytes"]),
               "ratio_held": m["mlx_peak_bytes"] / m["held_bytes"]}
              for m, st in zip(reports, stages, strict=True)]
    return seconds, memory


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


# the CPU a rank burns while it waits for a message: MLX's ring backend polls its non-blocking socket
# (mlx/distributed/ring/ring.cpp, SocketThread::worker), so a waiting rank keeps a core busy
SPIN = """
import json, sys, time
import mlx.core as mx
g = mx.distributed.init(strict=True, backend="ring")
mx.set_default_device(mx.cpu)
x = mx.zeros((1, 1, 8))
if g.rank() == 0:
    time.sleep(2)
    mx.eval(mx.distributed.send(x, 1))
else:
    c, t = time.process_time(), time.perf_counter()
    mx.eval(mx.distributed.recv_like(x, 0))
    json.dump((time.process_time() - c) / (time.perf_counter() - t), open(sys.argv[1], "w"))
"""


def spin(work: Path) -> float:
    """CPU seconds per second a rank spends waiting 2 s for a message."""
    from test_pipeline_run import launch

    launch(2, "-c", SPIN, str(work / "spin.json"))
    return json.loads((work / "spin.json").read_text())


def hop(hidden: int, work: Path) -> float:
    from test_pipeline_run import launch

    launch(2, "-c", HOP, str(work / "hop.json"), str(hidden))
    return 1000 * json.loads((work / "hop.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quant", choices=["f32", "q4"], default="q4")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=8, help="first decode steps left out (checking, compiling)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--launchers", nargs="+", choices=["fuselm", "mlx.launch"], default=["fuselm", "mlx.launch"],
                    help="who starts the ranks: fuselm itself (`fuselm run SPLIT`) and/or mlx.launch")
    ap.add_argument("--dtype", choices=["auto", "f32", "f16", "bf16"], default="auto",
                    help="MLX's compute dtype (auto: the device's, f32 on the CPU; MLX holds quantized scales and "
                         "biases in it)")
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu", help="MLX's device for every rank")
    ap.add_argument("--runs", type=int, default=3, help="interleaved runs of each configuration (medians)")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "pipeline.json"))
    args = ap.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    import fuselm
    from fuselm.synth import make_checkpoint

    with tempfile.TemporaryDirectory(prefix="fuselm-bench-pipe-") as tmp:
        tmp = Path(tmp)
        shape = SHAPES[args.shape]
        ckpt = make_checkpoint(tmp / "hf", "qwen3", **shape)
        fuselm.convert(ckpt, tmp / "exp", quant=args.quant, quiet=True)
        fuselm.optimize(tmp / "exp", tmp / "opt", quiet=True)
        for n in args.ranks:
            fuselm.split(tmp / "opt", tmp / f"split{n}", stages=n, quiet=True)
            (tmp / f"run{n}").mkdir()
        configs = [(n, launcher) for n in args.ranks for launcher in args.launchers]
        runs: dict[str, list[float]] = {"1 rank": [], **{f"{n} ranks ({la})": [] for n, la in configs}}
        memory: dict[str, list] = {}
        med = lambda xs: 1000 * statistics.median(xs[args.warmup:])  # noqa: E731
        for _ in range(args.runs):  # interleaved: 1 rank, 2 ranks, 3 ranks, 1 rank, ...
            runs["1 rank"].append(med(single(tmp / "opt", args.tokens, args.dtype, args.device)))
            for n, launcher in configs:
                key = f"{n} ranks ({launcher})"
                seconds, memory[key] = pipeline(tmp / f"split{n}", n, args.tokens, tmp / f"run{n}", launcher,
                                                args.dtype, args.device)
                runs[key].append(med(seconds))
        rtt = hop(shape["hidden_size"], tmp)
        waiting = spin(tmp)
    rows = {n: statistics.median(v) for n, v in runs.items()}
    load = os.getloadavg()[0]
    print(f"decode per token, MLX {args.device}, {args.quant} ({args.dtype}), hidden {shape['hidden_size']}, {shape['num_hidden_layers']} "
          f"layers, median over {args.runs} interleaved runs of each run's median of {args.tokens - 1 - args.warmup} "
          f"steps ({platform.machine()}, {os.cpu_count()} cores, load average {load:.1f})")
    for key, ms in rows.items():
        spread = f"{min(runs[key]):.3f}-{max(runs[key]):.3f}"
        print(f"  {key:>22}: {ms:7.3f} ms/token ({spread})  ({ms / rows['1 rank']:.2f}x of 1 rank)")
    for key, ranks in memory.items():
        for r, m in enumerate(ranks):
            print(f"  {key}, rank {r}: MLX peak {m['mlx_peak_bytes'] / 2**20:.2f} MiB = {m['ratio']:.2f}x its "
                  f"stage's weights in the graph ({m['weight_bytes'] / 2**20:.2f} MiB) + cache "
                  f"({m['cache_bytes'] / 2**20:.2f} MiB), {m['ratio_held']:.2f}x what it holds generating (weights as "
                  f"MLX holds them + cache: {m['held_bytes'] / 2**20:.2f} MiB); process RSS "
                  f"{m['max_rss_bytes'] / 2**20:.0f} MiB")
    print(f"  one hop's round trip (ring over loopback, [1, 1, {shape['hidden_size'] + 1}] f32 there and back): "
          f"{rtt:.3f} ms median")
    print(f"  a rank waiting for its message uses {waiting:.2f} CPU-seconds per second (MLX's ring backend polls its "
          "socket): ranks on one host share its cores with the waiting ones")
    out = {"command": "python bench/pipeline.py " + " ".join(sys.argv[1:]), "hop_round_trip_ms": rtt, "waiting_rank_cpu_per_s": waiting, "shape": shape,
           "quant": args.quant, "dtype": args.dtype, "device": args.device, "tokens": args.tokens, "warmup": args.warmup, "runs": args.runs,
           "machine": f"{platform.machine()}, {os.cpu_count()} cores", "load_average": load, "ms_per_token": rows,
           "ms_per_token_runs": runs, "ratio": {k: ms / rows["1 rank"] for k, ms in rows.items()}, "memory": memory}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
