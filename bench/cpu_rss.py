"""Peak RSS of the CPU engines in fresh processes, and where it goes.

    python bench/cpu_rss.py genai=DIR fuselm-lowered=DIR ... [--fuselm-run MODEL_DIR] [--rounds 3]
    python bench/cpu_rss.py ... --threads 1 --prompt 128 --tokens 64 --out bench/results/cpu-rss-decode.json

Each NAME=DIR is an onnxruntime-genai model directory (the builder's, or fuselm's lowered graph: `fuselm
optimize --target onnxruntime`, or --backend auto's copy in the prepared store's onnxruntime-*); its child
loads it with `onnxruntime_genai`, runs a --prompt-token prompt and --tokens greedy tokens, and reports its
RSS after load, after the prompt and at the end, split into anonymous and file-backed pages (/proc/self/status:
onnxruntime maps external initializers from the data file), plus the median decode step's process CPU ms (at
--threads 1 the work itself). --fuselm-run MODEL_DIR adds `fuselm run MODEL_DIR` (the default backend) with the
same prompt. Peak RSS is the child's ru_maxrss (bench/_child.py). Rounds are interleaved, the order rotated; every row
records the 1-minute load average before it. `--sessions` adds, per directory, plain onnxruntime sessions
created with graph optimizations on/off and prepacking on/off (RSS after creation: what each setting holds).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _child import run_child  # noqa: E402 - bench/ is no package: its helpers sit beside each script

GENAI_CHILD = r"""
import json, statistics, sys, time
import numpy as np
import onnxruntime_genai as og

def rss():
    f = dict(ln.split(":", 1) for ln in open("/proc/self/status"))
    return {k: int(f[v].split()[0]) // 1024 for k, v in (("rss", "VmRSS"), ("anon", "RssAnon"), ("file", "RssFile"))}

model_dir, prompt, new, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
config = og.Config(model_dir)
config.overlay(json.dumps({"model": {"decoder": {"session_options": {
    "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
model = og.Model(config)
stages = {"load": rss()}
params = og.GeneratorParams(model)
params.set_search_options(max_length=prompt + new, min_length=prompt + new, do_sample=False)
gen = og.Generator(model, params)
t = time.perf_counter()
gen.append_tokens(np.random.default_rng(8).integers(10, 50000, (1, prompt)).astype(np.int32))
gen.generate_next_token()  # (genai 0.18 runs the prompt here: its first token)
first = time.perf_counter() - t
stages["prompt"] = rss()
tokens, cpu, wall = [int(gen.get_next_tokens()[0])], [], []
for _ in range(new - 1):
    c, w = time.process_time(), time.perf_counter()
    gen.generate_next_token()
    cpu.append(time.process_time() - c)
    wall.append(time.perf_counter() - w)
    tokens.append(int(gen.get_next_tokens()[0]))
stages["end"] = rss()
median = round(statistics.median(cpu) * 1e3, 2) if new > 2 else None
print(json.dumps({"stages_mb": stages, "decode_cpu_ms": median, "tokens": tokens[:8], "prefill_tok_s": prompt / first,
                  "decode_tok_s": (new - 1) / sum(wall) if wall else None}))
"""

SESSION_CHILD = r"""
import json, sys, onnxruntime as ort
path, level, prepack = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
so = ort.SessionOptions()
so.log_severity_level, so.intra_op_num_threads = 3, 1
so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
if not prepack:
    so.add_session_config_entry("session.disable_prepacking", "1")
s = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
f = dict(ln.split(":", 1) for ln in open("/proc/self/status"))
print(json.dumps({k: int(f[v].split()[0]) // 1024 for k, v in (("rss", "VmRSS"), ("anon", "RssAnon"),
                                                                ("file", "RssFile"), ("hwm", "VmHWM"))}))
"""


def timed(cmd: list[str]) -> dict:
    """Run `cmd`; its peak RSS (MB) and CPU seconds (bench/_child.py), its last stdout line parsed if JSON."""
    c = run_child(cmd, {**os.environ, "FUSELM_PREPARED": "1"})
    row = {"peak_rss_mb": c.peak_rss_mb, "cpu_s": c.cpu_s, "load_before": c.load_before}
    if c.returncode != 0:
        return {**row, "error": c.tail()}
    last = (c.stdout.strip().splitlines() or [""])[-1]
    try:
        row.update(json.loads(last))
    except ValueError:
        pass
    if said := re.search(r"prefill \d+ tokens: ([\d.]+) tok/s · decode \d+ tokens: ([\d.]+) tok/s", c.stderr):
        row.update(prefill_tok_s=float(said[1]), decode_tok_s=float(said[2]))  # (`fuselm run`'s own report)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="*", help="NAME=DIR onnxruntime-genai model directories")
    ap.add_argument("--fuselm-run", nargs="*", default=[], metavar="[NAME=][PYTHON@]MODEL_DIR",
                    help="also `fuselm run MODEL_DIR` (default backend), by PYTHON's fuselm when given (e.g. another "
                         "checkout's venv, for a before/after in one interleaved run); prefill and decode tok/s from its log")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--sessions", action="store_true", help="also plain onnxruntime sessions per setting")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cpu-rss.json")
    args = ap.parse_args()
    engines = {}
    for item in args.dirs:
        name, _, path = item.partition("=")
        engines[name] = [sys.executable, "-c", GENAI_CHILD, path, str(args.prompt), str(args.tokens), str(args.threads)]
    if args.fuselm_run:
        import numpy as np

        # the genai child's prompt: which embedding rows are read moves the RSS (contiguous ids share pages)
        ids = ",".join(str(i) for i in np.random.default_rng(8).integers(10, 50000, args.prompt))
        for item in args.fuselm_run:
            name, _, spec = item.rpartition("=")
            python, _, model = spec.rpartition("@")
            engines[name or "fuselm run"] = [python or sys.executable, "-m", "fuselm.cli", "run", model, "--prompt-ids",
                                             ids, "--max-tokens", str(args.tokens), "--ignore-eos", "--threads",
                                             str(args.threads)]
    rows: dict[str, list] = {name: [] for name in engines}
    names = list(engines)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            rows[name].append(timed(engines[name]))
            print(name, json.dumps(rows[name][-1]), file=sys.stderr, flush=True)
    summary = {}
    for name, runs in rows.items():
        ok = [x for x in runs if "error" not in x]
        summary[name] = {"peak_rss_mb": statistics.median(x["peak_rss_mb"] for x in ok) if ok else None}
        for key in ("decode_cpu_ms", "prefill_tok_s", "decode_tok_s"):
            values = [x[key] for x in ok if x.get(key) is not None]
            if values:
                summary[name][key] = statistics.median(values)
    sessions = {}
    if args.sessions:
        for item in args.dirs:
            name, _, path = item.partition("=")
            for level in ("ORT_ENABLE_ALL", "ORT_DISABLE_ALL"):
                for prepack in ("1", "0"):
                    cmd = [sys.executable, "-c", SESSION_CHILD, str(Path(path) / "model.onnx"), level, prepack]
                    sessions[f"{name} {level} prepack={prepack}"] = timed(cmd)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(ln.split(":", 1) for ln in lscpu.splitlines() if ":" in ln)
    args.out.write_text(json.dumps({
        "command": " ".join(["python", "bench/cpu_rss.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "processor": fields.get("Model name", "").strip(),
        "cpus": os.cpu_count(), "threads": args.threads, "prompt": args.prompt, "tokens": args.tokens,
        "load_after": round(os.getloadavg()[0], 2), "summary": summary, "sessions": sessions, "rows": rows},
        indent=1) + "\n")
    for name, s in summary.items():
        print(f"{name}: {s}")
    for name, s in sessions.items():
        print(f"{name}: {s}")


if __name__ == "__main__":
    main()
