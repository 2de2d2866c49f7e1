"""KV cache formats side by side: f32, f16 and int8 caches (fuselm --kv-bits) at 2k / 8k / 32k context.

    python bench/kv_cache.py                          # demo model + Qwen3-0.6B shape, all contexts
    python bench/kv_cache.py --models demo --contexts 2048,8192
    python bench/kv_cache.py --models 4b --contexts 32768 --formats int8 --fill synthetic

Per model, format and context, one child process (ru_maxrss through os.wait4 is its peak RSS):
- cache bytes (the preallocated arrays, scales and biases included) and the process RSS after load;
- fill: `prefill` runs the real chunked prefill of `context` random prompt ids (prefill tok/s; its
  attention is blockwise past 32 MiB of scores, attention_blocks.py); `synthetic` writes random
  N(0, 1) keys/values through the cache's own quantizer instead (decode cost does not depend on the
  values; used where a CPU prefill of the context would take many minutes);
- decode tok/s: median over `--decode` steps at that context (after two warm-up steps).
Quality (`--quality`): 256 greedy tokens with the f16 cache; the int8 cache teacher-forced on the same
tokens: greedy agreement (share of steps with the same argmax, and the free-running common prefix)
and the max logit drift, absolute and relative to the largest |logit|.
Writes bench/results/kv-cache.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _child import run_child  # noqa: E402 - bench/ is no package: its helpers sit beside each script

HERE = Path(__file__).parent
RESULTS = HERE / "results"
FORMATS = {"f32": 32, "f16": 16, "int8": 8}
DEMO = dict(train_steps=150, hidden_size=96, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2)  # examples/demo.py's checkpoint


def prepare(name: str, work: Path) -> Path:
    """The optimized q4 model dir of `name` (demo, 0.6b, 4b), built once under `work`."""
    import fuselm

    opt = work / f"{name}-q4-optimized"
    if (opt / "fuselm.json").is_file():
        return opt
    if name == "demo":
        from fuselm.synth import make_checkpoint

        hf = work / "demo-hf"
        if not (hf / "config.json").is_file():
            make_checkpoint(hf, "qwen3", **DEMO)
    else:
        hf = work / f"qwen3-{name}-hf"
        subprocess.run([sys.executable, str(HERE / "convert.py"), "--shapes", name, "--make-checkpoint", str(hf)],
                       check=True, stdout=subprocess.DEVNULL)
    exp = work / f"{name}-q4-exported"
    if not (exp / "fuselm.json").is_file():
        fuselm.convert(hf, exp, quant="q4", quiet=True, force=True)
    fuselm.optimize(exp, opt, quiet=True, force=True)
    return opt


# --- children ----------------------------------------------------------------------------------
def _session(model: str, fmt: str, threads: int | None):
    import fuselm

    return fuselm.load(model, backend="torch", device="cpu", kv_bits=FORMATS[fmt], threads=threads).session


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def child_context(args) -> dict:
    """Cache bytes, memory, prefill and decode speed of one format at one context."""
    import numpy as np
    import torch
    from fuselm.runtime_metal import kvcache

    sess = _session(args.model, args.format, args.threads)
    rss_load = _rss_mb()
    ctx = args.context
    sess.reset(ctx + args.decode + 3)
    cache_bytes = sum(kvcache.nbytes(sess.backend, v) for v in sess.buffers.values())
    vocab = int(sess.meta["dims"]["vocab"])
    rng = np.random.default_rng(0)
    prefill_s = None
    if args.fill == "prefill":
        ids = [int(i) for i in rng.integers(3, vocab, ctx)]
        t0 = time.perf_counter()
        logits = sess.logits_to_numpy(sess.prefill(ids))
        prefill_s = time.perf_counter() - t0
    else:  # random keys/values through the cache's own write path, chunk by chunk
        g = torch.Generator().manual_seed(0)
        for c in sess.caches:
            for t0 in range(0, ctx, 4096):
                n = min(4096, ctx - t0)
                view = kvcache.CacheView(sess.buffers[c.name], t0, n, head_dim=c.head_dim)
                view.append(sess.backend, torch.randn((1, c.heads, n, c.head_dim), generator=g))
                sess.buffers[c.name] = view.buffer
        sess.pos = ctx
        logits = np.zeros(vocab, np.float32)
    rss_filled = _rss_mb()
    token, times = int(np.argmax(logits)), []
    for _ in range(args.decode + 2):
        t = time.perf_counter()
        logits = sess.logits_to_numpy(sess.decode(token))
        times.append(time.perf_counter() - t)
        token = int(np.argmax(logits))
    return {"cache_bytes": cache_bytes, "rss_after_load_mb": round(rss_load, 1),
            "rss_after_fill_mb": round(rss_filled, 1),
            "prefill_tok_s": round(ctx / prefill_s, 1) if prefill_s else None,
            "prefill_s": round(prefill_s, 1) if prefill_s else None,
            "decode_tok_s": round(1 / float(np.median(times[2:])), 2), "decode_steps": len(times) - 2,
            "static_decode": sess.static_decode, "describe": sess.describe()}


def child_attention(args) -> dict:
    """One decode token's attention in one layer of a Qwen3 shape at `context`, cache in `format`:
    the runtime's own code (the torch backend's sdpa for f32, attention_blocks for f16/int8), median of runs."""
    import numpy as np
    import torch
    from fuselm.runtime_metal import attention_blocks, kvcache
    from fuselm.runtime_metal.backends import make_backend

    torch.set_num_threads(args.threads or torch.get_num_threads())
    b = make_backend("torch", "cpu")
    hq, hkv, d, t = 16, 8, 128, args.context  # Qwen3-0.6B (and 4B: 32 query heads share the same 8 kv heads)
    g = torch.Generator().manual_seed(0)
    q = torch.randn((1, hq, 1, d), generator=g)
    kv = []
    for _ in range(2):
        x = torch.randn((1, hkv, t, d), generator=g)
        fmt = kvcache.KVFormat(FORMATS[args.format])
        view = kvcache.CacheView(kvcache.make_cache(b, (1, hkv, t, d), 1, fmt), 0, t, head_dim=d)
        kv.append(view.append(b, x, stored_ok=True))
        del x
    mask = torch.zeros((1, 1, 1, t))
    scale = d ** -0.5

    def step():
        if isinstance(kv[0], kvcache.StoredKV):
            return attention_blocks.attention(b, q, kv[0], kv[1], mask, scale)
        return b.sdpa(q, kv[0], kv[1], mask, scale)

    times = []
    for _ in range(args.decode + 2):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"ms_per_layer": round(1e3 * float(np.median(times[2:])), 2), "runs": len(times) - 2}


def child_quality(args) -> dict:
    """f16-cache greedy run, then each other format teacher-forced on its tokens."""
    import numpy as np

    prompt = [int(i) for i in np.random.default_rng(1).integers(3, 300, 32)] if args.prompt_ids is None \
        else args.prompt_ids
    n = args.tokens

    def run(fmt, forced=None):
        sess = _session(args.model, fmt, args.threads)
        sess.reset(len(prompt) + n + 1)
        logits = [sess.logits_to_numpy(sess.prefill(prompt))]
        tokens = [int(logits[-1].argmax())]
        for i in range(n - 1):
            tok = tokens[-1] if forced is None else forced[i]
            logits.append(sess.logits_to_numpy(sess.decode(tok)))
            tokens.append(int(logits[-1].argmax()))
        return np.stack(logits), tokens

    ref_logits, ref_tokens = run("f16")
    out = {"prompt_tokens": len(prompt), "tokens": n}
    for fmt in args.against:
        free_logits, free_tokens = run(fmt)
        logits, tokens = run(fmt, forced=ref_tokens)
        drift = float(np.abs(logits - ref_logits).max())
        prefix = next((i for i, (a, b) in enumerate(zip(free_tokens, ref_tokens, strict=True)) if a != b), n)
        out[fmt] = {"agreement_teacher_forced": round(float(np.mean(np.array(tokens) == np.array(ref_tokens))), 4),
                    "free_running_common_prefix": prefix,
                    "max_logit_drift": round(drift, 5),
                    "max_logit_drift_rel": round(drift / float(np.abs(ref_logits).max()), 6)}
    return out


def measure(kind: str, model: Path, extra: list[str]) -> dict:
    """One child: its RESULT line plus its peak RSS and wall time (bench/_child.py)."""
    c = run_child([sys.executable, __file__, "--child", kind, "--model", str(model), *extra], merge=True)
    line = next((ln for ln in c.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if c.returncode != 0 or line is None:
        return {"error": c.tail()}
    r = json.loads(line[len("RESULT "):])
    r.update(peak_rss_mb=c.peak_rss_mb, wall_s=round(c.wall_s, 1), load_before=round(c.load_before, 1))
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="demo,0.6b")
    ap.add_argument("--attention-only", action="store_true",
                    help="only one decode token's attention, one Qwen3-0.6B-shaped layer, per format and context")
    ap.add_argument("--contexts", default="2048,8192,32768")
    ap.add_argument("--formats", default="f32,f16,int8")
    ap.add_argument("--fill", choices=["auto", "prefill", "synthetic"], default="auto",
                    help="auto: real prefill for the demo model and at 2k, synthetic otherwise")
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--quality", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--workdir", default="/tmp/fuselm-bench-kv")
    ap.add_argument("--out", default=str(RESULTS / "kv-cache.json"))
    # child mode
    ap.add_argument("--child", choices=["context", "quality", "attention"])
    ap.add_argument("--model")
    ap.add_argument("--format", choices=sorted(FORMATS))
    ap.add_argument("--context", type=int)
    ap.add_argument("--against", nargs="*", default=["int8"])
    ap.add_argument("--prompt-ids", type=lambda s: [int(x) for x in s.split(",")], default=None)
    args = ap.parse_args(argv)
    if args.child:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        r = {"context": child_context, "quality": child_quality, "attention": child_attention}[args.child](args)
        print("RESULT " + json.dumps(r), flush=True)
        return 0

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    threads = ["--threads", str(args.threads)] if args.threads else []
    results = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                           "python": platform.python_version()}, "models": {}}
    out_path = Path(args.out)
    if out_path.is_file():  # keep earlier models' rows (a run per model on a busy box)
        old = json.loads(out_path.read_text())
        results["models"], results["attention_0.6b_layer"] = old.get("models", {}), old.get("attention_0.6b_layer", {})
    if args.attention_only:
        for ctx in args.contexts.split(","):
            row = results.setdefault("attention_0.6b_layer", {}).setdefault(ctx, {})
            for fmt in args.formats.split(","):
                row[fmt] = measure("attention", Path("-"), ["--format", fmt, "--context", ctx,
                                                            "--decode", str(args.decode), *threads])
                print(f"attention ctx {ctx} {fmt}: {json.dumps(row[fmt])}", flush=True)
            if row.get("int8", {}).get("ms_per_layer") and row.get("f16", {}).get("ms_per_layer"):
                row["int8"]["speed_vs_f16"] = round(row["f16"]["ms_per_layer"] / row["int8"]["ms_per_layer"], 3)
            out_path.write_text(json.dumps(results, indent=2))
        return 0
    for name in args.models.split(","):
        model = prepare(name, work)
        rows = results["models"].setdefault(name, {"contexts": {}})
        rows["model_dir"] = str(model)
        for ctx in (int(c) for c in args.contexts.split(",")):
            fill = args.fill if args.fill != "auto" else ("prefill" if name == "demo" or ctx <= 2048 else "synthetic")
            for fmt in args.formats.split(","):
                r = measure("context", model, ["--format", fmt, "--context", str(ctx), "--fill", fill,
                                               "--decode", str(args.decode), *threads])
                r["fill"] = fill
                rows["contexts"].setdefault(str(ctx), {})[fmt] = r
                print(f"{name} ctx {ctx} {fmt}: {json.dumps(r)}", flush=True)
            _ratios(rows["contexts"][str(ctx)])
            out_path.write_text(json.dumps(results, indent=2))
        if args.quality:
            q = measure("quality", model, ["--tokens", str(args.tokens), "--against", "int8", *threads])
            rows["quality_vs_f16"] = q
            print(f"{name} quality: {json.dumps(q)}", flush=True)
        out_path.write_text(json.dumps(results, indent=2))
    print(f"wrote {out_path}")
    return 0


def _ratios(row: dict) -> None:
    """int8 against f32 and f16: cache bytes and decode speed."""
    q8 = row.get("int8", {})
    for base in ("f32", "f16"):
        b = row.get(base, {})
        if "cache_bytes" in q8 and "cache_bytes" in b:
            q8[f"cache_bytes_vs_{base}"] = round(q8["cache_bytes"] / b["cache_bytes"], 4)
        if q8.get("decode_tok_s") and b.get("decode_tok_s"):
            q8[f"decode_speed_vs_{base}"] = round(q8["decode_tok_s"] / b["decode_tok_s"], 3)


if __name__ == "__main__":
    sys.exit(main())
