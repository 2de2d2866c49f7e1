"""Model families: one small module per config `model_type`, one alias table, one tensor table.

A family module has a `Config` (dataclass, `from_dict` ignores unknown keys), `LAYER_TENSORS`
(the canonical names of one decoder layer's tensors, given the config) and `decoder_layer`
(the layer's ops, written with the blocks of exporter/graph.py). A new family starts as a copy
of its nearest sibling.
"""

from __future__ import annotations

import types

from fuselm.errors import FuselmError, shown

from . import llama, qwen2, qwen3
from .base import DecoderConfig

FAMILIES: dict[str, types.ModuleType] = {"qwen3": qwen3, "qwen2": qwen2, "llama": llama}
ALIASES = {"mistral": "llama"}
SUPPORTED = sorted([*FAMILIES, *ALIASES])
__all__ = ["FAMILIES", "ALIASES", "SUPPORTED", "TENSORS", "DecoderConfig", "family_for", "expected_tensors", "hf_name"]

# Canonical name -> (HF tensor name, shape from the config). Canonical names double as node
# scopes: "attn/q_proj" becomes `/model/layers.{i}/attn/q_proj/MatMul`.
TENSORS = {
    "embed": ("model.embed_tokens.weight", lambda c: (c.vocab_size, c.hidden_size)),
    "final_norm": ("model.norm.weight", lambda c: (c.hidden_size,)),
    "lm_head": ("lm_head.weight", lambda c: (c.vocab_size, c.hidden_size)),
    "input_layernorm": ("model.layers.{i}.input_layernorm.weight", lambda c: (c.hidden_size,)),
    "attn/q_proj": ("model.layers.{i}.self_attn.q_proj.weight", lambda c: (c.num_attention_heads * c.head_dim, c.hidden_size)),
    "attn/k_proj": ("model.layers.{i}.self_attn.k_proj.weight", lambda c: (c.num_key_value_heads * c.head_dim, c.hidden_size)),
    "attn/v_proj": ("model.layers.{i}.self_attn.v_proj.weight", lambda c: (c.num_key_value_heads * c.head_dim, c.hidden_size)),
    "attn/o_proj": ("model.layers.{i}.self_attn.o_proj.weight", lambda c: (c.hidden_size, c.num_attention_heads * c.head_dim)),
    "attn/q_proj.bias": ("model.layers.{i}.self_attn.q_proj.bias", lambda c: (c.num_attention_heads * c.head_dim,)),
    "attn/k_proj.bias": ("model.layers.{i}.self_attn.k_proj.bias", lambda c: (c.num_key_value_heads * c.head_dim,)),
    "attn/v_proj.bias": ("model.layers.{i}.self_attn.v_proj.bias", lambda c: (c.num_key_value_heads * c.head_dim,)),
    "attn/o_proj.bias": ("model.layers.{i}.self_attn.o_proj.bias", lambda c: (c.hidden_size,)),
    "attn/q_norm": ("model.layers.{i}.self_attn.q_norm.weight", lambda c: (c.head_dim,)),
    "attn/k_norm": ("model.layers.{i}.self_attn.k_norm.weight", lambda c: (c.head_dim,)),
    "post_attention_layernorm": ("model.layers.{i}.post_attention_layernorm.weight", lambda c: (c.hidden_size,)),
    "mlp/gate_proj": ("model.layers.{i}.mlp.gate_proj.weight", lambda c: (c.intermediate_size, c.hidden_size)),
    "mlp/up_proj": ("model.layers.{i}.mlp.up_proj.weight", lambda c: (c.intermediate_size, c.hidden_size)),
    "mlp/down_proj": ("model.layers.{i}.mlp.down_proj.weight", lambda c: (c.hidden_size, c.intermediate_size)),
    "mlp/gate_proj.bias": ("model.layers.{i}.mlp.gate_proj.bias", lambda c: (c.intermediate_size,)),
    "mlp/up_proj.bias": ("model.layers.{i}.mlp.up_proj.bias", lambda c: (c.intermediate_size,)),
    "mlp/down_proj.bias": ("model.layers.{i}.mlp.down_proj.bias", lambda c: (c.hidden_size,)),
}
# Checkpoint tensors that carry no information: HF recomputes them (and so do we).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def hf_name(canonical: str, layer: int | None = None) -> str:
    return TENSORS[canonical][0].format(i=layer)


def expected_tensors(family: types.ModuleType, config) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the family needs: HF name -> shape."""
    names = ["embed", "final_norm"] + ([] if config.tie_word_embeddings else ["lm_head"])
    out = {hf_name(n): TENSORS[n][1](config) for n in names}
    for i in range(config.num_hidden_layers):
        out.update({hf_name(n, i): TENSORS[n][1](config) for n in family.LAYER_TENSORS(config)})
    return out


def family_for(config: dict) -> tuple[str, types.ModuleType]:
    """The family module for a config.json dict; a clear error for anything else."""
    model_type = config.get("model_type")
    arch = config.get("architectures")
    if not isinstance(model_type, str):
        raise FuselmError(f"config.json: model_type = {shown(model_type)} is not a string; use the config.json that "
                          "came with the checkpoint")
    if arch is not None and not (isinstance(arch, list) and all(isinstance(a, str) for a in arch)):
        raise FuselmError(f"config.json: architectures = {shown(arch)} is not a list of class names; use the "
                          "config.json that came with the checkpoint")
    name = ALIASES.get(model_type, model_type)
    if name not in FAMILIES:
        arch = ", ".join(arch or []) or "unknown architecture"
        raise FuselmError(f"model_type {model_type!r} ({arch}) is not supported; supported model types: "
                          f"{', '.join(SUPPORTED)}. Use a checkpoint of one of these families")
    return name, FAMILIES[name]
