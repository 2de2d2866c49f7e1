"""Which of fuselm's own CPU paths is faster on a graph: the torch backend or `--backend onnxruntime`
(runtime_metal/engines/ort.py: onnxruntime-genai, or onnxruntime with IO binding). The figures behind `--backend
auto`'s rule on a machine without a GPU (runtime_metal/engines/auto.py).

    python bench/cpu_auto.py                    # Qwen3-0.6B shape, q4, 3 rounds
    python bench/cpu_auto.py --tiny             # a tiny config: a smoke test in about a minute

One random-weight Qwen3-shaped checkpoint (bench/runtime.py's preparation: `fuselm convert --quant q4`
+ `fuselm optimize`), and the same lowered by `fuselm optimize --target onnxruntime`. Engines, each
what `fuselm run` runs:
- `torch`: the torch CPU backend on the standard graph (`--backend torch`, eager: run's CPU default),
- `ort`, `genai`: `--backend onnxruntime` on the standard graph through IO binding / onnxruntime-genai,
- `ort-lowered`, `genai-lowered`: the same on the lowered graph.
Interleaved: each round starts every engine in turn in a fresh child process (its own threads and
memory, none spinning beside another), in a rotated order; each child warms up, then times a
128-token prompt to its first token (prefill) and 32 greedy decode steps (the median step), and a
512-token prefill. Medians over the rounds; every row records the 1-minute load average before it
started (the box may be shared). Writes bench/results/cpu-auto.json (--tiny: cpu-auto-tiny.json).
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

HERE = Path(__file__).parent
RESULTS = HERE / "results"
ENGINES = ("torch", "ort", "genai", "ort-lowered", "genai-lowered")


def _cpu_peer():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_cpu_peer", HERE / "cpu_peer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class LoopEngine:
    """The onnxruntime engine (runtime_metal/engines/ort.py: what `fuselm run --backend onnxruntime` drives) on one
    of its loops, greedy, step by step through its generation loop."""

    def __init__(self, model: Path, loop: str, threads: int):
        from fuselm.runtime_metal.engines.ort import OrtEngine

        from fuselm.options import Options

        self.engine = OrtEngine(model, model, Options(threads=threads), loop=loop)
        self.what, self.gen = self.engine.describe(), None

    def prefill(self, ids: list[int], room: int) -> int:
        from fuselm.runtime_metal.sampling import Sampler

        self.gen = None  # free the previous cache first
        self.gen = self.engine.generate(ids, room + 1, Sampler())
        return next(self.gen)

    def step(self, token: int) -> int:
        return next(self.gen)


def child(args) -> None:
    peer = _cpu_peer()
    vocab = json.loads((Path(args.ckpt) / "config.json").read_text())["vocab_size"]
    t0 = time.perf_counter()
    if args.child == "torch":
        engine = peer.FuselmEngine(Path(args.model), backend="torch", device="cpu", threads=args.threads)
    else:
        engine = LoopEngine(Path(args.model), args.child.split("-")[0], args.threads)
    load = time.perf_counter() - t0
    token = engine.prefill(peer._ids(16, vocab, 1), 5)  # warm-up: first-run allocations, torch's static-step check
    for _ in range(4):
        token = engine.step(token)
    ids = peer._ids(args.prompt, vocab, 100 + args.round)
    t = time.perf_counter()
    token = engine.prefill(ids, args.steps + 1)
    prefill = args.prompt / (time.perf_counter() - t)
    c = time.process_time()
    _, decode = peer._decode_rate(engine, token, args.steps)
    cpu_ms = (time.process_time() - c) / args.steps * 1e3
    t = time.perf_counter()
    engine.prefill(peer._ids(args.prefill, vocab, 200 + args.round), 1)
    prefill_long = args.prefill / (time.perf_counter() - t)
    print("RESULT " + json.dumps({
        "decode_tok_s": round(decode, 2), "decode_cpu_ms_per_token": round(cpu_ms, 1),
        f"prefill_{args.prompt}_tok_s": round(prefill, 1), f"prefill_{args.prefill}_tok_s": round(prefill_long, 1),
        "load_s": round(load, 2), "what": engine.what, "peak_rss_mb": peer._peak_rss_mb()}), flush=True)


def spawn(engine: str, model: Path, ckpt: Path, r: int, args) -> dict:
    cmd = [sys.executable, __file__, "--child", engine, "--model", str(model), "--ckpt", str(ckpt), "--round", str(r),
           "--threads", str(args.threads), "--prompt", str(args.prompt), "--steps", str(args.steps),
           "--prefill", str(args.prefill)]
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        return {"error": " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])[:500],
                "load_before": round(load, 2)}
    return {**json.loads(line[len("RESULT "):]), "load_before": round(load, 2)}


def prepare(shape: str, work: Path) -> tuple[Path, Path, Path]:
    """The checkpoint, fuselm's optimized q4 graph and the same lowered for onnxruntime (accuracy level 4)."""
    ckpt, models = _cpu_peer()._bench_module("runtime").prepare(shape, work, ["q4"])
    lowered = work / f"qwen3-{shape}-q4-onnxruntime"
    if not (lowered / "genai_config.json").is_file():
        subprocess.run([sys.executable, "-m", "fuselm.cli", "optimize", str(models["q4"][0]), "-o", str(lowered),
                        "--target", "onnxruntime", "--force", "--quiet"], check=True)
    return ckpt, models["q4"][1], lowered


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="0.6b", choices=["0.6b", "4b"])
    ap.add_argument("--tiny", action="store_true", help="a tiny config, short prompts, 1 round: a smoke test")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", nargs="*", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "fuselm-bench-cpu-auto")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/cpu-auto[-tiny].json)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--prompt", type=int, default=128, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=32, help=argparse.SUPPRESS)
    ap.add_argument("--prefill", type=int, default=512, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0
    shape = "tiny" if args.tiny else args.shape
    if args.tiny:
        args.rounds, args.prompt, args.steps, args.prefill = 1, 16, 4, 32
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        args.engines = [e for e in args.engines if not e.startswith("genai")]
    ckpt, standard, lowered = prepare(shape, args.work / shape)
    models = {e: lowered if e.endswith("-lowered") else standard for e in args.engines}
    runs: dict = {e: [] for e in args.engines}
    for r in range(args.rounds):
        order = args.engines[r % len(args.engines):] + args.engines[:r % len(args.engines)]
        for e in order:
            runs[e].append(spawn(e, models[e], ckpt, r, args))
            print(f"round {r} {e}: {json.dumps(runs[e][-1])}", flush=True)
    keys = ("decode_tok_s", "decode_cpu_ms_per_token", f"prefill_{args.prompt}_tok_s", f"prefill_{args.prefill}_tok_s")
    rows = {}
    for e, rs in runs.items():
        ok = [x for x in rs if "error" not in x]
        rows[e] = {"model": models[e].name, "runs": rs} if not ok else {
            "model": models[e].name, "what": ok[0]["what"], **{k: statistics.median(x[k] for x in ok) for k in keys},
            "peak_rss_mb": max(x["peak_rss_mb"] for x in ok), "load_before": [x["load_before"] for x in rs], "runs": rs}
    base = rows.get("torch", {})
    for e, row in rows.items():
        if e != "torch" and "decode_tok_s" in row and "decode_tok_s" in base:
            row["vs_torch"] = {k: round(row[k] / base[k], 2) for k in keys if k != "decode_cpu_ms_per_token"}
        print(f"{e:14s} " + json.dumps({k: v for k, v in row.items() if k != "runs"}))
    out = args.out or RESULTS / ("cpu-auto-tiny.json" if args.tiny else "cpu-auto.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = "python bench/cpu_auto.py " + " ".join(sys.argv[1:] if argv is None else argv)
    out.write_text(json.dumps({"command": cmd, "machine": _cpu_peer().machine(), "shape": shape, "protocol": {
        "threads": args.threads, "rounds": args.rounds, "prompt": args.prompt, "decode_steps": args.steps,
        "prefill": args.prefill}, "load_after": round(os.getloadavg()[0], 2), "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if all("error" not in x for rs in runs.values() for x in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
