"""Numeric checks: onnxruntime (its own graph optimizations off) on one stage against another.

Inputs follow the graph contract (`input_ids`, `attention_mask`, `position_ids`,
`past_key_values.{i}.key/value`); a prefill step runs with an empty past, a decode step feeds the
prefill's `present.*` back as the past plus one new token.
"""

from __future__ import annotations

import os
import re

import numpy as np
import onnx

from fuselm.errors import FuselmError

PREFILL_TOKENS = 5


def session(path: str | os.PathLike, quantized: bool | None = None):
    """An onnxruntime CPU session with ORT's own graph optimizations off (a reference run)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    # DQ->MatMul is otherwise run as MatMulNBits with int8 activations (~0.3% error).
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _dims(value_info: onnx.ValueInfoProto) -> list:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in value_info.type.tensor_type.shape.dim]


def vocab_size(model: onnx.ModelProto) -> int:
    """The vocabulary size: logits' last dim, else the rows of the table `input_ids` indexes."""
    for out in model.graph.output:
        if out.name == "logits":
            d = _dims(out)
            if d and isinstance(d[-1], int) and d[-1] > 0:
                return d[-1]
    inits = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] == "input_ids" and node.input[0] in inits:
            return int(inits[node.input[0]].dims[0])
    return 64


def feeds(model: onnx.ModelProto, seq: int, past: int, vocab: int, seed: int = 0,
          past_values: dict[str, np.ndarray] | None = None, head_dim: int | None = None) -> dict[str, np.ndarray]:
    """Inputs for one step; `past_values` maps `past_key_values.*` names to arrays (else random);
    `head_dim` stands in for a symbolic last dim of the cache inputs."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for inp in model.graph.input:
        name, dims = inp.name, _dims(inp)
        if name == "input_ids":
            out[name] = rng.integers(0, vocab, size=(1, seq), dtype=np.int64)
        elif name == "attention_mask":
            out[name] = np.ones((1, past + seq), dtype=np.int64)
        elif name == "position_ids":
            out[name] = np.arange(past, past + seq, dtype=np.int64)[None]
        elif re.fullmatch(r"past_key_values\.\d+\.(key|value)", name):
            if past_values is not None:
                out[name] = past_values[name]
                continue
            if len(dims) == 4 and not isinstance(dims[3], int) and head_dim is not None:
                dims[3] = head_dim
            if len(dims) != 4 or not isinstance(dims[1], int) or not isinstance(dims[3], int):
                raise FuselmError(f"input {name} has shape {dims}; expected [batch, kv_heads, past, head_dim] "
                                  "with static kv_heads and head_dim (graph contract v1)")
            out[name] = rng.standard_normal((1, dims[1], past, dims[3])).astype(np.float32)
        else:
            raise FuselmError(f"cannot make a test input for graph input {name!r}: the numeric check knows the "
                              "graph contract's inputs (input_ids, attention_mask, position_ids, past_key_values.*)")
    return out


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
    if "position_ids" in names and "position_ids" not in feeds:
        seq, total = given["input_ids"].shape[1], given["attention_mask"].shape[1]
        feeds["position_ids"] = np.arange(total - seq, total, dtype=np.int64)[None]
    return feeds


def run_steps(path: str | os.PathLike, model: onnx.ModelProto | None = None, seed: int = 0,
              steps: dict | None = None) -> dict[str, dict[str, np.ndarray]]:
    """Run a prefill and a decode step; returns {step: {output name: array}} and the feeds used.

    When `steps` (an earlier result) is given, its feeds are reused so two stages see the same inputs.
    """
    model = model if model is not None else onnx.load(str(path), load_external_data=False)
    sess = session(path)
    names = [o.name for o in sess.get_outputs()]
    result: dict[str, dict] = {}
    if steps is None:
        vocab = vocab_size(model)
        prefill = feeds(model, PREFILL_TOKENS, 0, vocab, seed, head_dim=_genai_head_size(path))
    else:
        prefill = _complete(model, steps["prefill"]["feeds"])
    out = dict(zip(names, sess.run(None, prefill), strict=False))
    result["prefill"] = {"feeds": prefill, "outputs": out}
    if any(n.startswith("past_key_values.") for n in prefill):
        if steps is None:
            past = {n: out[n.replace("past_key_values.", "present.")] for n in prefill if n.startswith("past_key_values.")}
            decode = feeds(model, 1, PREFILL_TOKENS, vocab_size(model), seed + 1, past_values=past)
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
        for name in ("logits",) if "logits" in a else ():
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
