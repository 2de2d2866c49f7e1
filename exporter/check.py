"""`fuselm convert --check`: onnxruntime on the written graph against HF transformers.

HF loads the checkpoint with `from_pretrained` (it is the reference, not the convert path).
Both run a prefill and one decode step with past (fuselm/reference.py); the max abs logit difference
and greedy agreement are printed. An f32 export that differs by more than 1e-4 plus 1e-5 of the largest |logit|
raises CheckFailed (exit 1): float32 rounding grows with the logits (a trained model's reach 100 and more on
random ids), so the bound is relative where they are large and absolute where they are small.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fuselm.errors import CheckFailed
from fuselm.modeldir import read_meta
from fuselm.reference import OrtRunner, hf_model, hf_prefill_decode, ort_prefill_decode

F32_TOLERANCE = 1e-4  # absolute, for logits near zero
F32_RELATIVE = 1e-5  # of the largest |logit|: ~80 float32 roundings, 4x what a 30-layer export drifts


def check(model_dir: str | Path, hf_dir: str | Path, seq: int = 16, quiet: bool = False) -> dict:
    """Compare onnxruntime and HF on a seeded random prompt; returns the figures."""
    meta = read_meta(model_dir)
    runner, model = OrtRunner(model_dir), hf_model(hf_dir)
    ids = np.random.default_rng(0).integers(0, meta["dims"]["vocab"], size=(1, seq))
    ref_prefill, nxt, ref_step = hf_prefill_decode(model, ids)
    got_prefill, got_step = ort_prefill_decode(runner, ids, nxt)
    diff = float(max(np.abs(ref_prefill - got_prefill).max(), np.abs(ref_step - got_step).max()))
    ref_tokens = np.concatenate([ref_prefill.argmax(-1), ref_step.argmax(-1)], axis=1)
    got_tokens = np.concatenate([got_prefill.argmax(-1), got_step.argmax(-1)], axis=1)
    agree = int((ref_tokens == got_tokens).sum())
    scale = float(max(np.abs(ref_prefill).max(), np.abs(ref_step).max()))
    tolerance = F32_TOLERANCE + F32_RELATIVE * scale
    result = {"max_abs_logit_diff": diff, "max_abs_logit": scale, "tolerance": tolerance, "greedy_agreement": agree,
              "positions": int(ref_tokens.size), "quant": meta["quantization"]["mode"]}
    if not quiet:
        print(f"check: onnxruntime vs HF transformers ({seq}-token prefill + 1 decode step with past): "
              f"max abs logit diff {diff:.3g}, greedy tokens agree at {agree}/{ref_tokens.size} positions")
    if result["quant"] == "f32" and not diff <= tolerance:
        raise CheckFailed(f"f32 export differs from HF transformers by {diff:.3g} (tolerance {tolerance:.3g}: "
                          f"{F32_TOLERANCE} + {F32_RELATIVE} x the largest |logit|, {scale:.3g}); the graph does not "
                          "compute what the checkpoint does")
    return result
