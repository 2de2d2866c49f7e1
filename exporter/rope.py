"""Rotary position embeddings: `inv_freq` from the config, and the `fuselm::FusedRoPE` op.

`rope_inputs(config)` checks the rope scaling of a checkpoint (default, linear, llama3, yarn;
partial rotary too) and has transformers compute `inv_freq` and `attention_scaling` (its
ROPE_INIT_FUNCTIONS, or the model's default), so the FusedRoPE attribute is HF's buffer bit for bit.

`fused_rope_function()` is the model-local ONNX function that gives FusedRoPE its meaning in
standard ops; a runtime that knows the op runs its own kernel, any other inlines this body.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto
from onnx import helper as oh

from fuselm.errors import FuselmError, shown

DOMAIN = "fuselm"
DOMAIN_VERSION = 1
OP = "FusedRoPE"
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class Rope:
    """What a FusedRoPE node needs, plus what fuselm.json records."""

    inv_freq: np.ndarray  # float32 [rotary_dim // 2], scaling already folded in
    attention_scaling: float
    rope_type: str
    theta: float
    parameters: dict  # the rope dict as the config gives it (normalized: rope_type, rope_theta)

    @property
    def rotary_dim(self) -> int:
        return 2 * len(self.inv_freq)


def rope_parameters(config: dict) -> dict:
    """The rope dict of a config.json, normalized like transformers' `standardize_rope_params`.

    transformers 5 writes `rope_parameters` (theta inside); 4.x wrote `rope_theta` and
    `rope_scaling` (with `type` or `rope_type`) at the top level. Both are read.
    """
    for key in ("rope_parameters", "rope_scaling"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise FuselmError(f"config.json: {key} = {shown(config[key])} is not a JSON object; use the "
                              "config.json that came with the checkpoint")
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if "layer_types" in config and any(isinstance(v, dict) for v in params.values()):
        raise FuselmError("per-layer rope parameters (nested rope_parameters) are not supported; "
                          "supported checkpoints use one rope for every layer")
    params.setdefault("rope_type", params.pop("type", "default"))
    if params.get("rope_theta") is None:
        params["rope_theta"] = config["rope_theta"] if config.get("rope_theta") is not None else 10000.0
    if config.get("partial_rotary_factor") is not None and params.get("partial_rotary_factor") is None:
        params["partial_rotary_factor"] = config["partial_rotary_factor"]
    if params["rope_type"] in ("llama3", "yarn") and "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = config.get(
            "original_max_position_embeddings", config.get("max_position_embeddings"))
    return params


def rope_inputs(config: dict, head_dim: int) -> Rope:
    """inv_freq and attention_scaling for a config.json dict, computed by transformers itself (the
    model_type's rotary class for `default`, ROPE_INIT_FUNCTIONS for the scaled types): the same
    functions that fill the rotary module's buffers, which the traced exporter reads."""
    p = rope_parameters(config)
    rope_type = p["rope_type"]
    if not isinstance(rope_type, str) or rope_type not in SUPPORTED_ROPE_TYPES:
        raise FuselmError(f"rope type {shown(rope_type)} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)} "
                          "(use a checkpoint with one of these, or add the type to exporter/rope.py)")
    _check_numbers(p, rope_type)
    dim = int(head_dim * float(p.get("partial_rotary_factor") or 1.0))
    if dim < 2 or dim > head_dim:  # before anything is sized by it
        raise FuselmError(f"config.json: rotary dim {dim} does not fit head_dim {head_dim}; fix partial_rotary_factor")
    try:
        inv_freq, scaling = _transformers_init(config, rope_type, head_dim)
    except KeyError as e:
        raise FuselmError(f"config.json: rope type {rope_type!r} needs {e.args[0]!r} in rope_parameters "
                          "(or rope_scaling); add it or fix the config") from None
    except (ArithmeticError, ValueError, TypeError) as e:  # e.g. yarn's logarithms of a degenerate range
        raise FuselmError(f"config.json: the rope parameters {shown(p, 200)} cannot be evaluated ({e}); "
                          "fix the config") from None
    inv_freq = inv_freq.numpy().astype(np.float32)
    if not (np.isfinite(inv_freq).all() and (inv_freq > 0).all() and math.isfinite(scaling)):
        raise FuselmError(f"config.json: the rope parameters {shown(p, 200)} give non-finite or non-positive "
                          "frequencies; fix the config")
    return Rope(inv_freq, float(scaling), rope_type, float(p["rope_theta"]), p)


def _transformers_init(config: dict, rope_type: str, head_dim: int):
    """(inv_freq tensor, attention_scaling) as the model_type's rotary module computes them."""
    import importlib

    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model_type = config.get("model_type")
    hf_config = AutoConfig.for_model(model_type, **{**{k: v for k, v in config.items() if k != "model_type"},
                                                    "head_dim": head_dim})
    if rope_type != "default":
        return ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    rotary = next(c for n, c in vars(modeling).items() if n.endswith("RotaryEmbedding")
                  and hasattr(c, "compute_default_rope_parameters"))
    return rotary.compute_default_rope_parameters(hf_config)


# Numbers each rope type reads (beyond rope_theta and partial_rotary_factor): key -> must be positive.
_ROPE_NUMBERS = {
    "default": {},
    "linear": {"factor": True},
    "llama3": {"factor": True, "low_freq_factor": True, "high_freq_factor": True,
               "original_max_position_embeddings": True},
    "yarn": {"factor": True, "original_max_position_embeddings": True, "attention_factor": False,
             "mscale": False, "mscale_all_dim": False, "beta_fast": True, "beta_slow": True},
}


def _check_numbers(p: dict, rope_type: str) -> None:
    """Every rope number the type reads is a finite number (positive where a ratio or length needs it);
    partial_rotary_factor lies in (0, 1]. Missing ones are reported where they are read."""
    numbers = {"rope_theta": True, "partial_rotary_factor": True, **_ROPE_NUMBERS[rope_type]}
    for key, positive in numbers.items():
        value = p.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or (positive and value <= 0):
            kind = "a positive number" if positive else "a finite number"
            raise FuselmError(f"config.json: rope {key} = {shown(value)} is not {kind}; fix the config")
    if (p.get("partial_rotary_factor") or 1.0) > 1:
        raise FuselmError(f"config.json: partial_rotary_factor = {p['partial_rotary_factor']!r} is above 1; fix the config")


def fused_rope_node(x: str, position_ids: str, y: str, name: str, rope: Rope) -> onnx.NodeProto:
    """One `fuselm::FusedRoPE` node: x [B,S,H,D], position_ids [B,S] -> y [B,S,H,D]."""
    return oh.make_node(OP, [x, position_ids], [y], name=name, domain=DOMAIN,
                        inv_freq=[float(v) for v in rope.inv_freq],
                        attention_scaling=float(rope.attention_scaling), interleaved=0)


def fused_rope_function() -> onnx.FunctionProto:
    """The FunctionProto of fuselm::FusedRoPE (domain fuselm, v1), standard opset-23 ops only.

    freqs = position_ids[..., None] * inv_freq                      [B,S,R/2]
    rotate_half (interleaved=0): emb = concat(freqs, freqs); rot = concat(-x2, x1)
    interleaved=1:               emb = repeat each freq twice; rot = (-x_odd, x_even) pairs
    cos/sin = cos/sin(emb) * attention_scaling, unsqueezed to [B,S,1,R]: they broadcast over
    heads (never [S,1,R,1]: the unsqueeze trap). Dims R..D of x pass through unrotated.
    """
    def c64(name, values):
        return oh.make_node("Constant", [], [name], value=oh.make_tensor(name, TensorProto.INT64, [len(values)], values))

    nodes = [
        _attr_constant("inv", "value_floats", "inv_freq", onnx.AttributeProto.FLOATS),
        _attr_constant("scale", "value_float", "attention_scaling", onnx.AttributeProto.FLOAT),
        _attr_constant("interleaved_i", "value_int", "interleaved", onnx.AttributeProto.INT),
        c64("axis_last", [-1]), c64("axis_2", [2]), c64("zero", [0]), c64("two", [2]), c64("big", [2**62]),
        c64("shape_pairs", [0, 0, 0, -1, 2]), c64("shape_flat3", [0, 0, -1]), c64("shape_flat4", [0, 0, 0, -1]),
        c64("one", [1]),
        oh.make_node("Shape", ["inv"], ["half"]),
        oh.make_node("Mul", ["half", "two"], ["rdim"]),
        oh.make_node("Cast", ["position_ids"], ["pos_f"], to=TensorProto.FLOAT),
        oh.make_node("Unsqueeze", ["pos_f", "axis_last"], ["pos_u"]),
        oh.make_node("Mul", ["pos_u", "inv"], ["freqs"]),  # [B,S,R/2]
        oh.make_node("Slice", ["X", "zero", "rdim", "axis_last"], ["x_rot"]),
        oh.make_node("Slice", ["X", "rdim", "big", "axis_last"], ["x_pass"]),
        oh.make_node("Cast", ["interleaved_i"], ["interleaved"], to=TensorProto.BOOL),
        oh.make_node("Squeeze", ["interleaved"], ["cond"]),
        oh.make_node("If", ["cond"], ["emb", "rot"], then_branch=_interleaved_branch(), else_branch=_half_branch()),
        oh.make_node("Cos", ["emb"], ["cos_raw"]),
        oh.make_node("Sin", ["emb"], ["sin_raw"]),
        oh.make_node("Mul", ["cos_raw", "scale"], ["cos3"]),
        oh.make_node("Mul", ["sin_raw", "scale"], ["sin3"]),
        oh.make_node("Unsqueeze", ["cos3", "axis_2"], ["cos"]),  # [B,S,1,R]
        oh.make_node("Unsqueeze", ["sin3", "axis_2"], ["sin"]),
        oh.make_node("Mul", ["x_rot", "cos"], ["x_cos"]),
        oh.make_node("Mul", ["rot", "sin"], ["rot_sin"]),
        oh.make_node("Add", ["x_cos", "rot_sin"], ["y_rot"]),
        oh.make_node("Concat", ["y_rot", "x_pass"], ["Y"], axis=-1),
    ]
    return oh.make_function(
        DOMAIN, OP, ["X", "position_ids"], ["Y"], nodes,
        opset_imports=[oh.make_opsetid("", 23)],
        attributes=["inv_freq"],
        attribute_protos=[oh.make_attribute("attention_scaling", 1.0), oh.make_attribute("interleaved", 0)],
        doc_string=fused_rope_function.__doc__,
    )


def _attr_constant(output: str, const_attr: str, function_attr: str, kind: int) -> onnx.NodeProto:
    """A Constant whose value is the function attribute `function_attr` (an attribute reference)."""
    node = oh.make_node("Constant", [], [output])
    ref = node.attribute.add()
    ref.name, ref.type, ref.ref_attr_name = const_attr, kind, function_attr
    return node


def _half_branch() -> onnx.GraphProto:
    """rotate_half: emb = [freqs, freqs], rot = [-x2, x1] (HF's Llama/Qwen layout)."""
    nodes = [
        oh.make_node("Concat", ["freqs", "freqs"], ["h_emb"], axis=-1),
        oh.make_node("Slice", ["x_rot", "zero", "half", "axis_last"], ["h_x1"]),
        oh.make_node("Slice", ["x_rot", "half", "rdim", "axis_last"], ["h_x2"]),
        oh.make_node("Neg", ["h_x2"], ["h_neg"]),
        oh.make_node("Concat", ["h_neg", "h_x1"], ["h_rot"], axis=-1),
    ]
    return oh.make_graph(nodes, "rotate_half", [], [_value("h_emb", 3), _value("h_rot", 4)])


def _interleaved_branch() -> onnx.GraphProto:
    """interleaved (GPT-J layout): pairs (x[2i], x[2i+1]) rotate by freqs[i]."""
    nodes = [
        oh.make_node("Unsqueeze", ["freqs", "axis_last"], ["i_f"]),
        oh.make_node("Concat", ["i_f", "i_f"], ["i_ff"], axis=-1),
        oh.make_node("Reshape", ["i_ff", "shape_flat3"], ["i_emb"]),
        oh.make_node("Reshape", ["x_rot", "shape_pairs"], ["i_pairs"]),
        oh.make_node("Slice", ["i_pairs", "zero", "one", "axis_last"], ["i_even"]),
        oh.make_node("Slice", ["i_pairs", "one", "two", "axis_last"], ["i_odd"]),
        oh.make_node("Neg", ["i_odd"], ["i_neg"]),
        oh.make_node("Concat", ["i_neg", "i_even"], ["i_rot5"], axis=-1),
        oh.make_node("Reshape", ["i_rot5", "shape_flat4"], ["i_rot"]),
    ]
    return oh.make_graph(nodes, "interleaved", [], [_value("i_emb", 3), _value("i_rot", 4)])


def _value(name: str, rank: int) -> onnx.ValueInfoProto:
    return oh.make_tensor_value_info(name, TensorProto.FLOAT, [f"{name}_{i}" for i in range(rank)])
