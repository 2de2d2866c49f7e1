"""Quality on text (`fuselm eval`): perplexity, KL divergence from a reference's next-token distribution and
top-1 agreement with it, teacher-forced over consecutive windows of a text (fuselm/text.py: 512 tokens,
the bundled public-domain chapter unless a file is given).

In each window the logits at position t predict token t+1: perplexity is exp of the mean negative
log-likelihood over every predicted token; KL(reference || model) and top-1 agreement are taken per position
(mean and 99th percentile of the KL). The model is scored by the engine `fuselm.load` gives it (what `fuselm run`
runs: `Engine.score`), or with backend "onnxruntime" by the graph as written in plain onnxruntime (its
optimizations off, f32 activations: the standard graph's own numbers); the reference is HF transformers in float32
(fuselm/reference.py).
"""

from __future__ import annotations

import time
from pathlib import Path

from fuselm import text as text_mod
from fuselm.errors import FuselmError
from fuselm.options import Options
from fuselm.reference import Metrics, OrtScorer, Reference


def scorer_for(model_dir, options: Options):
    """What scores `model_dir`: an object with `score(ids) -> np.ndarray [n, vocab]` (the teacher-forced logits at
    every position of one window) and `describe()`."""
    if options.backend == "onnxruntime":
        return OrtScorer(model_dir)
    from .engines import load

    return load(model_dir, options)


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


def evaluate(model, reference=None, options: Options | None = None, text=None, window: int = text_mod.WINDOW,
             max_tokens: int | None = None, quiet: bool = False, **keywords) -> dict:
    """Score the model directory `model` on a text (the bundled one unless `text` names a file; its first
    `max_tokens` tokens when given) in windows of `window` tokens; returns the record.

    reference: an HF checkpoint directory (or a `Reference`) for KL and top-1; without it, perplexity only."""
    from fuselm.modeldir import read_meta
    from fuselm.tokenizer import load_tokenizer

    options = Options.of(options, **keywords)
    model_dir = Path(model)
    meta = read_meta(model_dir)
    if window < 2:
        raise FuselmError(f"--window {window} is too short; pass 2 or more tokens (default {text_mod.WINDOW})")
    body, source = text_mod.read_text(text)
    tok = load_tokenizer(model_dir, required=True)
    pieces = text_mod.windows(tok.encode(body), window, max_tokens)
    scorer = scorer_for(model_dir, options)
    ref = Reference(reference) if reference is not None and not isinstance(reference, Reference) else reference
    metrics, t0 = Metrics(), time.perf_counter()
    for ids in pieces:
        metrics.add(ids, scorer.score(ids.tolist()), ref.score(ids) if ref is not None else None)
    record = {"model": str(model_dir), "backend": options.backend, "engine": scorer.describe(), "reference": str(ref.dir) if ref is not None else None,
              "text": source, "window": int(len(pieces[0])), "windows": len(pieces), **metrics.summary(),
              "weight_bytes": weight_bytes(model_dir), "quantization": meta.get("quantization"),
              "seconds": round(time.perf_counter() - t0, 2)}
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
