"""Qwen2 / Qwen2.5 (Qwen2ForCausalLM): biases on q, k and v (not o); head_dim = hidden / heads.

Mirrors transformers' Qwen2DecoderLayer; the MLP is SwiGLU.
"""

from __future__ import annotations

from dataclasses import dataclass

from fuselm.errors import FuselmError

from .base import DecoderConfig


@dataclass
class Config(DecoderConfig):
    use_sliding_window: bool = False

    def check(self) -> None:
        super().check()
        if self.use_sliding_window:
            raise FuselmError("config.json: use_sliding_window is true; fuselm exports Qwen2 with full "
                              "attention only (set it to false if the checkpoint was trained without it)")


def LAYER_TENSORS(c: Config) -> list[str]:
    return ["input_layernorm", "attn/q_proj", "attn/k_proj", "attn/v_proj", "attn/o_proj", "attn/q_proj.bias",
            "attn/k_proj.bias", "attn/v_proj.bias", "post_attention_layernorm", "mlp/gate_proj", "mlp/up_proj",
            "mlp/down_proj"]


def decoder_layer(L, x: str, c: Config) -> str:
    """One Qwen2 decoder layer on x [B,S,hidden]; L is an exporter.graph.Layer."""
    h = L.rms_norm("input_layernorm", x)
    q = L.heads(L.linear("attn/q_proj", h, bias=True), c.num_attention_heads, "attn/q_proj")
    k = L.heads(L.linear("attn/k_proj", h, bias=True), c.num_key_value_heads, "attn/k_proj")
    v = L.heads(L.linear("attn/v_proj", h, bias=True), c.num_key_value_heads, "attn/v_proj")
    q, k = L.rotary(q, "attn/q_rope"), L.rotary(k, "attn/k_rope")
    x = L.add(x, L.linear("attn/o_proj", L.attention(q, k, v)), "attn/residual")
    h = L.rms_norm("post_attention_layernorm", x)
    return L.add(x, L.swiglu_mlp(h), "mlp/residual")
