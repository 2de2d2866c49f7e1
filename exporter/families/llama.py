"""Llama 2/3.x (LlamaForCausalLM), and Mistral through the alias table (its sliding_window).

Mirrors transformers' LlamaDecoderLayer: optional `attention_bias` (q/k/v/o) and `mlp_bias`;
Mistral's `sliding_window`, when set, limits each query to the last `sliding_window` keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import DecoderConfig


@dataclass
class Config(DecoderConfig):
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None


def LAYER_TENSORS(c: Config) -> list[str]:
    attn_bias = [f"attn/{p}.bias" for p in ("q_proj", "k_proj", "v_proj", "o_proj")] if c.attention_bias else []
    mlp_bias = [f"mlp/{p}.bias" for p in ("gate_proj", "up_proj", "down_proj")] if c.mlp_bias else []
    return ["input_layernorm", "attn/q_proj", "attn/k_proj", "attn/v_proj", "attn/o_proj",
            "post_attention_layernorm", "mlp/gate_proj", "mlp/up_proj", "mlp/down_proj", *attn_bias, *mlp_bias]


def decoder_layer(L, x: str, c: Config) -> str:
    """One Llama decoder layer on x [B,S,hidden]; L is an exporter.graph.Layer."""
    bias = c.attention_bias
    h = L.rms_norm("input_layernorm", x)
    q = L.heads(L.linear("attn/q_proj", h, bias), c.num_attention_heads, "attn/q_proj")
    k = L.heads(L.linear("attn/k_proj", h, bias), c.num_key_value_heads, "attn/k_proj")
    v = L.heads(L.linear("attn/v_proj", h, bias), c.num_key_value_heads, "attn/v_proj")
    q, k = L.rotary(q, "attn/q_rope"), L.rotary(k, "attn/k_rope")
    x = L.add(x, L.linear("attn/o_proj", L.attention(q, k, v), bias), "attn/residual")
    h = L.rms_norm("post_attention_layernorm", x)
    return L.add(x, L.swiglu_mlp(h, c.mlp_bias), "mlp/residual")
