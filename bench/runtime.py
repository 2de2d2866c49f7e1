"""Benchmark decode and prefill: fuselm vs onnxruntime (same optimized graph) vs HF transformers.

    python bench/runtime.py                             # this CPU: 0.6b and 4b, q4
    python bench/runtime.py --shapes 0.6b --runs 3
    python bench/runtime.py --device cuda               # GPU: fuselm (q4, f16) vs HF bf16 eager / static cache

Random-weight checkpoints shaped like Qwen3-0.6B / Qwen3-4B are written streaming by
bench/convert.py, converted (`--quant q4`, and f16 on CUDA) and optimized once. Every engine runs
in its own child process (own memory, own threads) and reports:
- decode tokens/s: 64 greedy tokens after a 128-token prompt (the median step time of each run;
  the median over runs),
- prefill tokens/s: one 512-token prompt to its first logits (median over runs),
after one warm-up run (compilation, first-touch of the weights). Prints a table with ratios and
writes bench/results/runtime-<device>.json. On CUDA it also reports achieved memory bandwidth:
weight bytes read per token x tokens/s, against the card's measured device-to-device copy rate.
"""

from __future__ import annotations

import argparse
import importlib.util
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
PROMPT, DECODE, PREFILL = 128, 64, 512


def _convert_bench():
    spec = importlib.util.spec_from_file_location("bench_convert", HERE / "convert.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ids(n: int, seed: int = 0) -> list[int]:
    import numpy as np

    return [int(i) for i in np.random.default_rng(seed).integers(10, 50000, n)]


# --- engines (each runs in a child process) ------------------------------------------------
def run_fuselm(model: Path, device: str, runs: int, compile_: bool, threads: int | None) -> dict:
    import numpy as np

    import fuselm

    t0 = time.perf_counter()
    sess = fuselm.load(model, backend="torch", device=device, compile=compile_, threads=threads).session
    load = time.perf_counter() - t0
    prompt, long_prompt = _ids(PROMPT), _ids(PREFILL, 1)
    decode, prefill = [], []
    for r in range(runs + 1):  # run 0 warms up (and compiles)
        sess.reset(PROMPT + DECODE + 1)
        token = int(np.argmax(sess.logits_to_numpy(sess.prefill(prompt))))
        steps = []
        for _ in range(DECODE):
            t = time.perf_counter()
            token = int(np.argmax(sess.logits_to_numpy(sess.decode(token))))
            steps.append(time.perf_counter() - t)
        sess.reset(PREFILL + 1)
        t = time.perf_counter()
        sess.logits_to_numpy(sess.prefill(long_prompt))
        if r:
            decode.append(1 / statistics.median(steps))
            prefill.append(PREFILL / (time.perf_counter() - t))
    return {"decode_tok_s": statistics.median(decode), "prefill_tok_s": statistics.median(prefill),
            "decode_runs": decode, "prefill_runs": prefill, "load_s": load, "what": sess.describe(),
            "compile_s": getattr(sess.compiled, "seconds", None), "threads": sess.threads}


def run_ort(model: Path, runs: int, accuracy_level: int | None, threads: int | None) -> dict:
    """onnxruntime as a peer: its own graph optimizations on (MatMulNBits), as users run it."""
    import numpy as np
    import onnxruntime as ort

    from fuselm.reference import OrtRunner

    t0 = time.perf_counter()
    runner = OrtRunner(model, optimize=True, accuracy_level=accuracy_level or 4, threads=threads)
    load = time.perf_counter() - t0

    def step(ids):
        return int(np.argmax(runner.step(ids)[0, -1]))

    decode, prefill = [], []
    for r in range(runs + 1):
        runner.reset()
        token = step(_ids(PROMPT))
        steps = []
        for _ in range(DECODE):
            t = time.perf_counter()
            token = step([token])
            steps.append(time.perf_counter() - t)
        runner.reset()
        t = time.perf_counter()
        step(_ids(PREFILL, 1))
        if r:
            decode.append(1 / statistics.median(steps))
            prefill.append(PREFILL / (time.perf_counter() - t))
    return {"decode_tok_s": statistics.median(decode), "prefill_tok_s": statistics.median(prefill),
            "decode_runs": decode, "prefill_runs": prefill, "load_s": load,
            "what": f"onnxruntime {ort.__version__} CPU, accuracy level {accuracy_level or 'default (4: int8 activations)'}"}


def run_hf(ckpt: Path, device: str, runs: int, dtype: str, cache: str, threads: int | None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if threads:
        torch.set_num_threads(threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=getattr(torch, dtype), attn_implementation="sdpa")
    model = model.to(device).eval()
    load = time.perf_counter() - t0
    kw = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    if cache == "static":
        kw["cache_implementation"] = "static"
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def gen(ids, new):
        x = torch.tensor([ids], device=device)
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(x, max_new_tokens=new, min_new_tokens=new, **kw)
        sync()
        return time.perf_counter() - t

    decode, prefill = [], []
    n = DECODE
    for r in range(runs + 1):
        t1 = gen(_ids(PROMPT), 1)
        if r == 0 and device == "cpu":  # HF bf16 on an AVX2 CPU is slow: time fewer tokens if needed
            n = DECODE if t1 < 10 else 16
        tn = gen(_ids(PROMPT), n + 1)
        tp = gen(_ids(PREFILL, 1), 1)
        if r:
            decode.append(n / max(tn - t1, 1e-9))
            prefill.append(PREFILL / tp)
    return {"decode_tok_s": statistics.median(decode), "prefill_tok_s": statistics.median(prefill),
            "decode_runs": decode, "prefill_runs": prefill, "load_s": load, "decode_tokens_timed": n,
            "what": f"transformers generate, {dtype}, sdpa, {cache} cache"}


def count_dispatches(model: Path, device: str) -> dict:
    """Ops the runtime dispatches per decode token (plan steps), and the aten ops they launch."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import fuselm

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    sess = fuselm.load(model, backend="torch", device=device, compile=False).session
    sess.reset(16)
    sess.prefill(_ids(4))
    for _ in range(3):
        sess.decode(5)
    calls = sess.executor.profiler
    calls.enabled, calls.times = True, {}
    with Count() as c:
        sess.decode(5)
    calls.enabled = False
    layers = sess.meta["dims"]["layers"]
    ops = sum(n for n, _ in calls.times.values())
    out = {"ops_per_token": ops, "ops_per_layer": round(ops / layers, 1), "aten_ops_per_token": c.n,
           "by_op": {k: v[0] for k, v in sorted(calls.times.items(), key=lambda kv: -kv[1][0])}}
    if device.startswith("cuda"):
        from torch.profiler import ProfilerActivity, profile

        def kernels(fn) -> int:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            return sum(1 for e in prof.events() if e.device_type.name == "CUDA")

        out["cuda_kernels_per_token"] = kernels(lambda: sess.decode(5))
        comp = fuselm.load(model, backend="torch", device=device, compile=True).session
        comp.reset(16)
        comp.prefill(_ids(4))
        for _ in range(4):
            comp.decode(5)
        graph = getattr(getattr(comp.compiled, "fn", None), "inner", None)
        if graph is not None and hasattr(graph, "static"):  # the compiled step inside the CUDA graph
            out["cuda_kernels_per_token_compiled"] = kernels(lambda: graph.fn(*graph.static))
            out["compiled"] = comp.compiled.what
            out["kernel_time_compiled"] = kernel_times(lambda: graph.fn(*graph.static))
            out["kernel_time_compiled"]["graph_replay_us"] = replay_time(graph.graph)
    return out


def kernel_times(fn, reps: int = 5) -> dict:
    """GPU time per token of the captured decode step, by kernel (what the bandwidth is spent on)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    by: dict[str, list] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            k = by.setdefault(e.name[:70], [0, 0.0])
            k[0] += 1
            k[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    total = sum(v[1] for v in by.values()) / reps
    top = sorted(by.items(), key=lambda kv: -kv[1][1])[:15]
    return {"gpu_us_per_token": round(total, 1), "kernels_per_token": sum(v[0] for v in by.values()) // reps,
            "top": [[name, n // reps, round(t / reps, 1)] for name, (n, t) in top]}


def replay_time(graph, reps: int = 50) -> float:
    """Wall time of one CUDA-graph replay of the decode step, in microseconds (median of `reps`)."""
    import torch

    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1e6, 1)


def copy_bandwidth(device: str) -> float:
    """Device-to-device copy rate in GB/s (bytes read + written)."""
    import torch

    a = torch.empty(1 << 28, dtype=torch.float32, device=device)  # 1 GiB
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 4 * 10 / (time.perf_counter() - t) / 1e9


def weight_bytes_per_token(model: Path) -> int:
    """Bytes of weights a decode step reads: every initializer except the embedding table (one row)."""
    import numpy as np
    import onnx

    m = onnx.load(str(model / "model.onnx"), load_external_data=False)
    total = 0
    for t in m.graph.initializer:
        n = int(np.prod(t.dims)) if t.dims else 1
        bits = {onnx.TensorProto.UINT4: 4, onnx.TensorProto.INT4: 4}.get(t.data_type)
        size = n * bits // 8 if bits else n * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        if "embed_tokens" not in t.name:
            total += size
    return total


# --- orchestration ----------------------------------------------------------------------------
def child(args) -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    model, ckpt = Path(args.model), Path(args.ckpt)
    engine = args.child
    if engine == "fuselm":
        r = run_fuselm(model, args.device, args.runs, not args.no_compile, args.threads)
    elif engine.startswith("ort"):
        r = run_ort(model, args.runs, 1 if engine == "ort-acc1" else None, args.threads)
    elif engine.startswith("hf"):
        _, dtype, cache = engine.split("-")
        r = run_hf(ckpt, args.device, args.runs, {"bf16": "bfloat16", "f32": "float32"}[dtype], cache, args.threads)
    elif engine == "dispatches":
        r = count_dispatches(model, args.device)
    elif engine == "bandwidth":
        r = {"copy_gb_s": copy_bandwidth(args.device)}
    else:
        raise SystemExit(f"unknown engine {engine}")
    print("RESULT " + json.dumps(r), flush=True)


def spawn(engine: str, model: Path, ckpt: Path, args, eager: bool = False, env: dict | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", engine, "--model", str(model), "--ckpt", str(ckpt),
           "--device", args.device, "--runs", str(args.runs)]
    if args.no_compile or eager:
        cmd.append("--no-compile")
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"engine": engine, "error": " | ".join(tail)[:500]}
    r = json.loads(line[len("RESULT "):])
    r.update(engine=engine, wall_s=round(time.perf_counter() - t0, 1), load_before=round(load, 1))
    return r


def prepare(shape: str, work: Path, quants: list[str]) -> tuple[Path, dict[str, Path]]:
    ckpt = work / f"qwen3-{shape}-hf"
    subprocess.run([sys.executable, str(HERE / "convert.py"), "--shapes", shape, "--make-checkpoint", str(ckpt)],
                   check=True, stdout=subprocess.DEVNULL)
    models = {}
    for quant in quants:
        exp, opt = work / f"qwen3-{shape}-{quant}-exported", work / f"qwen3-{shape}-{quant}-optimized"
        if not (exp / "fuselm.json").is_file():
            subprocess.run([sys.executable, "-m", "fuselm.cli", "convert", str(ckpt), "-o", str(exp), "--quant", quant,
                            "--force", "--quiet"], check=True)
        if not (opt / "fuselm.json").is_file():
            subprocess.run([sys.executable, "-m", "fuselm.cli", "optimize", str(exp), "-o", str(opt), "--force",
                            "--quiet"], check=True)
        models[quant] = exp, opt
    return ckpt, models


def _enough_memory(ckpt: Path, dtype: str, device: str) -> bool:
    import psutil

    if device != "cpu":
        return True
    params = json.loads((ckpt / "model.safetensors.index.json").read_text())["metadata"]["total_size"] / 2
    need = params * (4 if dtype == "f32" else 2) * 1.3
    return psutil.virtual_memory().available > need


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=["0.6b", "4b"], choices=["0.6b", "4b"])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "fuselm-bench-runtime")
    ap.add_argument("--engines", nargs="*", default=None, help="subset of the engines to run")
    ap.add_argument("--no-compile", action="store_true", help="fuselm eager (default: compiled decode step)")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for every engine (fuselm, onnxruntime intra-op, torch for HF); default: each one's own")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0
    cuda = args.device.startswith("cuda")
    engines = args.engines or (["fuselm", "hf-bf16-dynamic", "hf-bf16-static", "dispatches"] if cuda
                               else ["fuselm", "fuselm-eager", "ort", "hf-bf16-dynamic", "hf-f32-dynamic", "dispatches"])
    rows, kernels, extra = [], {}, {}
    if cuda:
        extra["copy_gb_s"] = spawn("bandwidth", Path("."), Path("."), args).get("copy_gb_s")
    for shape in args.shapes:
        t0 = time.perf_counter()
        ckpt, models = prepare(shape, args.work, ["q4", "f16"] if "fuselm-f16" in engines else ["q4"])
        print(f"[{shape}] models ready in {time.perf_counter() - t0:.0f} s", flush=True)
        for engine in engines:
            if engine == "dispatches":
                kernels[shape] = {stage: spawn("dispatches", models["q4"][i], ckpt, args)
                                  for i, stage in enumerate(("exported", "optimized"))}
                print(f"[{shape}] dispatches {kernels[shape]}", flush=True)
                continue
            if engine.startswith("hf") and not _enough_memory(ckpt, engine.split("-")[1], args.device):
                rows.append({"shape": shape, "engine": engine, "error": "skipped: not enough free memory"})
                continue
            quant = "f16" if engine == "fuselm-f16" else "q4"
            name = "fuselm" if engine.startswith("fuselm") else engine
            # fuselm-tinygemm: CUDA 4-bit through torch's tinygemm instead of fuselm's Triton GEMV (A/B)
            r = spawn(name, models[quant][1], ckpt, args, eager=engine == "fuselm-eager",
                      env={"FUSELM_CUDA_QMATMUL": "tinygemm"} if engine == "fuselm-tinygemm" else None)
            r.update(shape=shape, engine=engine, graph=f"{quant} optimized" if not engine.startswith("hf") else "HF checkpoint")
            if cuda and "decode_tok_s" in r and engine.startswith("fuselm"):
                bpt = weight_bytes_per_token(models[quant][1])
                r["weight_gb_per_token"] = round(bpt / 1e9, 3)
                r["achieved_gb_s"] = round(bpt * r["decode_tok_s"] / 1e9, 1)
                if extra.get("copy_gb_s"):
                    r["share_of_copy_bw"] = round(r["achieved_gb_s"] / extra["copy_gb_s"], 3)
            rows.append(r)
            print(f"[{shape}] {engine}: " + json.dumps({k: v for k, v in r.items() if not k.endswith("_runs")}), flush=True)
    summary = _report(rows, kernels, extra, cuda)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"runtime-{'cuda' if cuda else 'cpu'}.json"
    out.write_text(json.dumps({"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                           "python": platform.python_version()},
                               "protocol": {"prompt": PROMPT, "decode_tokens": DECODE, "prefill_tokens": PREFILL,
                                            "runs": args.runs},
                               "rows": rows, "dispatches": kernels, "summary": summary, **extra}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def _report(rows, kernels, extra, cuda) -> dict:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"decode and prefill, tokens/s ({'GPU' if cuda else 'CPU'}; medians)")
    for col in ("shape", "engine", "graph", "decode tok/s", "prefill tok/s", "load s", "notes"):
        table.add_column(col)
    summary = {}
    for r in rows:
        if "error" in r:
            table.add_row(r["shape"], r["engine"], "", "", "", "", r["error"][:80])
            continue
        notes = r.get("what", "")
        if "achieved_gb_s" in r:
            notes += f" · {r['achieved_gb_s']} GB/s"
        table.add_row(r["shape"], r["engine"], r.get("graph", ""), f"{r['decode_tok_s']:.1f}",
                      f"{r['prefill_tok_s']:.1f}", f"{r['load_s']:.1f}", notes[:90])
    console.print(table)
    for shape in {r["shape"] for r in rows}:
        by = {r["engine"]: r for r in rows if r["shape"] == shape and "error" not in r}
        ours = by.get("fuselm")
        if not ours:
            continue
        for other in by:
            if other != "fuselm":
                summary[f"{shape} decode fuselm/{other}"] = round(ours["decode_tok_s"] / by[other]["decode_tok_s"], 2)
                summary[f"{shape} prefill fuselm/{other}"] = round(ours["prefill_tok_s"] / by[other]["prefill_tok_s"], 2)
    for shape, stages in kernels.items():
        for stage, k in stages.items():
            if "ops_per_token" in k:
                summary[f"{shape} {stage} ops/token"] = k["ops_per_token"]
                summary[f"{shape} {stage} ops/layer"] = k["ops_per_layer"]
                summary[f"{shape} {stage} aten ops/token"] = k["aten_ops_per_token"]
                if "cuda_kernels_per_token" in k:
                    summary[f"{shape} {stage} CUDA kernels/token (eager)"] = k["cuda_kernels_per_token"]
                if "cuda_kernels_per_token_compiled" in k:
                    summary[f"{shape} {stage} CUDA kernels/token (compiled)"] = k["cuda_kernels_per_token_compiled"]
    for k, v in sorted(summary.items()):
        console.print(f"  {k}: {v}")
    return summary


if __name__ == "__main__":
    sys.exit(main())
