"""Where a decode token's device time goes, kernel by kernel, fuselm's MLX backend against mlx-lm.

On MLX's CUDA backend the kernels of one process are recorded by CUPTI through
torch.profiler (it records every CUDA kernel of the process, MLX's included); each engine runs in its
own process (bench/mlx_peer.py's engines), decodes N greedy tokens after a C-token prompt under the
profiler, and prints the kernels' summed device time per token by kernel name, the device's busy time
per token and the wall time per token. Run on a machine with a CUDA GPU, MLX's CUDA build and torch:

    python bench/mlx_kernel_profile.py --fuselm MODEL_DIR --mlx-lm MLX_DIR [--context 128] [--tokens 32]
    python bench/mlx_kernel_profile.py --shape 0.6b --group 32 --work DIR   # both made as bench/mlx_peer.py makes them
    python bench/mlx_kernel_profile.py --shape 0.6b --host          # no profiler: the host's share of a token
    python bench/mlx_kernel_profile.py --primitives                 # MLX's host cost per primitive, by kind

`--host` splits each pipelined decode token (each engine's own loop: build step n+1, mx.async_eval it, read
token n) into the host's graph build, the host's time inside mx.async_eval (MLX walks the step's
primitives and encodes their kernels there) and the wait for the device; `--primitives` measures that
encode cost per primitive kind on chains of one kind (views, elementwise, a compiled expression, MLX's
fused ops, a quantized GEMV), so the step's primitive mix reads as host microseconds. Both run on any
MLX device (MLX's CPU backend too: its encode is a task queue, the figures are not a GPU's).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _engine(engine: str, model: Path, dtype: str):
    """bench/mlx_peer.py's engine in this process: mlx-lm, fuselm, or fuselm without compiled pieces."""
    import mlx_peer

    return mlx_peer.MlxLmEngine(model) if engine == "mlx-lm" else \
        mlx_peer.FuselmEngine(model, dtype, compile_=engine != "fuselm-eager")


def profile(engine: str, model: Path, context: int, tokens: int, dtype: str) -> dict:
    import mlx_peer
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    e = _engine(engine, model, dtype)
    prompt = mlx_peer._ids(context, e.vocab, 3)
    for _ in e.tokens(prompt, 8):  # warm-up: compile, the checked step
        pass
    torch.cuda.init()
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        stamps = []
        for _ in e.tokens(prompt, tokens):
            stamps.append(time.perf_counter())
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    kernels = [ev for ev in events if ev.get("cat") == "kernel"]
    by_name, count = defaultdict(float), defaultdict(int)
    for k in kernels:
        name = k["name"][:90]  # (a template kernel's name runs to kilobytes)
        by_name[name] += k["dur"]
        count[name] += 1
    wall = (stamps[-1] - stamps[0]) / (tokens - 1) * 1e6  # between the first token (the prefill's) and the last
    busy = sum(by_name.values()) / tokens
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:25]
    return {"engine": engine, "what": e.what(), "tokens": tokens, "context": context,
            "wall_us_per_token": wall, "kernel_us_per_token_incl_prefill": busy,
            "kernels_per_token_incl_prefill": len(kernels) / tokens,
            "top": [{"kernel": n, "us_per_token": d / tokens, "calls_per_token": count[n] / tokens,
                     "us_per_call": d / count[n]} for n, d in top]}


def host_split(engine: str, model: Path, context: int, tokens: int, dtype: str) -> dict:
    """Median host microseconds per pipelined decode token: building the step, inside mx.async_eval, waiting;
    on the default stream and on a thread-local stream of its own (mlx-lm's generate_step runs on one), and
    each engine's own token iterator for reference."""
    import contextlib

    import mlx.core as mx

    out = {}
    for where in ("default stream", "own stream"):
        ctx = mx.stream(mx.new_thread_local_stream(mx.default_device())) if where == "own stream" else \
            contextlib.nullcontext()
        with ctx:
            out[where] = _host_split(engine, model, context, tokens, dtype)
    return {"engine": engine, "context": context, "tokens": tokens, **out}


def _host_split(engine: str, model: Path, context: int, tokens: int, dtype: str) -> dict:
    import statistics

    import mlx.core as mx
    import mlx_peer

    e = _engine(engine, model, dtype)
    prompt = mlx_peer._ids(context, e.vocab, 3)
    if engine == "mlx-lm":
        from mlx_lm.models.cache import make_prompt_cache

        def start():
            cache = make_prompt_cache(e.model)
            return mx.argmax(e.model(mx.array(prompt)[None], cache=cache)[:, -1, :], axis=-1), cache

        def step(y, cache):  # mlx-lm's generate_step._step
            logits = e.model(y[None], cache=cache)[:, -1, :]
            return mx.argmax(logits - mx.logsumexp(logits, keepdims=True), axis=-1)
    else:
        sess, b = e.sess, e.sess.backend

        def start():
            sess.reset(context + tokens + 16)
            return b.pick_token(sess.prefill(prompt), e.sampler), None

        def step(y, _):
            return b.pick_token(sess.decode(y), e.sampler)
    split = {"build": [], "async_eval": [], "wait": [], "token": []}
    for r in range(2):  # run 0 warms up (compiles, the checked step)
        y, cache = start()
        mx.async_eval(y)
        for n in range(tokens):
            t0 = time.perf_counter()
            nxt = step(y, cache)
            t1 = time.perf_counter()
            mx.async_eval(nxt)
            t2 = time.perf_counter()
            y.item()
            t3 = time.perf_counter()
            if r and n >= 2:
                for v, t in zip(split.values(), (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
                    v.append(t)
            y = nxt
    own = []  # the engine's own iterator (mlx-lm: generate_step, on its generation stream)
    for _ in range(2):
        own, t = [], time.perf_counter()
        for _ in e.tokens(prompt, tokens):
            now = time.perf_counter()
            own.append(now - t)
            t = now
    return {"what": e.what(), **{f"{k}_us": statistics.median(v) * 1e6 for k, v in split.items()},
            "own_iterator_us": statistics.median(own[2:]) * 1e6}


def primitive_costs(n: int = 400, rounds: int = 5) -> dict:
    """Host microseconds per primitive inside mx.async_eval (and to build it), on chains of `n` primitives of
    one kind over decode-sized arrays ([1, 16, 1, 128] bfloat16 on a GPU, float32 on a CPU)."""
    import statistics

    import mlx.core as mx

    dt = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    x0 = mx.random.normal((1, 16, 1, 128)).astype(dt)
    w = mx.random.normal((16, 1, 128)).astype(dt)
    cos, sin = mx.cos(x0.astype(mx.float32)), mx.sin(x0.astype(mx.float32))
    wq, sq, bq = mx.quantize(mx.random.normal((2048, 2048)).astype(dt), group_size=32, bits=4)
    v0 = mx.random.normal((1, 2048)).astype(dt)
    rope = mx.compile(lambda a, c, s, w: (a * w * c + a[..., ::-1] * w * s).astype(a.dtype))
    buf = mx.zeros((1, 16, 64, 128), dt)
    mx.eval(x0, w, cos, sin, wq, sq, bq, v0, buf)
    kinds = {
        "reshape (view)": (x0, lambda a: a.reshape(1, 16, 128).reshape(1, 16, 1, 128), 2),
        "slice (view)": (mx.zeros((1, 16 + n, 1, 128), dt), lambda a: a[:, 1:], 1),
        "add (elementwise)": (x0, lambda a: a + w, 1),
        "compiled expression (4 inputs)": (x0, lambda a: rope(a, cos, sin, w), 1),
        "mx.fast.rms_norm": (x0, lambda a: mx.fast.rms_norm(a, None, 1e-6), 1),
        "mx.fast.rope": (x0, lambda a: mx.fast.rope(a, 128, traditional=False, base=1e6, scale=1.0, offset=5), 1),
        "mx.fast.sdpa (1 query, 64 keys)": (x0, lambda a: mx.fast.scaled_dot_product_attention(
            a, buf, buf, scale=0.1), 1),
        "quantized_matmul (2048x2048 GEMV)": (v0, lambda a: mx.quantized_matmul(
            a, wq, sq, bq, transpose=True, group_size=32, bits=4), 1),
    }
    out = {}
    for name, (a0, fn, per) in kinds.items():
        enc, build = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            a = a0
            for _ in range(n // per):
                a = fn(a)
            t1 = time.perf_counter()
            mx.async_eval(a)
            t2 = time.perf_counter()
            mx.eval(a)
            build.append((t1 - t0) / n * 1e6)
            enc.append((t2 - t1) / n * 1e6)
        out[name] = {"async_eval_us": statistics.median(enc[1:]), "build_us": statistics.median(build[1:])}
    return {"device": str(mx.default_device()), "mlx": mx.__version__, "chain": n, "kinds": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fuselm", type=Path)
    ap.add_argument("--mlx-lm", type=Path)
    ap.add_argument("--shape", default=None, help="prepare both models as bench/mlx_peer.py does (0.6b, 4b, ...)")
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--work", type=Path, default=Path("/tmp/fuselm-bench-mlx"))
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--host", action="store_true", help="no profiler: split each token into build / async_eval / wait")
    ap.add_argument("--eager", action="store_true", help="with --host: fuselm without compiled pieces as well")
    ap.add_argument("--primitives", action="store_true", help="MLX's host cost per primitive kind, then exit")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.primitives:
        res = primitive_costs()
        print(f"== host cost per primitive, {res['device']}, MLX {res['mlx']} (chains of {res['chain']})")
        for k, v in res["kinds"].items():
            print(f"   {v['async_eval_us']:7.2f} us in async_eval {v['build_us']:7.2f} us to build  {k}")
        if args.out:
            args.out.write_text(json.dumps(res, indent=1))
        return 0
    if args.child:
        fn = host_split if args.host else profile
        print("RESULT " + json.dumps(fn(args.child, args.model, args.context, args.tokens, args.dtype)))
        return 0
    if args.shape:
        import mlx_peer

        made = mlx_peer.prepare(args.shape, args.group, args.work, args.dtype)
        args.fuselm, args.mlx_lm = made["fuselm"], made["mlx-lm"]
    rows = []
    engines = [("mlx-lm", args.mlx_lm), ("fuselm", args.fuselm)] + ([("fuselm-eager", args.fuselm)] if args.eager else [])
    for engine, model in engines:
        if model is None:
            continue
        out = subprocess.run([sys.executable, __file__, "--child", engine, "--model", str(model), "--context",
                              str(args.context), "--tokens", str(args.tokens), "--dtype", args.dtype,
                              *(["--host"] if args.host else [])], capture_output=True, text=True)
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if not line:
            print(f"{engine} failed:\n{out.stderr[-3000:]}", file=sys.stderr)
            continue
        row = json.loads(line[-1][7:])
        rows.append(row)
        if args.host:
            for where in ("default stream", "own stream"):
                r = row[where]
                print(f"== {engine}, {where}: {r['token_us']:.0f} us/token = build {r['build_us']:.0f} + async_eval "
                      f"{r['async_eval_us']:.0f} + wait {r['wait_us']:.0f}; its own iterator {r['own_iterator_us']:.0f} "
                      f"us/token (medians; {r['what']})")
            continue
        print(f"== {engine}: wall {row['wall_us_per_token']:.0f} us/token, kernels "
              f"{row['kernel_us_per_token_incl_prefill']:.0f} us/token over "
              f"{row['kernels_per_token_incl_prefill']:.0f} kernels (the prefill's spread over the tokens)")
        for t in row["top"]:
            print(f"   {t['us_per_token']:8.1f} us/token {t['calls_per_token']:6.1f} calls {t['us_per_call']:7.2f} us/call  {t['kernel']}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
