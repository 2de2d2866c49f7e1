"""Rotary position embeddings: `inv_freq` from the config, and the `fuselm::FusedRoPE` op.

`rope_inputs(config)` checks the rope scaling of a checkpoint (default, linear, llama3, yarn;
partial rotary too) and has transformers compute `inv_freq` and `attention_scaling` (its
ROPE_INIT_FUNCTIONS, or the model's default), so the FusedRoPE attribute is HF's buffer bit for bit.

The FusedRoPE node and its function body are the graph contract's (fuselm/contract.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fuselm.errors import FuselmError, shown

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
    try:
        hf_config = AutoConfig.for_model(model_type, **{**{k: v for k, v in config.items() if k != "model_type"},
                                                        "head_dim": head_dim})
    except Exception as e:  # transformers' own validation of the config (types, ranges)
        raise FuselmError(f"config.json is not a valid {model_type!r} config for transformers ({type(e).__name__}: "
                          f"{str(e).strip()[:160]}); use the config.json that came with the checkpoint") from None
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

