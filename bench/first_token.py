"""First-token time of `fuselm run` in a fresh process: `--backend auto` on a standard q4 graph on a CPU
before its lowered copy exists (it lowers it, runtime_metal/engines/ort_prepared.py) and after (it reads it), against
`--backend torch`. Each run is a new interpreter; the time is from its start to the first token (a
32-token prompt, one token), with the process's CPU time beside it (the box may be shared: the CPU time
moves less with the load than the wall). Rows record the 1-minute load average before them.

    python bench/first_token.py MODEL_DIR [--rounds 3] [--baseline PYTHON] [--out bench/results/cpu-auto-first-token.json]

MODEL_DIR: a standard q4 model directory (bench/cpu_auto.py's qwen3-0.6b-q4-optimized, e.g. made by
bench/runtime.py's `prepare("0.6b", WORK, ["q4"])`); its .fuselm-prepared/onnxruntime-* copies are removed
before each round. --baseline PYTHON: also run the same rows with another interpreter (e.g. a checkout
of fuselm before a change, its own venv), interleaved in each round, as "before" rows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import io, json, os, sys, time
t0 = time.time()
import fuselm
r = fuselm.run(sys.argv[1], prompt=list(range(100, 132)), max_tokens=1, ignore_eos=True, quiet=True,
               stream=io.StringIO(), backend=sys.argv[2])
t = os.times()
print(json.dumps({"ran": r["backend"], "first_token_s": round(time.time() - t0, 2),
                  "cpu_s": round(t.user + t.system, 2), "tokens": r["tokens"], "why": r.get("why")}))
"""
ROWS = (("auto, first run (lowers)", "auto"), ("auto, second run (reads the copy)", "auto"), ("torch", "torch"))


def one(python: str, model: Path, backend: str) -> dict:
    load = os.getloadavg()[0]
    env = {**os.environ, "FUSELM_PREPARED": "1"}
    proc = subprocess.run([python, "-c", CHILD, str(model), backend], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": " | ".join(proc.stderr.strip().splitlines()[-3:])[:500], "load_before": round(load, 2)}
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "load_before": round(load, 2)}


def processor() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return ""
    fields = dict(ln.split(":", 1) for ln in lscpu.splitlines() if ":" in ln)
    flags = fields.get("Flags", "").split()
    simd = [f for f in ("avx2", "avx512f", "avx512_vnni", "amx_int8") if f in flags]
    return f"{fields.get('Model name', '').strip()} ({', '.join(simd)})"


def versions() -> dict:
    out = {}
    for name in ("onnxruntime", "onnxruntime_genai", "tokenizers"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", default=None, help="another interpreter whose rows are recorded as 'before'")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cpu-auto-first-token.json")
    args = ap.parse_args()
    sides = [("", sys.executable)] + ([("before: ", args.baseline)] if args.baseline else [])
    rows: dict[str, list] = {f"{side}{name}": [] for side, _ in sides for name, _ in ROWS}
    for r in range(args.rounds):
        for side, python in sides[r % len(sides):] + sides[:r % len(sides)]:  # who goes first alternates
            for old in (args.model / ".fuselm-prepared").glob("onnxruntime-*"):
                shutil.rmtree(old) if old.is_dir() else old.unlink()
            for name, backend in ROWS:
                rows[f"{side}{name}"].append(one(python, args.model, backend))
                print(side + name, rows[f"{side}{name}"][-1].get("first_token_s"), "s", file=sys.stderr)
    table = {}
    for name, runs in rows.items():
        ok = [x for x in runs if "error" not in x]
        table[name] = {"median_s": round(statistics.median(x["first_token_s"] for x in ok), 2) if ok else None,
                       "median_cpu_s": round(statistics.median(x["cpu_s"] for x in ok), 2) if ok else None,
                       "runs": runs}
    args.out.write_text(json.dumps({
        "command": " ".join(["python", "bench/first_token.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "processor": processor(),
        "cpus": os.cpu_count(), "versions": versions(), "load_after": round(os.getloadavg()[0], 2),
        "baseline": args.baseline, "rows": table}, indent=1) + "\n")
    for name, row in table.items():
        print(f"{name}: {row['median_s']} s (CPU {row['median_cpu_s']} s)")


if __name__ == "__main__":
    main()
