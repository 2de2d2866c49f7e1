"""Numeric checks: onnxruntime (its own graph optimizations off: fuselm/reference.py) on one stage
against another.

Inputs follow the graph contract (fuselm/contract.py's step feeds); a prefill step runs with an
empty past, a decode step feeds the prefill's presents back as the past plus one new token.
"""

from __future__ import annotations

import os

import numpy as np
import onnx

from fuselm import contract
from fuselm.reference import ort_session

PREFILL_TOKENS = 5


def _genai_head_size(path: str | os.PathLike) -> int | None:
    """decoder.head_size from a genai_config.json beside the model: onnxruntime-genai's builder
    writes the cache inputs' head dim symbolic ('kv_cache_dim')."""
    import json
    from pathlib import Path

    config = Path(path).parent / "genai_config.json"
    try:
        size = json.loads(config.read_text())["model"]["decoder"]["head_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return size if isinstance(size, int) and size > 0 else None


def _complete(model: onnx.ModelProto, given: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An earlier stage's feeds, plus `position_ids` when this stage takes it and that one did not
    (FromGenAI adds the contract's input to onnxruntime-genai graphs, which derive positions)."""
    names = {i.name for i in model.graph.input}
    feeds = {k: v for k, v in given.items() if k in names}
    if contract.POSITION_IDS in names and contract.POSITION_IDS not in feeds:
        seq, total = given[contract.INPUT_IDS].shape[1], given[contract.ATTENTION_MASK].shape[1]
        feeds[contract.POSITION_IDS] = np.arange(total - seq, total, dtype=np.int64)[None]
    return feeds


def run_steps(path: str | os.PathLike, model: onnx.ModelProto | None = None, seed: int = 0,
              steps: dict | None = None) -> dict[str, dict[str, np.ndarray]]:
    """Run a prefill and a decode step; returns {step: {output name: array}} and the feeds used.

    When `steps` (an earlier result) is given, its feeds are reused so two stages see the same inputs.
    """
    model = model if model is not None else onnx.load(str(path), load_external_data=False)
    sess = ort_session(path)
    names = [o.name for o in sess.get_outputs()]
    result: dict[str, dict] = {}
    if steps is None:
        prefill = contract.step_feeds(model.graph.input, PREFILL_TOKENS, 0, contract.vocab_size(model), seed,
                                      head_dim=_genai_head_size(path))
    else:
        prefill = _complete(model, steps["prefill"]["feeds"])
    out = dict(zip(names, sess.run(None, prefill), strict=False))
    result["prefill"] = {"feeds": prefill, "outputs": out}
    if any(contract.is_step_past(n) for n in prefill):
        if steps is None:
            past = {n: out[contract.step_present_of(n)] for n in prefill if contract.is_step_past(n)}
            decode = contract.step_feeds(model.graph.input, 1, PREFILL_TOKENS, contract.vocab_size(model), seed + 1,
                                         past_values=past)
        else:
            decode = _complete(model, steps["decode"]["feeds"])
        result["decode"] = {"feeds": decode, "outputs": dict(zip(names, sess.run(None, decode), strict=False))}
    return result


def drift(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Max abs / relative difference of logits and of every output, per step."""
    report = {}
    for step in before:
        a, b = before[step]["outputs"], after[step]["outputs"]
        if set(a) != set(b):
            raise AssertionError(f"outputs differ: {sorted(a)} vs {sorted(b)}")
        entry = {}
        for name in (contract.LOGITS,) if contract.LOGITS in a else ():
            diff = float(np.max(np.abs(a[name].astype(np.float64) - b[name].astype(np.float64))))
            entry["logits_max_abs"] = diff
            entry["logits_rel"] = diff / max(float(np.max(np.abs(a[name]))), 1e-30)
        worst = 0.0
        for name in a:
            if a[name].shape != b[name].shape:
                raise AssertionError(f"{step}: output {name} changed shape {a[name].shape} -> {b[name].shape}")
            if a[name].size:
                scale = max(float(np.max(np.abs(a[name]))), 1e-30)
                worst = max(worst, float(np.max(np.abs(a[name].astype(np.float64) - b[name]))) / scale)
        entry["all_outputs_rel"] = worst
        report[step] = entry
    return report
