"""fuselm vs onnxruntime-genai on this CPU, side by side: what a user of either tool runs.

    python bench/cpu_peer.py                          # Qwen3-0.6B shape, 3 runs
    python bench/cpu_peer.py --shapes 0.6b 4b --runs 3
    python bench/cpu_peer.py --tiny                   # a tiny config in seconds (tests/test_bench_cpu_peer.py)
    python bench/cpu_peer.py --engines fuselm genai mnn   # + MNN 3.6.1: bench/mnn_peer.py (its own .venv-mnn,
                                                          #   MNN's telemetry blocked: read its docstring first)

One random-weight Qwen3-shaped checkpoint per shape (bench/convert.py --make-checkpoint), then each
tool's own q4 path with its defaults: `fuselm convert --quant q4` + `fuselm optimize`, and
`python -m onnxruntime_genai.models.builder -i CKPT -o OUT -p int4 -e cpu`. Every engine runs in
its own process with the same number of threads (default 2) and reports, as medians over --runs
runs after one warm-up run:
- decode tok/s at 128 tokens of context (64 greedy steps after a 128-token prompt) and at 2048
  (32 steps after a 2048-token prompt): the median step time of each run,
- prefill tok/s of a 512- and a 2048-token prompt (to its first logits),
- the peak RSS of that benchmark process.
Then two fresh processes per engine, timed whole from the parent (imports + load + prefill):
- first token of a 16-token prompt (`fuselm run --prompt-ids ... --max-tokens 1`, and the
  equivalent onnxruntime-genai script), with its peak RSS,
- a 512-token prompt and 16 generated tokens: the peak RSS of a `fuselm run`-like process.
`--interleaved [--standard] [--q4-head]` loads the onnxruntime-genai engines (genai, genai-fuselm) in
one process and measures them in turn, run after run (decode at each --contexts with its prefill, then
each other --prefills; the median step's process CPU ms too, which at `--threads 1` is the work
itself), so a shared box's load falls on each alike; `--q4-head` adds genai-fuselm-q4head: fuselm's
graph at the builder's precision (`convert --lm-head q4`: one 4-bit table for the tied head and
embedding, where fuselm's default keeps them 8-bit), lowered alike. `--engines ... genai-fuselm` adds onnxruntime-genai on fuselm's q4 graph lowered by `fuselm optimize
--target onnxruntime` (MatMulNBits, GroupQueryAttention with one shared past/present buffer); every
row records the compute nodes per decoder layer of the graph it ran (Constant nodes not counted).
`--engines fuselm-default ...` runs fuselm's default CPU path, what `fuselm run MODEL` does with no
--backend: onnxruntime's IO-binding loop on the prepared lowered copy (engine `fuselm` is the torch backend).
The box may be shared: every row records the 1-minute load average before it started. Prints a
table with ratios, writes bench/results/cpu-peer.json (--tiny: cpu-peer-tiny.json).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _child import run_child  # noqa: E402 - bench/ is no package: its helpers sit beside each script

HERE = Path(__file__).parent
RESULTS = HERE / "results"
ENGINES = ("fuselm", "genai")
DEFAULT = "fuselm-default"  # `fuselm run MODEL` with no --backend: on a CPU, onnxruntime on the lowered copy
# onnxruntime-genai on fuselm's q4 graph lowered by `fuselm optimize --target onnxruntime` (opt-in)
GENAI_ON_FUSELM = "genai-fuselm"
# the same at onnxruntime-genai's builder's precision: `fuselm convert --quant q4 --lm-head q4` (the tied
# embedding follows: one 4-bit table, as the builder's int4), lowered alike (opt-in)
GENAI_ON_FUSELM_Q4HEAD = "genai-fuselm-q4head"
GENAI_ENGINES = ("genai", GENAI_ON_FUSELM, GENAI_ON_FUSELM_Q4HEAD)


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    import numpy as np

    return [int(i) for i in np.random.default_rng(seed).integers(10, min(vocab, 50000), n)]


def _peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # KiB on Linux


# --- engines: one protocol, each in a child process -------------------------------------------
class FuselmEngine:
    """The engine `fuselm.load(model, **options)` gives (what `fuselm run` runs), greedy, step by step."""

    def __init__(self, model: Path, **options):
        import fuselm

        self.engine = fuselm.load(model, **options)
        why = f"; {self.engine.why}" if self.engine.why else ""
        self.what = f"fuselm run ({self.engine.describe()}{why})"

    def prefill(self, ids: list[int], room: int) -> int:
        import numpy as np

        self.engine.reset(len(ids) + room)
        return int(np.argmax(self.engine.forward(ids)[-1]))

    def step(self, token: int) -> int:
        import numpy as np

        return int(np.argmax(self.engine.forward([token])[-1]))


class GenaiEngine:
    """onnxruntime-genai's own loop: append_tokens runs the prompt, generate_next_token picks the
    token from the current logits and (from its second call on) first runs the model on the last one."""

    def __init__(self, model: Path, threads: int):
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(str(model))
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
        self.model = og.Model(config)
        self.gen = None
        self.what = f"onnxruntime-genai {og.__version__} (onnxruntime MatMulNBits + GroupQueryAttention), CPU"

    def prefill(self, ids: list[int], room: int) -> int:
        og = self.og
        params = og.GeneratorParams(self.model)
        # max_length sizes its shared past/present buffers; min_length keeps eos from ending the run
        params.set_search_options(max_length=len(ids) + room, min_length=len(ids) + room, do_sample=False)
        self.gen = None  # free the previous generator's cache first
        self.gen = og.Generator(self.model, params)
        self.gen.append_tokens(ids)
        self.gen.generate_next_token()  # greedy pick from the prompt's logits (no model run)
        return int(self.gen.get_next_tokens()[0])

    def step(self, token: int) -> int:
        self.gen.generate_next_token()
        return int(self.gen.get_next_tokens()[0])


def measure(engine, vocab: int, runs: int, contexts: tuple, prefills: tuple, steps: tuple) -> dict:
    """Decode at each context length (median step time per run) and prefill of each length."""
    decode = {c: [] for c in contexts}
    prefill = {n: [] for n in prefills}
    for r in range(runs + 1):  # run 0 warms up
        for c, n_steps in zip(contexts, steps, strict=True):
            ids = _ids(c, vocab, 100 + r)
            t = time.perf_counter()
            token = engine.prefill(ids, n_steps + 1)
            took = time.perf_counter() - t
            if r and c in prefill:
                prefill[c].append(c / took)
            token, rate = _decode_rate(engine, token, n_steps)
            if r:
                decode[c].append(rate)
        for n in prefills:
            if n in contexts:
                continue
            ids = _ids(n, vocab, 200 + r)
            t = time.perf_counter()
            engine.prefill(ids, 1)
            if r:
                prefill[n].append(n / (time.perf_counter() - t))
    out = {}
    for c, v in decode.items():
        out[f"decode_{c}_tok_s"], out[f"decode_{c}_runs"] = round(statistics.median(v), 2), [round(x, 2) for x in v]
    for n, v in prefill.items():
        out[f"prefill_{n}_tok_s"], out[f"prefill_{n}_runs"] = round(statistics.median(v), 1), [round(x, 1) for x in v]
    return out


def _decode_rate(engine, token, steps: int, cpu: list | None = None):
    """`steps` greedy decode steps from `token`: (the last token, tokens/s from the median step); the
    median step's process CPU ms is appended to `cpu` when given (at 1 thread the work itself, which a
    shared box's load barely moves; at more, onnxruntime's spinning threads count too)."""
    times, cpus = [], []
    for _ in range(steps):
        t, c = time.perf_counter(), time.process_time()
        token = engine.step(token)
        times.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    if cpu is not None:
        cpu.append(statistics.median(cpus) * 1e3)
    return token, 1 / statistics.median(times)


def interleaved(models: dict[str, Path], engines: list[str], vocab: int, contexts: tuple, steps: tuple,
                prefills: tuple, runs: int, threads: int) -> dict:
    """The onnxruntime-genai engines loaded in one process and measured in turn, run after run (a shared
    box's load then falls on all alike): per run and engine, the median decode step after a prompt of each
    context length (its prefill timed too), then a prefill of each other length. The 1-minute load average
    is recorded before each run."""
    loaded = {e: GenaiEngine(models[e], threads) for e in engines}
    out: dict = {e: {} for e in engines}
    loads = []

    def keep(e: str, key: str, value: float) -> None:
        out[e].setdefault(key, []).append(round(value, 2 if key.startswith("decode") else 1))

    def name(k: str) -> str:  # decode_128 -> decode_128_tok_s; decode_128_cpu_ms stays
        return k if k.endswith("_ms") else f"{k}_tok_s"

    for r in range(runs + 1):  # run 0 warms up
        if r:
            loads.append(round(os.getloadavg()[0], 2))
        for e, engine in loaded.items():
            for c, n_steps in zip(contexts, steps, strict=True):
                t = time.perf_counter()
                token = engine.prefill(_ids(c, vocab, 300 + r), n_steps + 1)
                took = time.perf_counter() - t
                cpu: list = []
                token, rate = _decode_rate(engine, token, n_steps, cpu)
                if r:
                    keep(e, f"decode_{c}", rate)
                    keep(e, f"decode_{c}_cpu_ms", cpu[0])
                    keep(e, f"prefill_{c}", c / took)
            for n in prefills:
                if n in contexts:
                    continue
                t = time.perf_counter()
                engine.prefill(_ids(n, vocab, 400 + r), 1)
                if r:
                    keep(e, f"prefill_{n}", n / (time.perf_counter() - t))
    result = {e: {k2: v for k, runs_ in sorted(out[e].items())
                  for k2, v in ((name(k), statistics.median(runs_)), (f"{k}_runs", runs_))}
              for e in engines}
    result["load_before_runs"] = loads
    return result


def child(args) -> None:
    """The benchmark process of one engine: load, measure, report (one JSON line on stdout)."""
    model = Path(args.model)
    vocab = json.loads((Path(args.ckpt) / "config.json").read_text())["vocab_size"]
    t0 = time.perf_counter()
    if args.child in GENAI_ENGINES:
        engine = GenaiEngine(model, args.threads)
    elif args.child == "mnn":  # run by .venv-mnn's Python through bench/mnn_safe.py (see bench/mnn_peer.py)
        engine = _bench_module("mnn_peer").MnnEngine(model, args.threads)
    elif args.child == DEFAULT:
        engine = FuselmEngine(model, threads=args.threads)  # `fuselm run MODEL`'s own choice (--backend auto)
    else:
        engine = FuselmEngine(model, backend="torch", device="cpu", threads=args.threads,
                              compile=True if args.child == "fuselm-compile" else None)
    load = time.perf_counter() - t0
    r = measure(engine, vocab, args.runs, tuple(args.contexts), tuple(args.prefills), tuple(args.steps))
    r.update(load_s=round(load, 2), what=engine.what, peak_rss_mb=_peak_rss_mb())
    print("RESULT " + json.dumps(r), flush=True)


GENAI_RUN = r"""
import sys, time
import onnxruntime_genai as og
model_dir, ids, new, threads = sys.argv[1], [int(i) for i in sys.argv[2].split(",")], int(sys.argv[3]), int(sys.argv[4])
config = og.Config(model_dir)
config.overlay('{"model": {"decoder": {"session_options": {"intra_op_num_threads": %d, "inter_op_num_threads": 1}}}}' % threads)
model = og.Model(config)
tok = og.Tokenizer(model)  # as a user's script would: fuselm run loads its tokenizer too
params = og.GeneratorParams(model)
params.set_search_options(max_length=len(ids) + new, min_length=len(ids) + new, do_sample=False)
gen = og.Generator(model, params)
gen.append_tokens(ids)
out = []
while len(out) < new:
    gen.generate_next_token()
    out.append(int(gen.get_next_tokens()[0]))
    if len(out) == 1:
        print("FIRST", time.time(), flush=True)
print(" ".join(map(str, out)))
"""


def fresh_process(engine: str, model: Path, ids: list[int], new: int, threads: int) -> dict:
    """A whole user process (imports + load + prefill + `new` tokens): wall time to its first token
    (the child prints it), total wall time and the process's peak RSS (bench/_child.py)."""
    ids_arg = ",".join(map(str, ids))
    env = None
    if engine in GENAI_ENGINES:
        cmd = [sys.executable, "-c", GENAI_RUN, str(model), ids_arg, str(new), str(threads)]
    elif engine == "mnn":
        mnn = _bench_module("mnn_peer")
        cmd, env = mnn.fresh_cmd(model, ids_arg, new, threads), mnn.safe_env()
    else:
        cmd = [sys.executable, "-m", "fuselm.cli", "run", str(model), "--prompt-ids", ids_arg, "--max-tokens",
               str(new), "--ignore-eos", "--threads", str(threads)]
        if engine != DEFAULT:
            cmd += ["--backend", "torch", "--device", "cpu"]
        if engine == "fuselm-compile":
            cmd.append("--compile")
    first: list[float] = []  # fuselm run prints the token and its newline as it comes: stamp its arrival
    c = run_child(cmd, env, on_line=lambda line: first or first.append(time.time()))
    if c.returncode != 0:
        return {"error": c.tail()}
    stamp = next((float(ln.split()[1]) for ln in c.stdout.splitlines() if ln.startswith("FIRST ")), None)
    first_at = stamp or (first[0] if first else None)
    return {"first_token_s": round(first_at - c.started, 2) if first_at else None, "wall_s": c.wall_s,
            "peak_rss_mb": c.peak_rss_mb, "load_before": c.load_before}


def fresh_runs(engine: str, model: Path, ids: list[int], new: int, args) -> dict:
    """`fresh_process` --runs times: medians of the times, the largest peak RSS, every run kept
    (the first one may include a one-time cost: building the CPU kernels, a cold page cache)."""
    runs = [fresh_process(engine, model, ids, new, args.threads) for _ in range(max(1, args.runs))]
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    out = {k: round(statistics.median(r[k] for r in ok), 2) for k in ("first_token_s", "wall_s") if ok[0][k] is not None}
    out.update(peak_rss_mb=max(r["peak_rss_mb"] for r in ok), runs=runs)
    return out


def spawn(engine: str, model: Path, ckpt: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--child", engine, "--model", str(model), "--ckpt", str(ckpt),
           "--runs", str(args.runs), "--threads", str(args.threads),
           "--contexts", *map(str, args.contexts), "--steps", *map(str, args.steps),
           "--prefills", *map(str, args.prefills)]
    env = None
    if engine == "mnn":  # MNN lives in .venv-mnn, its telemetry blocked (bench/mnn_peer.py)
        mnn = _bench_module("mnn_peer")
        cmd, env = mnn.safe_cmd(*cmd[1:]), mnn.safe_env()
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"engine": engine, "error": " | ".join(tail)[:500], "load_before": round(load, 2)}
    r = json.loads(line[len("RESULT "):])
    r.update(engine=engine, wall_s=round(time.perf_counter() - t0, 1), load_before=round(load, 2),
             load_after=round(os.getloadavg()[0], 2))
    return r


# --- preparation -------------------------------------------------------------------------------
def prepare(shape: str, work: Path, engines=None) -> tuple[Path, dict[str, Path]]:
    """The checkpoint, fuselm's optimized q4 model (bench/runtime.py's preparation), the same lowered for
    onnxruntime (`--target onnxruntime`, MatMulNBits accuracy level 4 as genai's builder; only when
    `engines`, if given, runs it) and genai's int4 build."""
    ckpt, models = _bench_module("runtime").prepare(shape, work, ["q4"])
    lowered = work / f"qwen3-{shape}-q4-onnxruntime"
    if (engines is None or GENAI_ON_FUSELM in engines) and not (lowered / "genai_config.json").is_file():
        subprocess.run([sys.executable, "-m", "fuselm.cli", "optimize", str(models["q4"][0]), "-o", str(lowered),
                        "--target", "onnxruntime", "--force", "--quiet"], check=True)
    genai = work / f"qwen3-{shape}-genai-int4"
    if not (genai / "genai_config.json").is_file():
        shutil.rmtree(genai, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o", str(genai),
                        "-p", "int4", "-e", "cpu", "-c", str(work / "genai-cache")], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return ckpt, {"fuselm": models["q4"][1], "fuselm-compile": models["q4"][1], DEFAULT: models["q4"][1], "genai": genai,
                  GENAI_ON_FUSELM: lowered}


def prepare_q4_head(ckpt: Path, work: Path) -> Path:
    """`fuselm convert --quant q4 --lm-head q4` (onnxruntime-genai's builder's precision: one 4-bit table
    for the tied head and embedding) + `optimize` + `optimize --target onnxruntime`."""
    steps = [("exported", ["convert", str(ckpt), "--quant", "q4", "--lm-head", "q4"]), ("optimized", ["optimize"]),
             ("onnxruntime", ["optimize", "--target", "onnxruntime"])]
    src = None
    for name, cmd in steps:
        out = work / f"qwen3-{work.name}-q4head-{name}"
        if not (out / "fuselm.json").is_file():
            args = cmd if src is None else [cmd[0], str(src), *cmd[1:]]
            subprocess.run([sys.executable, "-m", "fuselm.cli", *args, "-o", str(out), "--force", "--quiet"],
                           check=True)
        src = out
    return src


def compute_nodes_per_layer(model_dir: Path) -> list[int]:
    """Nodes inside each decoder layer (passes/draw.py's assignment), Constant nodes not counted (the
    builder writes its constants as nodes, fuselm as initializers)."""
    from collections import Counter

    import onnx_ir as ir
    from fuselm.passes.draw import layer_assignment

    graph = ir.load(model_dir / "model.onnx").graph
    counts = Counter(i for n, i in layer_assignment(graph).items() if n.op_type != "Constant")
    return [counts[i] for i in sorted(counts)]


def _dir_mb(path: Path) -> float:
    return round(sum(p.stat().st_size for p in path.iterdir() if p.is_file()) / 2**20, 1)


def machine() -> dict:
    import onnxruntime

    info = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "onnxruntime": onnxruntime.__version__}
    try:
        import onnxruntime_genai

        info["onnxruntime_genai"] = onnxruntime_genai.__version__
    except ImportError:
        pass
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        fields = dict(ln.split(":", 1) for ln in lscpu.splitlines() if ":" in ln)
        info["processor"] = fields.get("Model name", "").strip()
        flags = fields.get("Flags", "").split()
        info["simd"] = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni")
                        if f in flags]
    except OSError:
        pass
    try:
        import torch

        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except ImportError:
        pass
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=["0.6b"], choices=["0.6b", "4b"])
    ap.add_argument("--tiny", action="store_true", help="a tiny config, short prompts, 1 run: a test in seconds")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", nargs="*", default=list(ENGINES),
                    choices=["fuselm", "fuselm-compile", DEFAULT, *GENAI_ENGINES, "mnn"])
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "fuselm-bench-cpu-peer")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/cpu-peer[-tiny].json)")
    ap.add_argument("--no-fresh", action="store_true", help="skip the fresh-process first-token / RSS rows")
    ap.add_argument("--interleaved", action="store_true",
                    help="onnxruntime-genai engines only, in one process, measured in turn run after run "
                         "(decode at the first context, its prefill)")
    ap.add_argument("--standard", action="store_true",
                    help="with --interleaved: also genai on fuselm's portable (not lowered) q4 graph")
    ap.add_argument("--q4-head", action="store_true",
                    help="with --interleaved: also genai on fuselm's q4 graph with a 4-bit lm_head/embedding "
                         "(`convert --lm-head q4`: the builder's int4 precision), lowered alike")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--contexts", type=int, nargs="*", default=[128, 2048], help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, nargs="*", default=[64, 32], help=argparse.SUPPRESS)
    ap.add_argument("--prefills", type=int, nargs="*", default=[512, 2048], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0
    shapes = args.shapes
    first_prompt, run_prompt, run_tokens = 16, 512, 16
    if args.tiny:
        shapes, args.runs = ["tiny"], 1
        args.contexts, args.steps, args.prefills = [16, 64], [4, 4], [32, 64]
        run_prompt, run_tokens = 32, 4
    args.run_prompt = run_prompt
    rows = []
    if args.interleaved:
        result, nodes = {}, {}
        for shape in shapes:
            ckpt, models = prepare(shape, args.work / shape)
            vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
            models["fuselm-standard"] = models["fuselm"]  # genai on the portable graph (its genai_config.json)
            engines = ["genai", GENAI_ON_FUSELM] + (["fuselm-standard"] if args.standard else [])
            if args.q4_head:
                models[GENAI_ON_FUSELM_Q4HEAD] = prepare_q4_head(ckpt, args.work / shape)
                engines.append(GENAI_ON_FUSELM_Q4HEAD)
            result[shape] = interleaved(models, engines, vocab, tuple(args.contexts), tuple(args.steps),
                                        tuple(args.prefills), args.runs, args.threads)
            nodes[shape] = {e: round(statistics.mean(compute_nodes_per_layer(models[e])), 1) for e in engines}
            result[shape]["summary"] = {f"{k} {e}/genai": round(result[shape][e][k] / result[shape]["genai"][k], 2)
                                        for e in engines if e != "genai"
                                        for k in result[shape]["genai"] if k.endswith(("_tok_s", "_ms"))}
            print(json.dumps(result[shape]), flush=True)
        out = args.out or RESULTS / "cpu-peer-interleaved.json"
        command = "python bench/cpu_peer.py " + " ".join(argv if argv is not None else sys.argv[1:])
        out.write_text(json.dumps({"command": command, "machine": machine(), "threads": args.threads,
                                   "runs": args.runs, "contexts": args.contexts, "steps": args.steps,
                                   "prefills": args.prefills, "load_after": round(os.getloadavg()[0], 2),
                                   "rows": result, "nodes_per_layer": nodes}, indent=2) + "\n")
        print(f"wrote {out}")
        return 0
    for shape in shapes:
        t0 = time.perf_counter()
        ckpt, models = prepare(shape, args.work / shape, args.engines)
        if "mnn" in args.engines:  # MNN's own llmexport 4-bit block 32 (bench/mnn_peer.py)
            models["mnn"] = _bench_module("mnn_peer").export(ckpt, args.work / shape)
        vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
        print(f"[{shape}] models ready in {time.perf_counter() - t0:.0f} s", flush=True)
        for engine in args.engines:
            r = spawn(engine, models[engine], ckpt, args)
            r.update(shape=shape, model_mb=_dir_mb(models[engine]))
            if engine == "mnn":
                r.update(_bench_module("mnn_peer").export_stats(models[engine]))
            else:
                r.update(nodes_per_layer=compute_nodes_per_layer(models[engine]))
            if not args.no_fresh and "error" not in r:
                r["first_token"] = fresh_runs(engine, models[engine], _ids(first_prompt, vocab, 7), 1, args)
                if not args.tiny:  # the tiny test stays short: one fresh process per engine
                    r[f"run_{run_prompt}"] = fresh_runs(engine, models[engine], _ids(run_prompt, vocab, 8), run_tokens,
                                                        args)
            rows.append(r)
            print(f"[{shape}] {engine}: " + json.dumps({k: v for k, v in r.items() if not k.endswith("_runs")}),
                  flush=True)
    summary = report(rows, args)
    out = args.out or RESULTS / ("cpu-peer-tiny.json" if args.tiny else "cpu-peer.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "protocol": {
        "threads": args.threads, "runs": args.runs, "decode_contexts": args.contexts, "decode_steps": args.steps,
        "prefills": args.prefills, "first_token_prompt": first_prompt, "run_prompt": run_prompt,
        "run_tokens": run_tokens}, "rows": rows, "summary": summary}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if all("error" not in r for r in rows) else 1


def report(rows: list[dict], args) -> dict:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"fuselm vs onnxruntime-genai on CPU, {args.threads} threads each (medians)")
    cols = [f"decode@{c}" for c in args.contexts] + [f"prefill {n}" for n in args.prefills]
    for col in ("shape", "engine", *cols, "peak RSS MB", "1st token s", "load avg"):
        table.add_column(col)
    keys = [f"decode_{c}_tok_s" for c in args.contexts] + [f"prefill_{n}_tok_s" for n in args.prefills]
    for r in rows:
        if "error" in r:
            table.add_row(r["shape"], r["engine"], r["error"][:100])
            continue
        ft = r.get("first_token", {})
        table.add_row(r["shape"], r["engine"], *[f"{r[k]:.1f}" for k in keys], f"{r['peak_rss_mb']:.0f}",
                      f"{ft.get('first_token_s', '')}", f"{r['load_before']:.1f}")
    console.print(table)
    summary = {}
    for shape in dict.fromkeys(r["shape"] for r in rows):
        by = {r["engine"]: r for r in rows if r["shape"] == shape and "error" not in r}
        for peer_name in ("genai", "mnn"):
            peer = by.get(peer_name)
            for name, ours in by.items():
                if name in ("genai", "mnn") or peer is None:
                    continue
                for k in keys + ["peak_rss_mb"]:
                    summary[f"{shape} {k} {name}/{peer_name}"] = round(ours[k] / peer[k], 2)
                run = f"run_{args.run_prompt}"
                for sub in ("first_token", run):
                    if "peak_rss_mb" in ours.get(sub, {}) and "peak_rss_mb" in peer.get(sub, {}):
                        summary[f"{shape} {sub} peak_rss_mb {name}/{peer_name}"] = round(
                            ours[sub]["peak_rss_mb"] / peer[sub]["peak_rss_mb"], 2)
    for k, v in summary.items():
        console.print(f"  {k}: {v}")
    return summary


if __name__ == "__main__":
    sys.exit(main())
