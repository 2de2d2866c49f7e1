"""Quality on text (`fuselm eval`): perplexity, KL divergence from a reference's next-token distribution and
top-1 agreement with it, teacher-forced over consecutive windows of a text (fuselm/text.py: 512 tokens,
the bundled public-domain chapter unless a file is given).

In each window the logits at position t predict token t+1: perplexity is exp of the mean negative
log-likelihood over every predicted token; KL(reference || model) and top-1 agreement are taken per position
(mean and 99th percentile of the KL). The engine is reached through one function, `scorer_for`, whose object
scores one window; the reference is HF transformers in float32 (fuselm/reference.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from fuselm import text as text_mod
from fuselm.errors import FuselmError

BACKENDS = ("onnxruntime", "torch", "mlx")  # onnxruntime: the standard graph as written, f32 activations


class _OrtScorer:
    """onnxruntime on the graph as written (its graph optimizations off, f32 activations)."""

    def __init__(self, model_dir):
        from fuselm.reference import OrtRunner

        self.runner = OrtRunner(model_dir)

    def score(self, ids) -> np.ndarray:
        from fuselm.reference import ort_scores

        return ort_scores(self.runner, ids)


def scorer_for(model_dir, backend: str = "onnxruntime"):
    """The engine that scores `model_dir`: an object with `score(ids) -> np.ndarray [n, vocab]`, the
    teacher-forced logits at every position of one window."""
    if backend not in BACKENDS:
        raise FuselmError(f"--backend {backend!r} cannot score a text; choose one of {', '.join(BACKENDS)}")
    if backend == "onnxruntime":
        return _OrtScorer(model_dir)
    import fuselm

    return fuselm.load(model_dir, backend=backend, compile=False)  # runtime_metal's engine: Engine.score


class Reference:
    """HF transformers (float32, CPU) on a checkpoint; scores of a window are kept, so several models
    measured in one process against the same text run the reference once."""

    def __init__(self, hf_dir):
        from fuselm.reference import hf_model

        self.dir = Path(hf_dir)
        self.model = hf_model(hf_dir)
        self._kept: dict[bytes, np.ndarray] = {}

    def score(self, ids) -> np.ndarray:
        from fuselm.reference import hf_scores

        key = np.asarray(ids, np.int64).tobytes()
        if key not in self._kept:
            self._kept[key] = _log_softmax(hf_scores(self.model, ids))
        return self._kept[key]


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


class Metrics:
    """Per-position figures accumulated window by window."""

    def __init__(self):
        self.nll, self.ref_nll, self.kl, self.top1 = [], [], [], []

    def add(self, ids, logits: np.ndarray, ref_logp: np.ndarray | None = None) -> None:
        ids = np.asarray(ids, np.int64)
        logp = _log_softmax(logits)[:-1]
        targets = ids[1:]
        rows = np.arange(len(targets))
        self.nll.append(-logp[rows, targets])
        if ref_logp is not None:
            ref = ref_logp[:-1]
            self.ref_nll.append(-ref[rows, targets])
            self.kl.append((np.exp(ref) * (ref - logp)).sum(-1))
            self.top1.append(ref.argmax(-1) == logp.argmax(-1))

    def summary(self) -> dict:
        nll = np.concatenate(self.nll)
        out = {"positions": int(nll.size), "perplexity": float(np.exp(nll.mean()))}
        if self.kl:
            kl = np.concatenate(self.kl)
            ref_ppl = float(np.exp(np.concatenate(self.ref_nll).mean()))
            out.update(reference_perplexity=ref_ppl, perplexity_change=out["perplexity"] / ref_ppl - 1,
                       kl_mean=float(kl.mean()), kl_p99=float(np.percentile(kl, 99)),
                       top1_agreement=float(np.concatenate(self.top1).mean()))
        return out


def weight_bytes(model_dir) -> int:
    """Bytes of the model's stored tensors (quantized data, scales, zero points, norms; the data file's
    alignment padding left out): each external tensor's recorded length plus the tensors inside model.onnx."""
    import onnx

    from fuselm import contract

    model = onnx.load(str(Path(model_dir) / contract.MODEL_NAME), load_external_data=False)
    total = 0
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            total += int(next(e.value for e in t.external_data if e.key == "length"))
        else:
            total += len(onnx.numpy_helper.to_array(t).tobytes())
    return total


def evaluate(model_dir, reference=None, text=None, backend: str = "onnxruntime", window: int = text_mod.WINDOW,
             max_tokens: int | None = None, json_path=None, quiet: bool = False) -> dict:
    """Score the model directory `model_dir` on a text; returns (and with `json_path` writes) the record.

    reference: an HF checkpoint directory (or a `Reference`) for KL and top-1; without it, perplexity only."""
    from fuselm.modeldir import read_meta
    from fuselm.tokenizer import load_tokenizer

    model_dir = Path(model_dir)
    meta = read_meta(model_dir)
    if window < 2:
        raise FuselmError(f"--window {window} is too short; pass 2 or more tokens (default {text_mod.WINDOW})")
    body, source = text_mod.read_text(text)
    tok = load_tokenizer(model_dir, required=True)
    pieces = text_mod.windows(tok.encode(body), window, max_tokens)
    scorer = scorer_for(model_dir, backend)
    ref = Reference(reference) if reference is not None and not isinstance(reference, Reference) else reference
    metrics, t0 = Metrics(), time.perf_counter()
    for ids in pieces:
        metrics.add(ids, scorer.score(ids.tolist()), ref.score(ids) if ref is not None else None)
    record = {"model": str(model_dir), "backend": backend, "reference": str(ref.dir) if ref is not None else None,
              "text": source, "window": int(len(pieces[0])), "windows": len(pieces), **metrics.summary(),
              "weight_bytes": weight_bytes(model_dir), "quantization": meta.get("quantization"),
              "seconds": round(time.perf_counter() - t0, 2)}
    if json_path:
        Path(json_path).write_text(json.dumps(record, indent=2) + "\n")
    if not quiet:
        print(describe(record))
    return record


def describe(record: dict) -> str:
    """One line per figure, for the terminal."""
    lines = [f"fuselm eval: {record['model']} on {record['backend']}, {record['text']}: {record['windows']} windows of "
             f"{record['window']} tokens ({record['positions']} predicted tokens)",
             f"  perplexity {record['perplexity']:.4f}"]
    if record.get("reference"):
        lines[-1] += (f" (reference {record['reference_perplexity']:.4f}, "
                      f"{100 * record['perplexity_change']:+.2f} %)")
        lines.append(f"  KL divergence from the reference: mean {record['kl_mean']:.5f}, p99 {record['kl_p99']:.5f} nats")
        lines.append(f"  top-1 agreement with the reference: {100 * record['top1_agreement']:.2f} %")
    lines.append(f"  weight bytes {record['weight_bytes']:,}")
    return "\n".join(lines)
