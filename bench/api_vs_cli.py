"""`fuselm.stream_generate(fuselm.load(MODEL), ...)` against `fuselm run MODEL`: the Python iterator and the
command line on the same model, each in its own process, interleaved, medians of several runs.

    python bench/api_vs_cli.py MODEL_DIR [--runs 3] [--prompt 128] [--tokens 64] [--backend auto] [--out FILE]

Both decode greedily past eos (--ignore-eos) from the same random prompt ids. The command line reports its own
prefill / decode speeds (its summary line on stderr); the iterator's are read off its Responses (prompt_tps, and
generation_tps at the last token): the same definitions, the first token's time excluded from decode. A ratio
near 1.0 says both take the same engine (`fuselm.load`'s choice; the header line of each names it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _child import run_child  # noqa: E402

API = """
import json, sys, fuselm
model, ids, n, backend = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
engine = fuselm.load(model, backend=backend)
last = None
for last in fuselm.stream_generate(engine, ids, max_tokens=n, ignore_eos=True):
    pass
print(json.dumps({"prefill_tok_s": last.prompt_tps, "decode_tok_s": last.generation_tps, "what": engine.describe(),
                  "tokens": last.generation_tokens}))
"""
SUMMARY = re.compile(r"prefill (\d+) tokens:\s+([\d.]+)\s+tok/s.*decode (\d+) tokens:\s+([\d.]+)\s+tok/s")


def api(model: Path, ids: list[int], n: int, backend: str) -> dict:
    c = run_child([sys.executable, "-c", API, str(model), json.dumps(ids), str(n), backend])
    if c.returncode != 0:
        return {"error": c.tail()}
    return {**json.loads(c.stdout.strip().splitlines()[-1]), "wall_s": round(c.wall_s, 2), "cpu_s": round(c.cpu_s, 2)}


def cli(model: Path, ids: list[int], n: int, backend: str) -> dict:
    c = run_child([sys.executable, "-m", "fuselm.cli", "run", str(model), "--prompt-ids", ",".join(map(str, ids)),
                   "--max-tokens", str(n), "--ignore-eos", "--backend", backend],
                  env={**os.environ, "COLUMNS": "1000"})  # the summary on one line
    m = SUMMARY.search(c.stderr.replace("\n", " "))
    if c.returncode != 0 or m is None:
        return {"error": c.tail()}
    header = next((ln for ln in c.stderr.splitlines() if ln.startswith("fuselm run:")), "")
    return {"prefill_tok_s": float(m.group(2)), "decode_tok_s": float(m.group(4)), "what": header,
            "tokens": int(m.group(3)) + 1, "wall_s": round(c.wall_s, 2), "cpu_s": round(c.cpu_s, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import numpy as np
    from first_token import processor, versions

    vocab = json.loads((args.model / "fuselm.json").read_text())["dims"]["vocab"]
    ids = [int(i) for i in np.random.default_rng(0).integers(10, min(vocab, 50000), args.prompt)]
    rows = {"api": [], "cli": []}
    for r in range(args.runs):
        for name, fn in (("cli", cli), ("api", api)) if r % 2 else (("api", api), ("cli", cli)):
            row = fn(args.model, ids, args.tokens, args.backend)
            rows[name].append(row)
            print(name, json.dumps(row), flush=True)

    def median(name: str, key: str) -> float | None:
        got = [r[key] for r in rows[name] if key in r and r[key]]
        return round(statistics.median(got), 2) if got else None

    summary = {k: {"api": median("api", k), "cli": median("cli", k)} for k in ("prefill_tok_s", "decode_tok_s")}
    for v in summary.values():
        v["api_over_cli"] = round(v["api"] / v["cli"], 3) if v["api"] and v["cli"] else None
    result = {"bench": "api_vs_cli", "command": " ".join(["python", "bench/api_vs_cli.py", *sys.argv[1:]]),
              "date": time.strftime("%Y-%m-%d"), "machine": processor(), "versions": versions(),
              "model": str(args.model), "prompt_tokens": args.prompt, "tokens": args.tokens, "runs": rows,
              "median": summary}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
