"""fuselm's MLX backend vs mlx-lm on the same checkpoint, side by side: decode, prefill, load, ops per token.

    python bench/mlx_peer.py                                   # 0.6b and 4b, 4-bit at group 32 and 64
    python bench/mlx_peer.py --shapes 0.6b --groups 32 --runs 3
    python bench/mlx_peer.py --shapes tiny --contexts 128 --prefill 128    # MLX's CPU backend (a test)

The same code runs on a Mac (Metal), on Linux with MLX's CUDA backend, and on MLX's CPU backend.
One random-weight Qwen3-shaped HF checkpoint per shape (bench/convert.py writes it streaming);
mlx-lm reads the directory `mlx_lm convert -q --q-bits 4 --q-group-size G` makes of it, fuselm the
graph `fuselm convert --quant q4 --block-size G --lm-head q4 --embed q4` + `fuselm optimize` makes
(same bits and group size for every weight, embedding and lm_head included). Each engine runs in its
own child process, after one warm-up run, and reports medians over `--runs` runs of:
- decode tokens/s at each context length C: C prompt tokens, then 64 greedy tokens; the median
  interval between tokens;
- prefill tokens/s at each prompt length P: P tokens to the first generated token;
- load seconds (reading the model until it can run), peak device memory;
- per decode token: MLX primitives in the step's graph (mx.export_to_dot; "kernels" counts the
  primitives that launch work, i.e. not reshapes, broadcasts, slices and other views), host
  milliseconds to build the step (the call that returns the lazy token), host syncs.
Writes bench/results/mlx-peer-<device>.json and prints a table with the fuselm/mlx-lm ratios.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
RESULTS = HERE / "results"
DECODE = 64


def _ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    import numpy as np

    return [int(i) for i in np.random.default_rng(seed).integers(10, vocab - 1, n)]


def count_primitives(outputs, inputs) -> dict:
    """Kernels of the graph that computes `outputs` once `inputs` are evaluated (fuselm's MLX backend counts them)."""
    import mlx.core as mx
    from fuselm.runtime_metal.backends.mlx_backend import graph_kernels

    mx.eval(inputs)
    counts = graph_kernels(outputs)
    return {**counts, "top": counts["top"][:12]}


# --- engines (each runs in a child process) ------------------------------------------------
class FuselmEngine:
    def __init__(self, model: Path, dtype: str, compile_: bool):
        import mlx.core as mx
        from fuselm.runtime_metal.sampling import Sampler
        from fuselm.runtime_metal.session import Session

        t0 = time.perf_counter()
        self.sess = Session(model, backend="mlx", dtype=dtype, compile=compile_)
        mx.eval([w for n in self.sess.graph.nodes if n.op_type == "QMatMul" for w in n.attrs["weight"].data])
        self.load_s = time.perf_counter() - t0
        self.sampler = Sampler()
        self.vocab = self.sess.meta["dims"]["vocab"]
        self.syncs = 0
        b = self.sess.backend
        for name in ("item", "to_numpy", "sync"):  # count the host's waits on the device
            fn = getattr(b, name)
            setattr(b, name, self._counted(fn))

    def _counted(self, fn):
        def wrapper(*a, **k):
            self.syncs += 1
            return fn(*a, **k)
        return wrapper

    def tokens(self, prompt: list[int], n: int):
        self.sess.reset(len(prompt) + n + 1)
        return self.sess.generate(prompt, n, self.sampler)

    def step_graph(self, prompt: list[int]) -> tuple[list, list, float]:
        """One decode step built lazily after `prompt`: (outputs, inputs, host seconds to build it)."""
        sess, b = self.sess, self.sess.backend
        sess.reset(len(prompt) + 8)
        for _tok in sess.generate(prompt, 4, self.sampler):  # past the checked step and the compile
            pass
        y = b.pick_token(sess.decode(5), self.sampler)
        b.sync(y)
        bufs = list(sess.buffers.values())
        t = time.perf_counter()
        y = b.pick_token(sess.decode(y), self.sampler)
        host = time.perf_counter() - t
        return [y, *sess.buffers.values()], bufs, host

    def what(self) -> str:
        return self.sess.describe()


class MlxLmEngine:
    def __init__(self, model: Path):
        import mlx.core as mx
        from mlx_lm import load

        t0 = time.perf_counter()
        self.model, _ = load(str(model))
        mx.eval(self.model.parameters())
        self.load_s = time.perf_counter() - t0
        self.vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        self.syncs = None  # its loop: one y.item() per token

    def tokens(self, prompt: list[int], n: int):
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        return (t for t, _ in generate_step(mx.array(prompt), self.model, max_tokens=n))

    def step_graph(self, prompt: list[int]):
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        logits = self.model(mx.array(prompt)[None], cache=cache)
        y = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(y, [c.state for c in cache])
        t = time.perf_counter()  # (the cache arrays are updated in place: nothing to evaluate first)
        logits = self.model(y[None], cache=cache)  # mlx-lm's _step: model, last row, logsumexp, sampler
        logprobs = logits[:, -1, :] - mx.logsumexp(logits[:, -1, :], keepdims=True)
        y = mx.argmax(logprobs, axis=-1)
        host = time.perf_counter() - t
        return [y, logprobs, *[a for c in cache for a in c.state[:2]]], [], host

    def what(self) -> str:
        import mlx_lm

        return f"mlx-lm {mlx_lm.__version__} generate_step"


def measure(engine, contexts: list[int], prefills: list[int], runs: int, decode_tokens: int = DECODE) -> dict:
    import mlx.core as mx

    decode = {c: [] for c in contexts}
    prefill = {p: [] for p in prefills}
    syncs = None
    for r in range(runs + 1):  # run 0 warms up (compiles, first-touches the weights)
        for c in contexts:
            times, t = [], time.perf_counter()
            for _ in engine.tokens(_ids(c, engine.vocab, r), decode_tokens):
                now = time.perf_counter()
                times.append(now - t)
                t = now
                if len(times) == 1 and engine.syncs is not None:
                    engine.syncs = 0  # count the waits of the decode steps only
            if r:
                decode[c].append(1 / statistics.median(times[1:]))
            if engine.syncs is not None:
                syncs = engine.syncs / (decode_tokens - 1)
        for p in prefills:
            t = time.perf_counter()
            next(iter(engine.tokens(_ids(p, engine.vocab, 100 + r), 1)))
            if r:
                prefill[p].append(p / (time.perf_counter() - t))
    outs, ins, host = engine.step_graph(_ids(contexts[0], engine.vocab, 7))
    counts = count_primitives(outs, ins)
    host_ms = []
    for _ in range(5):
        outs, ins, h = engine.step_graph(_ids(contexts[0], engine.vocab, 7))
        host_ms.append(h * 1e3)
    return {"decode_tok_s": {str(c): statistics.median(v) for c, v in decode.items()},
            "prefill_tok_s": {str(p): statistics.median(v) for p, v in prefill.items()},
            "decode_runs": {str(c): v for c, v in decode.items()}, "prefill_runs": {str(p): v for p, v in prefill.items()},
            "load_s": engine.load_s, "peak_memory_gb": mx.get_peak_memory() / 1e9, "per_token": {
                **counts, "host_ms": statistics.median(host_ms), "syncs": syncs if syncs is not None else 1.0},
            "what": engine.what(), "device": str(mx.default_device())}


def greedy_tokens(model: Path, backend: str, dtype: str, n: int) -> list[int]:
    """fuselm's greedy tokens after the demo prompt on `backend` (mlx, or torch on CUDA when there)."""
    import fuselm

    device = None
    if backend == "torch":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    r = fuselm.run(model, prompt="the capital of france is", max_tokens=n, ignore_eos=True, backend=backend,
                   device=device, dtype=dtype, quiet=True, stream=io.StringIO())
    return r["tokens"], r["what"]


def token_check(work: Path, n: int = 32) -> dict:
    """fuselm MLX vs fuselm torch (CUDA where there) greedy tokens on one q4 graph of the trained demo model
    (random weights give near-tied logits, where any two kernels may pick differently)."""
    import fuselm
    from fuselm.synth import make_checkpoint

    hf, exp, opt = work / "demo-hf", work / "demo-q4", work / "demo-q4-opt"
    if not (opt / "fuselm.json").is_file():
        make_checkpoint(hf, "qwen3", train_steps=150, hidden_size=96, intermediate_size=256, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2)
        fuselm.convert(hf, exp, quant="q4", force=True, quiet=True)
        fuselm.optimize(exp, opt, force=True, quiet=True)
    out = {}
    for backend, dtype in (("mlx", "f32"), ("torch", "f32"), ("mlx", "bf16")):
        res = subprocess.run([sys.executable, __file__, "--child", f"tokens-{backend}", "--model", str(opt),
                              "--dtype", dtype, "--runs", str(n)], capture_output=True, text=True)
        line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
        out[f"{backend}-{dtype}"] = json.loads(line[7:]) if line else {"error": res.stderr.strip()[-500:]}
    ref = out["torch-f32"].get("tokens")
    for _k, v in out.items():
        if "tokens" in v and ref:
            v["equal_to_torch_f32"] = v["tokens"] == ref
    return out


def child(args) -> None:
    engine = args.child
    if engine.startswith("tokens-"):
        tokens, what = greedy_tokens(Path(args.model), engine.split("-", 1)[1], args.dtype, args.runs)
        print("RESULT " + json.dumps({"tokens": tokens, "what": what}), flush=True)
        return
    if engine == "mlx-lm":
        e = MlxLmEngine(Path(args.model))
    else:
        e = FuselmEngine(Path(args.model), args.dtype, compile_=engine != "fuselm-eager")
    r = measure(e, args.contexts, args.prefill, args.runs, args.decode)
    print("RESULT " + json.dumps(r), flush=True)


# --- orchestration ----------------------------------------------------------------------------
def prepare(shape: str, group: int, work: Path, dtype: str) -> dict[str, Path]:
    """The HF checkpoint, mlx-lm's directory (weights and activations in `dtype`, as fuselm computes), fuselm's
    exported and optimized graphs (made once)."""
    sys.path.insert(0, str(HERE))
    import convert as convert_bench

    ckpt = convert_bench.write_checkpoint(work / f"qwen3-{shape}-hf", shape)
    out = {"ckpt": ckpt, "mlx-lm": work / f"qwen3-{shape}-mlxlm-g{group}-{dtype}",
           "exported": work / f"qwen3-{shape}-q4-g{group}-exported", "fuselm": work / f"qwen3-{shape}-q4-g{group}"}
    if not (out["mlx-lm"] / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(ckpt), "--mlx-path",
                        str(out["mlx-lm"]), "-q", "--q-bits", "4", "--q-group-size", str(group), "--dtype",
                        {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[dtype]],
                       check=True, stdout=subprocess.DEVNULL)
    if not (out["exported"] / "fuselm.json").is_file():
        subprocess.run([sys.executable, "-m", "fuselm.cli", "convert", str(ckpt), "-o", str(out["exported"]),
                        "--quant", "q4", "--block-size", str(group), "--lm-head", "q4", "--embed", "q4", "--force",
                        "--quiet"], check=True)
    if not (out["fuselm"] / "fuselm.json").is_file():
        subprocess.run([sys.executable, "-m", "fuselm.cli", "optimize", str(out["exported"]), "-o", str(out["fuselm"]),
                        "--force", "--quiet"], check=True)
    return out


def spawn(engine: str, model: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--child", engine, "--model", str(model), "--runs", str(args.runs),
           "--dtype", args.dtype, "--decode", str(args.decode), "--contexts", *map(str, args.contexts), "--prefill", *map(str, args.prefill)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-4:]
        return {"engine": engine, "error": " | ".join(tail)[:600]}
    r = json.loads(line[len("RESULT "):])
    r.update(engine=engine, wall_s=round(time.perf_counter() - t0, 1))
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=["0.6b", "4b"], choices=["tiny", "0.6b", "4b"])
    ap.add_argument("--groups", nargs="*", type=int, default=[32, 64], choices=[32, 64, 128])
    ap.add_argument("--contexts", nargs="*", type=int, default=[128, 2048], help="decode at these context lengths")
    ap.add_argument("--prefill", nargs="*", type=int, default=[512, 2048], help="prefill these prompt lengths")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--decode", type=int, default=DECODE, help="greedy tokens timed per context")
    ap.add_argument("--engines", nargs="*", default=["mlx-lm", "fuselm"],
                    help="mlx-lm, fuselm (optimized, compiled), fuselm-exported (no passes), fuselm-eager (not compiled)")
    ap.add_argument("--dtype", default="auto", help="fuselm's --dtype (auto: bf16 on a GPU, as mlx-lm runs)")
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "fuselm-bench-mlx")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/mlx-peer-<device>.json)")
    ap.add_argument("--token-check", action="store_true",
                    help="also compare fuselm-MLX and fuselm-torch greedy tokens on one q4 graph (the trained demo model)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0
    import mlx.core as mx

    device = str(mx.default_device())
    gpu = "gpu" in device
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if gpu else "f32")  # fuselm's auto, for mlx-lm too
    rows = []
    for shape in args.shapes:
        for group in args.groups:
            t0 = time.perf_counter()
            paths = prepare(shape, group, args.work, dtype)
            print(f"[{shape} g{group}] models ready in {time.perf_counter() - t0:.0f} s", flush=True)
            for engine in args.engines:
                model = paths["exported" if engine == "fuselm-exported" else "mlx-lm" if engine == "mlx-lm" else "fuselm"]
                r = spawn("fuselm" if engine == "fuselm-exported" else engine, model, args)
                r.update(shape=shape, group=group, engine=engine)
                rows.append(r)
                print(f"[{shape} g{group}] {engine}: " + json.dumps({k: v for k, v in r.items() if not k.endswith("_runs")}),
                      flush=True)
    checks = token_check(args.work) if args.token_check else None
    if checks:
        print("token check: " + json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in checks.items()}))
    summary = report(rows)
    out = args.out or RESULTS / f"mlx-peer-{'gpu' if gpu else 'cpu'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    import mlx_lm

    out.write_text(json.dumps({
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "mlx": mx.__version__, "mlx_device": device, "mlx_lm": mlx_lm.__version__},
        "protocol": {"decode_tokens": args.decode, "contexts": args.contexts, "prefill": args.prefill, "runs": args.runs,
                     "dtype": dtype, "command": " ".join(["python", "bench/mlx_peer.py", *(argv or sys.argv[1:])])},
        "rows": rows, "summary": summary, "token_check": checks}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def report(rows: list[dict]) -> dict:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="fuselm MLX vs mlx-lm (medians)")
    cols = ("shape", "group", "engine", "decode tok/s by context", "prefill tok/s by length", "load s",
            "kernels/token", "host ms/token")
    for c in cols:
        table.add_column(c)
    summary: dict = {}
    for r in rows:
        if "error" in r:
            table.add_row(r["shape"], str(r["group"]), r["engine"], "", "", "", "", r["error"][:80])
            continue
        pt = r["per_token"]
        table.add_row(r["shape"], str(r["group"]), r["engine"],
                      " / ".join(f"{k}: {v:.1f}" for k, v in r["decode_tok_s"].items()),
                      " / ".join(f"{k}: {v:.0f}" for k, v in r["prefill_tok_s"].items()), f"{r['load_s']:.2f}",
                      f"{pt['kernels']} ({pt['primitives']})", f"{pt['host_ms']:.2f}")
    console.print(table)
    for r in rows:
        peer = next((p for p in rows if p["engine"] == "mlx-lm" and p["shape"] == r["shape"]
                     and p["group"] == r["group"] and "error" not in p), None)
        if r["engine"] == "mlx-lm" or peer is None or "error" in r:
            continue
        key = f"{r['shape']} g{r['group']} {r['engine']}/mlx-lm"
        for k, v in r["decode_tok_s"].items():
            summary[f"{key} decode@{k}"] = round(v / peer["decode_tok_s"][k], 2)
        for k, v in r["prefill_tok_s"].items():
            summary[f"{key} prefill@{k}"] = round(v / peer["prefill_tok_s"][k], 2)
        summary[f"{key} load s"] = [round(r["load_s"], 2), round(peer["load_s"], 2)]
        summary[f"{key} kernels/token"] = [r["per_token"]["kernels"], peer["per_token"]["kernels"]]
    for k, v in summary.items():
        console.print(f"  {k}: {v}")
    return summary


if __name__ == "__main__":
    sys.exit(main())
