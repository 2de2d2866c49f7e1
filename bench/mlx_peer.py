"""fuselm's MLX backend vs mlx-lm on the same checkpoint, side by side: decode, prefill, load, ops per token.

    python bench/mlx_peer.py                                   # 0.6b and 4b, 4-bit at group 32 and 64
    python bench/mlx_peer.py --shapes 0.6b --groups 32 --runs 7
    python bench/mlx_peer.py --shapes tiny --contexts 128 --prefill 128    # MLX's CPU backend (a test)
    python bench/mlx_peer.py --shapes olmoe-1b-7b qwen3-30b-a3b-8l --groups 64   # mixtures of experts
    python bench/mlx_peer.py --stash --shapes olmoe-1b-7b --groups 64   # only the checkpoint and fuselm's graphs

The same code runs on a Mac (Metal), on Linux with MLX's CUDA backend, and on MLX's CPU backend.
One random-weight HF checkpoint per shape (bench/convert.py's SHAPES, written streaming: Qwen3, and the
mixtures of experts OLMoE-1B-7B and Qwen3-30B-A3B cut to 8 layers, converted by fuselm's traced exporter);
mlx-lm reads the directory `mlx_lm convert -q --q-bits 4 --q-group-size G` makes of it, fuselm the
graph `fuselm convert --quant q4 --block-size G --lm-head q4 --embed q4` + `fuselm optimize` makes
(same bits and group size for every weight, embedding and lm_head included); each conversion's wall time,
CPU time and peak RSS (a child's ru_maxrss, bench/convert.py measure) go in the rows. Each engine runs in its
own child process, loaded once and warmed up (one run); the parent then interleaves the engines run by
run (run r of every engine, then run r + 1), so a drift of the machine touches them alike, and reports
the median, min and max over `--runs` runs (default 5) of:
- decode tokens/s at each context length C: C prompt tokens, then 64 greedy tokens; the median
  interval between tokens;
- prefill tokens/s at each prompt length P: P tokens to the first generated token;
- load seconds (reading the model until it can run), peak device memory;
- per decode token: MLX primitives in the step's graph (mx.export_to_dot; "kernels" counts the
  primitives that launch work, i.e. not reshapes, broadcasts, slices and other views), host
  milliseconds to build the step (the call that returns the lazy token), host syncs; by primitive in
  a table per shape. MLX's CPU backend runs mx.fast.* and mx.dequantize as unfused fallbacks, so there
  the step is also counted with those ops as one kernel each ("fused ops as one", the graph a GPU runs;
  bench/mlx_standins.py).
Writes bench/results/mlx-peer-<device>.json and prints a table with the fuselm/mlx-lm ratios.
`--stash` (no MLX needed) makes the checkpoints and fuselm's graphs only: bench/h200_mlx.sh's CPU phase.
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
import tempfile
import threading
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
    return graph_kernels(outputs)


def prepared_arrays(graph) -> list:
    """The weights fuselm's load prepared (QMatMul's, and QMoE's stacked experts), to evaluate them at load."""
    out = []
    for n in graph.nodes:
        for key in {"QMatMul": ("weight",), "QMoE": ("gate_up", "down")}.get(n.op_type, ()):
            data = n.attrs[key].data
            out.extend(data if isinstance(data, tuple) else [data])
    return out


# --- engines (each runs in a child process) ------------------------------------------------
class FuselmEngine:
    def __init__(self, model: Path, dtype: str, compile_: bool):
        import mlx.core as mx
        from fuselm.runtime_metal.sampling import Sampler

        import fuselm

        t0 = time.perf_counter()
        self.engine = fuselm.load(model, backend="mlx", dtype=dtype, compile=compile_)  # what `fuselm run` runs
        self.sess = self.engine.session
        mx.eval(prepared_arrays(self.sess.graph))
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
        return self.engine.generate(prompt, n, self.sampler)

    def step_graph(self, prompt: list[int]) -> tuple[list, list, float]:
        """One decode step built lazily after `prompt`: (outputs, inputs, host seconds to build it)."""
        sess, b = self.sess, self.sess.backend
        sess.reset(len(prompt) + 8)
        y = b.pick_token(sess.prefill(prompt), self.sampler)
        for _ in range(4):  # past the checked step and the compile (no NaN check: fused_as_one's values)
            y = b.pick_token(sess.decode(y), self.sampler)
        y = b.pick_token(sess.decode(y), self.sampler)
        # (the buffers are written in place, the states replaced: evaluate them before the step)
        b.sync([y, *sess.buffers.values(), *sess.state.values()])
        t = time.perf_counter()
        y = b.pick_token(sess.decode(y), self.sampler)
        host = time.perf_counter() - t
        return [y, *sess.buffers.values(), *sess.state.values()], [], host

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
        state = [a for c in cache for a in c.state[:2] if isinstance(a, mx.array)]  # (a recurrent layer's ArraysCache)
        return [y, logprobs, *state], [], host

    def what(self) -> str:
        import mlx_lm

        return f"mlx-lm {mlx_lm.__version__} generate_step"


def one_run(engine, contexts: list[int], prefills: list[int], r: int, decode_tokens: int = DECODE) -> dict:
    """One run of every point: decode tokens/s at each context (the median interval between tokens) and
    prefill tokens/s at each length; `r` seeds the prompts (run 0 is the warm-up)."""
    decode, prefill, syncs = {}, {}, None
    for c in contexts:
        times, t = [], time.perf_counter()
        for _ in engine.tokens(_ids(c, engine.vocab, r), decode_tokens):
            now = time.perf_counter()
            times.append(now - t)
            t = now
            if len(times) == 1 and engine.syncs is not None:
                engine.syncs = 0  # count the waits of the decode steps only
        decode[str(c)] = 1 / statistics.median(times[1:])
        if engine.syncs is not None:
            syncs = engine.syncs / (decode_tokens - 1)
    for p in prefills:
        t = time.perf_counter()
        next(iter(engine.tokens(_ids(p, engine.vocab, 100 + r), 1)))
        prefill[str(p)] = p / (time.perf_counter() - t)
    return {"decode": decode, "prefill": prefill, "syncs": syncs}


def per_token(engine, context: int) -> dict:
    """Kernels of one decode step (mx.export_to_dot) and the host milliseconds to build it."""
    outs, ins, _ = engine.step_graph(_ids(context, engine.vocab, 7))
    counts = count_primitives(outs, ins)
    host_ms = []
    for _ in range(5):
        outs, ins, h = engine.step_graph(_ids(context, engine.vocab, 7))
        host_ms.append(h * 1e3)
    return {**counts, "host_ms": statistics.median(host_ms)}


def fused_as_one(make, context: int) -> dict:
    """On MLX's CPU backend: the kernels of one decode step with MLX's fused ops counted as one each
    (mlx_standins.fused_ops_as_one, a fresh engine built inside it: its values are wrong, its graph is the
    GPU's), so the count compares with a Metal or CUDA one."""
    from mlx_standins import fused_ops_as_one, standin_kernels

    with fused_ops_as_one():
        engine = make()
        outs, ins, _ = engine.step_graph(_ids(context, engine.vocab, 7))
        import mlx.core as mx

        mx.eval(ins)
        return standin_kernels(outs)


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


CHECK_PROMPT = 64  # prompt tokens of the token check on a benchmarked (random-weight) checkpoint


def greedy_tokens(model: Path, backend: str, dtype: str, n: int) -> tuple[list[int], str, list[float] | None]:
    """Greedy tokens after the check's prompt: fuselm's on `backend` (mlx, or torch on CUDA when there) on a fuselm
    graph, or mlx-lm's generate_step on its directory (`mlx-lm`). The demo model's prompt is text; a benchmarked
    checkpoint's is CHECK_PROMPT random ids, the same ids for every engine, and torch also gives the margin between
    its two largest logits at each token (where another engine parts from it, a near tie or not)."""
    if backend == "mlx-lm":
        engine = MlxLmEngine(model)
        return [int(t) for t in engine.tokens(_ids(CHECK_PROMPT, engine.vocab, 3), n)], engine.what(), None
    import numpy as np

    import fuselm
    from fuselm.modeldir import read_meta

    device = None
    if backend == "torch":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    demo = model.name.startswith("demo-")
    prompt = "the capital of france is" if demo else _ids(CHECK_PROMPT, read_meta(model)["dims"]["vocab"], 3)
    r = fuselm.run(model, prompt=prompt, max_tokens=n, ignore_eos=True, backend=backend, device=device, dtype=dtype,
                   quiet=True, stream=io.StringIO())
    margins = None
    if backend == "torch" and not demo:  # the same steps teacher-forced through a session, for its logits
        sess = fuselm.load(model, backend=backend, device=device, dtype=dtype).session
        sess.reset(len(prompt) + n)
        logits, margins = sess.prefill(prompt), []
        for t in r["tokens"]:
            top = np.sort(sess.logits_to_numpy(logits))[-2:]
            margins.append(round(float(top[1] - top[0]), 6))
            logits = sess.decode(t)
    return r["tokens"], r["what"], margins


def token_check(work: Path, points: list[tuple[str, dict]], dtype: str, n: int = 32, save=None,
                only: list[str] = ()) -> dict:
    """Greedy tokens against fuselm torch f32 (CUDA where there) on one q4 graph: fuselm MLX in f32 and bf16 on the
    trained demo model and on each benchmarked checkpoint (`points`: its name and prepare()'s paths), where mlx-lm's
    tokens on its own q4 directory (in `dtype`) are compared too (its own quantization: other weights). Random weights
    give near-tied logits, where two kernels may pick differently: `first_difference` says where the tokens part and
    `reference_margin` torch's top-two logit gap there. On a CPU torch dequantizes the weights (FUSELM_NO_CPU_KERNELS:
    its int8-activation kernels drift by ~1e-2, more than such ties). `save(checks)` after each child process; `only`
    names the comparisons to make ("mlx-f32", "mlx-bf16", "mlx-lm", "demo"; empty: all)."""
    import fuselm
    from fuselm.synth import make_checkpoint

    hf, exp, opt = work / "demo-hf", work / "demo-q4", work / "demo-q4-opt"
    demo = [("demo", {"fuselm": opt})] if not only or "demo" in only else []
    if demo and not (opt / "fuselm.json").is_file():
        make_checkpoint(hf, "qwen3", train_steps=150, hidden_size=96, intermediate_size=256, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2)
        fuselm.convert(hf, exp, quant="q4", force=True, quiet=True)
        fuselm.optimize(exp, opt, force=True, quiet=True)
    out = {}
    for name, paths in [*demo, *points]:
        runs = [("torch", "f32", paths["fuselm"]), ("mlx", "f32", paths["fuselm"]), ("mlx", "bf16", paths["fuselm"])]
        runs += [("mlx-lm", dtype, paths["mlx-lm"])] if "mlx-lm" in paths else []
        runs = [r for r in runs if not only or r[0] == "torch" or (r[0] if r[0] == "mlx-lm" else f"mlx-{r[1]}") in only]
        for backend, dt, model in runs:
            res = subprocess.run([sys.executable, __file__, "--child", f"tokens-{backend}", "--model", str(model),
                                  "--dtype", dt, "--runs", str(n)], capture_output=True, text=True,
                                 env={**os.environ, "FUSELM_NO_CPU_KERNELS": "1"} if backend == "torch" else None)
            line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
            out[f"{name} {backend}-{dt}"] = json.loads(line[7:]) if line else {"error": res.stderr.strip()[-500:]}
            if save is not None:  # after every child: a call cut off keeps the checks done
                save(out)
        margins = {k: out[k].pop("margins", None) for k in out if k.startswith(f"{name} ")}[f"{name} torch-f32"]
        ref = out[f"{name} torch-f32"].get("tokens")
        for key, v in out.items():
            if key.startswith(f"{name} ") and "tokens" in v and ref and not key.endswith("torch-f32"):
                v["equal_to_torch_f32"] = v["tokens"] == ref
                v["first_difference"] = next((i for i, (a, b) in enumerate(zip(v["tokens"], ref, strict=False))
                                              if a != b), None)
                if v["first_difference"] is not None and margins:
                    v["reference_margin"] = margins[v["first_difference"]]
    return out


def child(args) -> None:
    """One engine in its own process: loads, warms up (run 0), then answers the parent line by line:
    `run R` -> one run of every point, `counts` -> the per-token figures and peak memory, `quit`."""
    engine = args.child
    if engine == "load-fuselm":  # a first load: prepares the weights and keeps them in the prepared store
        e = FuselmEngine(Path(args.model), args.dtype, compile_=True)
        print("RESULT " + json.dumps({"load_s": e.load_s, "prepared": e.sess.graph.prepared}), flush=True)
        return
    if engine.startswith("tokens-"):
        tokens, what, margins = greedy_tokens(Path(args.model), engine.split("-", 1)[1], args.dtype, args.runs)
        print("RESULT " + json.dumps({"tokens": tokens, "what": what, "margins": margins}), flush=True)
        return
    import mlx.core as mx

    def make():
        if engine == "mlx-lm":
            return MlxLmEngine(Path(args.model))
        if engine == "fuselm-1thread":
            os.environ["FUSELM_BUILD_THREAD"] = "0"
        if engine == "fuselm-qmm":
            os.environ["FUSELM_WIDE_DEQUANT"] = "0"
        return FuselmEngine(Path(args.model), args.dtype, compile_=engine != "fuselm-eager")

    e = make()
    one_run(e, args.contexts, args.prefill, 0, args.decode)
    print("RESULT " + json.dumps({"load_s": e.load_s, "what": e.what()}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "run":
            out = one_run(e, args.contexts, args.prefill, int(cmd[1]), args.decode)
        elif cmd[0] == "counts":
            out = {**per_token(e, args.contexts[0]), "peak_memory_gb": mx.get_peak_memory() / 1e9,
                   "device": str(mx.default_device())}
            if "gpu" not in out["device"]:
                out["fused_as_one"] = fused_as_one(make, args.contexts[0])
        else:
            return
        print("RESULT " + json.dumps(out), flush=True)


# --- orchestration ----------------------------------------------------------------------------
def _convert_bench():
    sys.path.insert(0, str(HERE))
    import convert as convert_bench

    return convert_bench


def stem(shape: str) -> str:
    """The work directories' prefix of `shape` (qwen3-<shape> for the dense Qwen3 shapes, as before)."""
    return f"qwen3-{shape}" if _convert_bench().model_type(shape) == "qwen3" else shape


_LOG_LOCK = threading.Lock()


def _timed(work: Path, shape: str, key: str, done: Path, cmd: list[str], env: dict | None = None) -> None:
    """Run `cmd` (unless `done` exists) measured in a child (wall, CPU, peak RSS); kept in <stem>-prepare.json
    under `key`, so the bench phase reports the stash phase's conversions."""
    if done.is_file():
        return
    r = _convert_bench().measure(cmd, env)
    log = work / f"{stem(shape)}-prepare.json"
    with _LOG_LOCK:  # (--stash prepares the group sizes side by side)
        data = json.loads(log.read_text()) if log.is_file() else {}
        data[key] = {**r, "cpus": os.cpu_count(), "output_gb": round(sum(
            f.stat().st_size for f in done.parent.rglob("*") if f.is_file()) / 1e9, 2)}
        tmp = log.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(log)


def prepare(shape: str, group: int, work: Path, dtype: str | None, checkpoint_only: bool = False) -> dict[str, Path]:
    """The HF checkpoint, mlx-lm's directory (weights and activations in `dtype`, as fuselm computes), fuselm's
    exported and optimized graphs (made once, each step timed); `dtype` None: the checkpoint and fuselm's only."""
    s = stem(shape)
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / f"{s}-hf"
    # in children: the parent stays small (Linux carries a child's RSS at fork into its ru_maxrss)
    _timed(work, shape, "checkpoint", ckpt / "model.safetensors.index.json",
           [sys.executable, str(HERE / "convert.py"), "--shapes", shape, "--make-checkpoint", str(ckpt)])
    if checkpoint_only:
        return {"ckpt": ckpt}
    out = {"ckpt": ckpt, "mlx-lm": work / f"{s}-mlxlm-g{group}-{dtype}", "exported": work / f"{s}-q4-g{group}-exported",
           "fuselm": work / f"{s}-q4-g{group}"}
    exporter = [] if _convert_bench().model_type(shape) == "qwen3" else ["--exporter", "torch"]  # (MoE: traced)
    _timed(work, shape, f"fuselm convert g{group}", out["exported"] / "fuselm.json",
           [sys.executable, "-m", "fuselm.cli", "convert", str(ckpt), "-o", str(out["exported"]), *exporter,
            "--quant", "q4", "--block-size", str(group), "--lm-head", "q4", "--embed", "q4", "--force", "--quiet"],
           {"FUSELM_TRACE_CACHE": "0"})  # (a first convert of the architecture: it traces, as on a fresh machine)
    _timed(work, shape, f"fuselm optimize g{group}", out["fuselm"] / "fuselm.json",
           [sys.executable, "-m", "fuselm.cli", "optimize", str(out["exported"]), "-o", str(out["fuselm"]),
            "--force", "--quiet"])
    if dtype is None:
        return out
    _timed(work, shape, f"mlx-lm convert g{group} {dtype}", out["mlx-lm"] / "config.json",
           [sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(_for_mlx_lm(ckpt)), "--mlx-path", str(out["mlx-lm"]), "-q", "--q-bits", "4", "--q-group-size",
            str(group), "--dtype", {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[dtype]])
    log = work / f"{s}-prepare.json"
    steps = json.loads(log.read_text()) if log.is_file() else {}
    out["convert"] = {"fuselm": {k.split(" g")[0]: v for k, v in steps.items() if k.startswith("fuselm") and
                                 k.endswith(f" g{group}")},
                      "mlx-lm": {"convert": steps.get(f"mlx-lm convert g{group} {dtype}")},
                      "checkpoint": steps.get("checkpoint")}
    # the first load prepares the MLX weights and keeps them in the prepared store (runtime_metal/prepared.py): the
    # benchmark's own load is then a second load, as users see every time after the first
    first = subprocess.run([sys.executable, __file__, "--child", "load-fuselm", "--model", str(out["fuselm"]),
                            "--dtype", dtype], check=True, capture_output=True, text=True).stdout
    out["first_load"] = json.loads(next(x for x in first.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    return out


def _for_mlx_lm(ckpt: Path) -> Path:
    """The checkpoint as mlx-lm 0.32 reads it, as a copy of config.json beside links to its other files: it has no
    `qwen3_5_text` model (its `qwen3_5` takes the text config itself), and its granitemoehybrid reads the layer
    types the released Granite-4 configs name (`mamba` / `attention`; transformers 5 writes linear_ / full_attention)."""
    config = json.loads((ckpt / "config.json").read_text())
    if config.get("model_type") == "granitemoehybrid":
        names = {"linear_attention": "mamba", "full_attention": "attention"}
        patch = {"layer_types": [names.get(t, t) for t in config["layer_types"]]}
    elif config.get("model_type") == "qwen3_5_text":
        patch = {"model_type": "qwen3_5"}
    else:
        return ckpt
    peer = ckpt.with_name(ckpt.name + "-for-mlx-lm")
    peer.mkdir(exist_ok=True)
    for f in ckpt.iterdir():
        if f.name != "config.json" and not (peer / f.name).exists():
            (peer / f.name).symlink_to(f.resolve())
    (peer / "config.json").write_text(json.dumps({**config, **patch}, indent=2))
    return peer


class Child:
    """An engine's process, driven one command at a time (so the parent can interleave the engines)."""

    def __init__(self, engine: str, model: Path, args):
        cmd = [sys.executable, __file__, "--child", engine, "--model", str(model), "--dtype", args.dtype,
               "--decode", str(args.decode), "--contexts", *map(str, args.contexts), "--prefill", *map(str, args.prefill)]
        self.engine = engine
        self.log = tempfile.TemporaryFile(mode="w+")  # not a pipe: a chatty child must never block on it
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.error = None
        self.first = self._read()

    def _read(self) -> dict | None:
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        self.log.seek(0)
        tail = self.log.read().strip().splitlines()[-4:]
        self.error = " | ".join(tail)[:600] or f"exited with {self.proc.wait()}"
        return None

    def ask(self, command: str) -> dict | None:
        if self.error:
            return None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()


def bench_point(engines: dict[str, Path], args) -> list[dict]:
    """Every engine loaded in its own process, then run r of each engine in turn, r = 1..runs (interleaved:
    a drift of the machine over the minutes touches every engine alike); min / median / max per point."""
    t0 = time.perf_counter()
    children = {e: Child("fuselm" if e == "fuselm-exported" else e, m, args) for e, m in engines.items()}
    runs: dict[str, list] = {e: [] for e in engines}
    for r in range(1, args.runs + 1):
        for e, ch in children.items():
            out = ch.ask(f"run {r}")
            if out is not None:
                runs[e].append(out)
    rows = []
    for e, ch in children.items():
        counts = ch.ask("counts")
        ch.close()
        if ch.error or not runs[e] or counts is None:
            rows.append({"engine": e, "error": ch.error or "no result"})
            continue
        decode = {k: [r["decode"][k] for r in runs[e]] for k in runs[e][0]["decode"]}
        prefill = {k: [r["prefill"][k] for r in runs[e]] for k in runs[e][0]["prefill"]}
        syncs = runs[e][-1]["syncs"]
        rows.append({"engine": e, "decode_tok_s": {k: statistics.median(v) for k, v in decode.items()},
                     "prefill_tok_s": {k: statistics.median(v) for k, v in prefill.items()},
                     "decode_spread": {k: spread(v) for k, v in decode.items()},
                     "prefill_spread": {k: spread(v) for k, v in prefill.items()},
                     "decode_runs": decode, "prefill_runs": prefill, "load_s": ch.first["load_s"],
                     "what": ch.first["what"], "peak_memory_gb": counts.pop("peak_memory_gb"),
                     "device": counts.pop("device"),
                     "per_token": {**counts, "syncs": syncs if syncs is not None else 1.0},
                     "wall_s": round(time.perf_counter() - t0, 1)})
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=["0.6b", "4b"], choices=list(_convert_bench().SHAPES))
    ap.add_argument("--groups", nargs="*", type=int, default=[32, 64], choices=[32, 64, 128])
    ap.add_argument("--contexts", nargs="*", type=int, default=[128, 2048], help="decode at these context lengths")
    ap.add_argument("--prefill", nargs="*", type=int, default=[512, 2048], help="prefill these prompt lengths")
    ap.add_argument("--runs", type=int, default=5, help="measured runs per point, the engines interleaved")
    ap.add_argument("--decode", type=int, default=DECODE, help="greedy tokens timed per context")
    ap.add_argument("--engines", nargs="*", default=["mlx-lm", "fuselm"],
                    help="mlx-lm, fuselm (optimized, compiled), fuselm-exported (no passes), fuselm-eager (not compiled), "
                         "fuselm-1thread (fuselm with its steps built on the host's own thread: FUSELM_BUILD_THREAD=0), "
                         "fuselm-qmm (every prompt matmul as mx.quantized_matmul: FUSELM_WIDE_DEQUANT=0)")
    ap.add_argument("--dtype", default="auto", help="fuselm's --dtype (auto: bf16 on a GPU, as mlx-lm runs)")
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "fuselm-bench-mlx")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/mlx-peer-<device>.json)")
    ap.add_argument("--token-check", nargs="*", default=None, choices=["mlx-f32", "mlx-bf16", "mlx-lm", "demo"],
                    help="also compare greedy tokens with fuselm-torch f32's on one q4 graph: fuselm-MLX f32 / bf16 on the "
                         "trained demo model and on each shape's checkpoint, and there mlx-lm's (naming some: only those)")
    ap.add_argument("--stash", action="store_true",
                    help="only make the checkpoints and fuselm's graphs, timed (no MLX needed; bench/h200_mlx.sh stash)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.stash:  # the checkpoint, then the group sizes side by side (each conversion is mostly one core's work)
        from concurrent.futures import ThreadPoolExecutor

        for shape in args.shapes:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(args.groups)) as pool:
                prepare(shape, args.groups[0], args.work, None, checkpoint_only=True)
                list(pool.map(lambda g, shape=shape: prepare(shape, g, args.work, None), args.groups))
            print(f"[{shape}] checkpoint and fuselm graphs ready in {time.perf_counter() - t0:.0f} s: "
                  + (args.work / f"{stem(shape)}-prepare.json").read_text(), flush=True)
        return 0
    if args.child:
        child(args)
        return 0
    import mlx.core as mx

    device = str(mx.default_device())
    gpu = "gpu" in device
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if gpu else "f32")  # fuselm's auto, for mlx-lm too
    rows, points = [], []
    for shape in args.shapes:
        for group in args.groups:
            t0 = time.perf_counter()
            paths = prepare(shape, group, args.work, dtype)
            points.append((f"{shape} g{group}", paths))
            print(f"[{shape} g{group}] models ready in {time.perf_counter() - t0:.0f} s", flush=True)
            engines = {e: paths["exported" if e == "fuselm-exported" else "mlx-lm" if e == "mlx-lm" else "fuselm"]
                       for e in args.engines}
            for r in bench_point(engines, args):
                r.update(shape=shape, group=group)
                if r["engine"] == "fuselm":
                    r["first_load"] = paths["first_load"]
                if r["engine"] in ("fuselm", "mlx-lm"):
                    r["convert"] = paths["convert"][r["engine"]]
                    r["checkpoint"] = paths["convert"]["checkpoint"]
                rows.append(r)
                print(f"[{shape} g{group}] {r['engine']}: " + json.dumps(
                    {k: v for k, v in r.items() if not k.endswith("_runs") and k != "per_token"}), flush=True)
    summary = report(rows)
    out = args.out or RESULTS / f"mlx-peer-{'gpu' if gpu else 'cpu'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    import mlx_lm

    def write(checks: dict | None) -> None:  # written before the token check too: a run cut off there keeps its rows
        out.write_text(json.dumps({
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                        "mlx": mx.__version__, "mlx_device": device, "mlx_lm": mlx_lm.__version__},
            "protocol": {"decode_tokens": args.decode, "contexts": args.contexts, "prefill": args.prefill,
                         "runs": args.runs, "dtype": dtype,
                         "command": " ".join(["python", "bench/mlx_peer.py", *(argv or sys.argv[1:])])},
            "rows": rows, "summary": summary, "token_check": checks}, indent=2) + "\n")

    write(None)
    if args.token_check is not None:
        checks = token_check(args.work, points, dtype, save=write, only=args.token_check)
        print("token check: " + json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "tokens"}
                                            for k, v in checks.items()}))
        write(checks)
    print(f"wrote {out}")
    return 0


def convert_cell(steps: dict | None) -> str:
    """Wall seconds of the engine's conversion steps (fuselm: convert + optimize) and the largest peak RSS."""
    steps = [v for v in (steps or {}).values() if v]
    if not steps:
        return ""
    return f"{sum(v['seconds'] for v in steps):.1f} ({max(v['peak_rss_mb'] for v in steps) / 1024:.2f})"


def report(rows: list[dict]) -> dict:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="fuselm MLX vs mlx-lm (median, min-max over the interleaved runs)")
    cols = ("shape", "group", "engine", "decode tok/s by context", "prefill tok/s by length", "load s",
            "kernels/token", "host ms/token", "convert s (peak RSS GB)")
    for c in cols:
        table.add_column(c)
    summary: dict = {}

    def cell(sp: dict, fmt: str) -> str:
        return " / ".join(f"{k}: {v['median']:{fmt}} ({v['min']:{fmt}}-{v['max']:{fmt}})" for k, v in sp.items())

    for r in rows:
        if "error" in r:
            table.add_row(r["shape"], str(r["group"]), r["engine"], "", "", "", "", r["error"][:80], "")
            continue
        pt = r["per_token"]
        one = f", as one: {pt['fused_as_one']['kernels']}" if "fused_as_one" in pt else ""
        table.add_row(r["shape"], str(r["group"]), r["engine"], cell(r["decode_spread"], ".1f"),
                      cell(r["prefill_spread"], ".0f"), f"{r['load_s']:.2f}", f"{pt['kernels']} ({pt['primitives']}){one}",
                      f"{pt['host_ms']:.2f}", convert_cell(r.get("convert")))
    console.print(table)
    for key in dict.fromkeys((r["shape"], r["group"]) for r in rows):
        point = [r for r in rows if (r["shape"], r["group"]) == key and "error" not in r]
        for what in ("kernels", "fused_as_one"):
            tops = {r["engine"]: dict(r["per_token"]["top"] if what == "kernels" else r["per_token"][what]["top"])
                    for r in point if what == "kernels" or what in r["per_token"]}
            if not tops:
                continue
            ops = Table(title=f"{key[0]} g{key[1]}: kernels per decode token by MLX primitive"
                              + (" (MLX's fused ops counted as one: the GPU's graph)" if what != "kernels" else ""))
            ops.add_column("primitive")
            for e in tops:
                ops.add_column(e)
            names = sorted({n for t in tops.values() for n in t}, key=lambda n: -max(t.get(n, 0) for t in tops.values()))
            for n in names:
                ops.add_row(n, *[str(t.get(n, "")) for t in tops.values()])
            ops.add_row("total", *[str(sum(t.values())) for t in tops.values()])
            console.print(ops)
    for r in rows:
        peer = next((p for p in rows if p["engine"] == "mlx-lm" and p["shape"] == r["shape"]
                     and p["group"] == r["group"] and "error" not in p), None)
        if r["engine"] == "mlx-lm" or peer is None or "error" in r:
            continue
        key = f"{r['shape']} g{r['group']} {r['engine']}/mlx-lm"
        for k, v in r["decode_tok_s"].items():
            summary[f"{key} decode@{k}"] = round(v / peer["decode_tok_s"][k], 2)
            pairs = [a / b for a, b in zip(r["decode_runs"][k], peer["decode_runs"][k], strict=False)]  # run i of each
            summary[f"{key} decode@{k} paired (median of run-by-run ratios)"] = round(statistics.median(pairs), 2)
        for k, v in r["prefill_tok_s"].items():
            summary[f"{key} prefill@{k}"] = round(v / peer["prefill_tok_s"][k], 2)
        summary[f"{key} load s"] = [round(r["load_s"], 2), round(peer["load_s"], 2)]
        if r.get("convert") and peer.get("convert", {}).get("convert"):
            ours, theirs = r["convert"], peer["convert"]["convert"]
            summary[f"{key} convert s (fuselm convert + optimize, mlx-lm)"] = [
                round(sum(v["seconds"] for v in ours.values()), 1), theirs["seconds"]]
            summary[f"{key} convert peak RSS MB"] = [max(v["peak_rss_mb"] for v in ours.values()), theirs["peak_rss_mb"]]
        summary[f"{key} kernels/token"] = [r["per_token"]["kernels"], peer["per_token"]["kernels"]]
        if "fused_as_one" in r["per_token"] and "fused_as_one" in peer["per_token"]:
            summary[f"{key} kernels/token, fused ops as one"] = [r["per_token"]["fused_as_one"]["kernels"],
                                                                 peer["per_token"]["fused_as_one"]["kernels"]]
        for k, v in r["decode_spread"].items():
            p = peer["decode_spread"][k]
            summary[f"{key} decode@{k} spread max/min"] = [round(v["max"] / v["min"], 2), round(p["max"] / p["min"], 2)]
    for k, v in summary.items():
        console.print(f"  {k}: {v}")
    return summary


if __name__ == "__main__":
    sys.exit(main())
