"""First-token time of `fuselm run` in a fresh process: `--backend auto` on a standard q4 graph on a CPU
before its lowered copy exists (it lowers it, fuselm/ort_prepared.py) and after (it reads it), against
`--backend torch`. Each run is a new interpreter; the time is from its start to the first token (a
32-token prompt, one token). Rows record the 1-minute load average (the box may be shared).

    python bench/first_token.py MODEL_DIR [--rounds 2] [--out bench/results/cpu-auto-first-token.json]

MODEL_DIR: a standard q4 model directory (bench/cpu_auto.py's qwen3-0.6b-q4-optimized); its
.fuselm-prepared/onnxruntime-* copies are removed before each round.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = """
import io, json, sys, time
t0 = time.time()
import fuselm
r = fuselm.run(sys.argv[1], prompt_ids=list(range(100, 132)), max_tokens=1, ignore_eos=True, quiet=True,
               stream=io.StringIO(), backend=sys.argv[2])
print(json.dumps({"ran": r["backend"], "first_token_s": round(time.time() - t0, 2), "why": r.get("why")}))
"""


def one(model: Path, backend: str) -> dict:
    load = os.getloadavg()[0]
    env = {**os.environ, "FUSELM_PREPARED": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(model), backend], env=env, check=True,
                         capture_output=True, text=True).stdout
    return {**json.loads(out.strip().splitlines()[-1]), "load_before": round(load, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cpu-auto-first-token.json")
    args = ap.parse_args()
    rows: dict[str, list] = {"auto, first run (lowers)": [], "auto, second run (reads the copy)": [], "torch": []}
    for _ in range(args.rounds):
        for old in (args.model / ".fuselm-prepared").glob("onnxruntime-*"):
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        for name, backend in zip(rows, ("auto", "auto", "torch"), strict=True):
            rows[name].append(one(args.model, backend))
            print(name, rows[name][-1]["first_token_s"], "s", file=sys.stderr)
    table = {name: {"median_s": round(statistics.median(r["first_token_s"] for r in runs), 2), "runs": runs}
             for name, runs in rows.items()}
    args.out.write_text(json.dumps({"command": " ".join(["python", "bench/first_token.py", *sys.argv[1:]]),
                                    "cpus": os.cpu_count(), "rows": table}, indent=1) + "\n")
    for name, row in table.items():
        print(f"{name}: {row['median_s']} s")


if __name__ == "__main__":
    main()
