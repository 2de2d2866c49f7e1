"""lm_head and embedding formats of a q4 export: what each costs in drift and buys in speed and memory.

    python bench/head_formats.py                  # Qwen3-0.6B shape
    python bench/head_formats.py --tiny           # seconds

One random-weight checkpoint (bench/convert.py --make-checkpoint), converted with 4-bit linears and
each (--lm-head, --embed) pair below; f32 is the reference. Each model runs in its own child
process (fuselm torch CPU, 2 threads): greedy decode after a 128-token prompt. Reported per format:
- drift: max |logits - f32 logits| over the prompt's last position and the decode steps (all fed
  the f32 model's tokens, so the steps compare the same inputs), as a share of max |f32 logits|;
  the same against the 8-bit head (`q4` linears, `q8` head, `f16` embedding: the old default), and
  how many greedy tokens agree with the f32 model's,
- decode tok/s (median step), the model's size on disk and the child's peak RSS,
- the head alone (`head_error`): the tied table quantized as each format, logits of 64 unit-RMS
  hidden states against f64 math on the bf16 table (max error as a share of max |logit|, top-1
  agreement). On random weights a whole model's drift is mostly its q4 linears' noise grown over
  the layers, so this isolates what the head's format adds.
Writes bench/results/head-formats.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
# (name, lm_head, embed): tied checkpoints, so head == embed means one stored tensor
FORMATS = [("q8 head, f16 embedding (old default)", "q8", "f16"),
           ("q8 head + q8 embedding, one tensor", "q8", "q8"),
           ("q4 head + q4 embedding, one tensor", "q4", "q4"),
           ("q4 head, f16 embedding", "q4", "f16")]
PROMPT, STEPS = 128, 32


def _convert_module():
    spec = importlib.util.spec_from_file_location("bench_convert", HERE / "convert.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def child(model: Path, tokens_path: Path, threads: int, prompt: int) -> None:
    """Run the f32 model's tokens through `model`: logits at every step, decode step times."""
    import numpy as np

    import fuselm

    tokens = json.loads(tokens_path.read_text()) if tokens_path.is_file() else None
    sess = fuselm.load(model, backend="torch", device="cpu", threads=threads).session
    vocab = sess.meta["dims"]["vocab"]
    ids = [int(i) for i in np.random.default_rng(0).integers(10, min(vocab, 50000), prompt)]
    sess.reset(prompt + STEPS + 1)
    logits = [sess.logits_to_numpy(sess.prefill(ids))]
    greedy, times = [int(np.argmax(logits[0]))], []
    for i in range(STEPS):
        feed = tokens[i] if tokens else greedy[-1]  # teacher-forced on the f32 model's tokens
        t = time.perf_counter()
        out = sess.logits_to_numpy(sess.decode(feed))
        times.append(time.perf_counter() - t)
        logits.append(out)
        greedy.append(int(np.argmax(out)))
    np.save(model / "bench-logits.npy", np.stack(logits))
    print("RESULT " + json.dumps({"tokens": greedy, "decode_tok_s": round(1 / statistics.median(times[2:]), 2),
                                  "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                                  "what": sess.describe()}), flush=True)


def head_error(ckpt: Path, rows: int = 64) -> dict:
    """The tied table [vocab, hidden] as each head format (blocks of 32 along hidden, the export's
    quantization) against f64 math: max |error| / max |logit| and top-1 agreement."""
    import numpy as np
    import torch
    from fuselm.exporter.quant import dequantize, quantize
    from safetensors import safe_open

    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.embed_tokens.weight"
    with safe_open(str(ckpt / index[name]), "pt") as f:
        table = f.get_tensor(name).to(torch.float32).numpy()
    x = np.random.default_rng(1).standard_normal((rows, table.shape[1]))
    x /= np.sqrt((x**2).mean(axis=1, keepdims=True))
    ref = x @ table.astype(np.float64).T
    out = {}
    for fmt in ("f16", "q8", "q4"):
        if fmt == "f16":
            w = table.astype(np.float16).astype(np.float64)
        else:
            q, sc, zp = quantize(table, {"q8": 8, "q4": 4}[fmt], 32, axis=1)
            w = dequantize(q, sc, zp, 32, axis=1).astype(np.float64)
        got = x @ w.T
        out[fmt] = {"max_err_share": round(float(np.abs(got - ref).max() / np.abs(ref).max()), 5),
                    "top1_agree": f"{int((got.argmax(1) == ref.argmax(1)).sum())}/{rows}"}
    return out


def spawn(model: Path, tokens: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--child", str(model), "--tokens-file", str(tokens), "--threads",
           str(args.threads), "--prompt", str(args.prompt)]
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"{model}: {(proc.stderr or proc.stdout).strip().splitlines()[-3:]}")
    return {**json.loads(line[7:]), "load_before": round(load, 2)}


def main(argv=None) -> int:
    import numpy as np

    import fuselm

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="0.6b", choices=["0.6b", "4b"])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=PROMPT)
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "fuselm-bench-heads")
    ap.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tokens-file", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.tokens_file, args.threads, args.prompt)
        return 0
    shape = "tiny" if args.tiny else args.shape
    work = args.work / shape
    ckpt = _convert_module().write_checkpoint(work / "hf", shape)
    ref_dir = work / "f32"
    if not (ref_dir / "fuselm.json").is_file():
        fuselm.convert(ckpt, ref_dir, quant="f32", force=True, quiet=True)
    heads = head_error(ckpt)
    print("head alone:", json.dumps(heads), flush=True)
    tokens = work / "f32-tokens.json"
    tokens.unlink(missing_ok=True)
    ref = spawn(ref_dir, tokens, args)
    tokens.write_text(json.dumps(ref["tokens"]))
    ref_logits = np.load(ref_dir / "bench-logits.npy").astype(np.float64)
    scale = float(np.abs(ref_logits).max())
    rows, base = [], None
    for name, head, embed in FORMATS:
        out = work / f"q4-head{head}-embed{embed}"
        if not (out / "fuselm.json").is_file():
            fuselm.convert(ckpt, out, quant="q4", lm_head=head, embed=embed, force=True, quiet=True)
        r = spawn(out, tokens, args)
        logits = np.load(out / "bench-logits.npy").astype(np.float64)
        base = logits if base is None else base
        r.update(format=name, lm_head=head, embed=embed,
                 drift_vs_f32=round(float(np.abs(logits - ref_logits).max()) / scale, 5),
                 drift_vs_q8_head=round(float(np.abs(logits - base).max()) / scale, 5),
                 greedy_agree_f32=f"{sum(a == b for a, b in zip(r['tokens'], ref['tokens'], strict=True))}/{len(ref['tokens'])}",
                 model_mb=round(sum(p.stat().st_size for p in out.iterdir() if p.is_file()) / 2**20, 1))
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "tokens"}), flush=True)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"q4 linears, lm_head / embedding formats ({shape}; drift as a share of max |f32 logit|)")
    for col in ("format", "drift vs f32", "vs q8 head", "greedy = f32", "decode tok/s", "model MB", "peak RSS MB", "load"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["format"], f"{r['drift_vs_f32']:.4f}", f"{r['drift_vs_q8_head']:.4f}", r["greedy_agree_f32"],
                      f"{r['decode_tok_s']:.1f}", f"{r['model_mb']:.0f}", f"{r['peak_rss_mb']:.0f}", f"{r['load_before']:.1f}")
    Console().print(table)
    path = HERE / "results" / ("head-formats-tiny.json" if args.tiny else "head-formats.json")
    path.write_text(json.dumps({"shape": shape, "prompt": args.prompt, "steps": STEPS, "threads": args.threads,
                                "f32": {k: v for k, v in ref.items() if k != "tokens"}, "head_error": heads, "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
