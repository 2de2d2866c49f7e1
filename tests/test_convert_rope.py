"""RoPE: inv_freq / attention_scaling vs transformers' own functions; the FusedRoPE body vs HF's
apply_rotary_pos_emb, including the unsqueeze trap (head_dim != hidden/heads, one kv head, S == H)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from fuselm.exporter.rope import rope_inputs
from onnx import TensorProto
from onnx import helper as oh
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from fuselm import contract
from fuselm.errors import FuselmError
from fuselm.reference import OrtRunner, hf_model, ort_session

BASE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 1e6},
    "linear": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
    "linear-partial": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "partial_rotary_factor": 0.5},
    "llama3": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn-mscale": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "original_max_position_embeddings": 512,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "truncate": False},
    "yarn-attention-factor": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "attention_factor": 1.3,
                              "original_max_position_embeddings": 256, "partial_rotary_factor": 0.75},
}


@pytest.mark.parametrize("case", ROPES)
def test_inv_freq_equals_transformers(case):
    config = AutoConfig.for_model("llama", rope_parameters=dict(ROPES[case]), **BASE)
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        want, scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        want, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    got = rope_inputs(config.to_dict(), config.head_dim)
    np.testing.assert_array_equal(got.inv_freq, want.numpy())
    assert got.attention_scaling == pytest.approx(scaling, rel=1e-12)
    assert got.rotary_dim == int(32 * ROPES[case].get("partial_rotary_factor", 1.0))


def test_transformers4_config_keys():
    """rope_theta and rope_scaling (with `type`) at the top level, as transformers 4.x wrote them."""
    legacy = {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}, **BASE}
    config = AutoConfig.for_model("llama", **legacy)
    want, _ = ROPE_INIT_FUNCTIONS["linear"](config, "cpu")
    np.testing.assert_array_equal(rope_inputs({"model_type": "llama", **legacy}, 32).inv_freq, want.numpy())


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "su"])
def test_unsupported_rope_type(rope_type):
    with pytest.raises(FuselmError, match=f"rope type '{rope_type}' is not supported; supported: default"):
        rope_inputs({"rope_parameters": {"rope_type": rope_type, "rope_theta": 1e4, "factor": 2.0}}, 32)


def _rope_session(rope):
    node = contract.fused_rope_node("x", "pos", "y", "rope", rope.inv_freq, rope.attention_scaling)
    graph = oh.make_graph([node], "rope", [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", "H", "D"]),
                                           oh.make_tensor_value_info("pos", TensorProto.INT64, ["B", "S"])],
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", "H", "D"])])
    model = oh.make_model(graph, ir_version=11, functions=contract.functions_for([node]),
                          opset_imports=[oh.make_opsetid("", contract.OPSET),
                                         oh.make_opsetid(contract.DOMAIN, contract.DOMAIN_VERSION)])
    onnx.checker.check_model(model, full_check=True)
    return ort_session(model)


# (batch, seq, heads, head_dim): head_dim != hidden/heads, a single (kv) head, S == H, S == H == D/…
TRAP_SHAPES = [(2, 5, 3, 32), (1, 4, 1, 16), (2, 4, 4, 8), (1, 8, 8, 8)]


@pytest.mark.parametrize("shape", TRAP_SHAPES)
@pytest.mark.parametrize("case", ["default", "yarn"])
def test_fused_rope_body_equals_hf_apply_rotary(shape, case):
    b, s, h, d = shape
    config = AutoConfig.for_model("llama", rope_parameters=dict(ROPES[case]),
                                  **{**BASE, "hidden_size": 16 * h, "head_dim": d, "num_attention_heads": h,
                                     "num_key_value_heads": h})
    rope = rope_inputs(config.to_dict(), d)
    x = np.random.default_rng(0).standard_normal((b, s, h, d)).astype(np.float32)
    pos = (np.arange(s)[None] + 7 * np.arange(b)[:, None]).astype(np.int64)
    got = _rope_session(rope).run(None, {"x": x, "pos": pos})[0]
    cos, sin = LlamaRotaryEmbedding(config)(torch.tensor(x), torch.tensor(pos))  # [B,S,D]
    q = torch.tensor(x).transpose(1, 2)  # HF's layout [B,H,S,D]
    want, _ = apply_rotary_pos_emb(q, q, cos, sin)
    np.testing.assert_allclose(got, want.transpose(1, 2).numpy(), atol=2e-6, rtol=0)


def test_partial_rotary_passes_the_rest_through():
    rope = rope_inputs({"model_type": "llama", "rope_parameters": ROPES["linear-partial"], **BASE}, 32)
    x = np.random.default_rng(1).standard_normal((1, 3, 2, 32)).astype(np.float32)
    got = _rope_session(rope).run(None, {"x": x, "pos": np.array([[0, 5, 9]])})[0]
    np.testing.assert_array_equal(got[..., 16:], x[..., 16:])
    assert not np.allclose(got[:, 1:, :, :16], x[:, 1:, :, :16])


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_model_with_seq_equal_heads(family, make_ckpt, exported):
    """S == num_attention_heads in a full model (qwen3: head_dim 32 != 64/4; llama: one kv head)."""
    model, ort_model = hf_model(make_ckpt(family)), OrtRunner(exported(family))
    s = model.config.num_attention_heads
    ids = np.random.default_rng(5).integers(0, model.config.vocab_size, size=(1, s))
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(ids)).logits.numpy()
    got, _ = ort_model.forward(ids, np.ones((1, s)), np.arange(s)[None])
    assert np.abs(ref - got).max() <= 1e-4


def test_yarn_model_matches_hf(make_ckpt, exported):
    """attention_scaling != 1 end to end (qwen3 with yarn)."""
    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 8}
    model, ort_model = hf_model(make_ckpt("qwen3", rope_parameters=yarn)), OrtRunner(exported("qwen3", rope_parameters=yarn))
    ids = np.random.default_rng(6).integers(0, model.config.vocab_size, size=(1, 16))
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(ids)).logits.numpy()
    got, _ = ort_model.forward(ids, np.ones((1, 16)), np.arange(16)[None])
    assert np.abs(ref - got).max() <= 1e-4


def test_a_function_that_kernels_made_a_module_is_read_as_written():
    """transformers 5.25's `kernels` turns apply_rotary_pos_emb into an nn.Module instance (its signature
    (*args, **kwargs)); the traced exporter reads the function it calls."""
    import torch
    from fuselm.exporter.traced.rope_op import as_written, rotated_arguments

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        return q, k

    try:
        from kernels import use_kernel_forward_from_hub

        wrapped = use_kernel_forward_from_hub("rotary_pos_emb")(apply_rotary_pos_emb)
    except ImportError:  # the same shape as kernels' Func: a module whose forward closes over the function
        class Func(torch.nn.Module):
            def forward(self, *args, **kwargs):
                return apply_rotary_pos_emb(*args, **kwargs)

        wrapped = Func()
    assert isinstance(wrapped, torch.nn.Module) and as_written(wrapped) is apply_rotary_pos_emb
    assert rotated_arguments(wrapped, "qwen3") == ["q", "k"]
    assert as_written(apply_rotary_pos_emb) is apply_rotary_pos_emb
