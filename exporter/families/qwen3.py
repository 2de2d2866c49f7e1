"""Qwen3 (Qwen3ForCausalLM): RMSNorm on q and k per head before RoPE, explicit head_dim.

Mirrors transformers' Qwen3DecoderLayer: q = q_norm(q_proj(h).view(B,S,H,D)), then rope, then
eager attention; the MLP is SwiGLU. `attention_bias` adds biases to q/k/v/o.
"""

from __future__ import annotations

from dataclasses import dataclass

from fuselm.errors import FuselmError

from .base import DecoderConfig


@dataclass
class Config(DecoderConfig):
    attention_bias: bool = False
    use_sliding_window: bool = False

    def check(self) -> None:
        super().check()
        if self.use_sliding_window:
            raise FuselmError("config.json: use_sliding_window is true; fuselm exports Qwen3 with full "
                              "attention only (set it to false if the checkpoint was trained without it)")


def LAYER_TENSORS(c: Config) -> list[str]:
    bias = [f"attn/{p}.bias" for p in ("q_proj", "k_proj", "v_proj", "o_proj")] if c.attention_bias else []
    return ["input_layernorm", "attn/q_proj", "attn/k_proj", "attn/v_proj", "attn/o_proj", "attn/q_norm",
            "attn/k_norm", "post_attention_layernorm", "mlp/gate_proj", "mlp/up_proj", "mlp/down_proj", *bias]


def decoder_layer(L, x: str, c: Config) -> str:
    """One Qwen3 decoder layer on x [B,S,hidden]; L is an exporter.graph.Layer."""
    bias = c.attention_bias
    h = L.rms_norm("input_layernorm", x)
    q = L.heads(L.linear("attn/q_proj", h, bias), c.num_attention_heads, "attn/q_proj")
    k = L.heads(L.linear("attn/k_proj", h, bias), c.num_key_value_heads, "attn/k_proj")
    v = L.heads(L.linear("attn/v_proj", h, bias), c.num_key_value_heads, "attn/v_proj")
    q = L.rotary(L.rms_norm("attn/q_norm", q), "attn/q_rope")
    k = L.rotary(L.rms_norm("attn/k_norm", k), "attn/k_rope")
    x = L.add(x, L.linear("attn/o_proj", L.attention(q, k, v), bias), "attn/residual")
    h = L.rms_norm("post_attention_layernorm", x)
    return L.add(x, L.swiglu_mlp(h), "mlp/residual")
