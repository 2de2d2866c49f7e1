"""The op table's fuselm ops (FusedRoPE in every form, SwiGLU) against onnxruntime running their
model-local function bodies (fuselm/contract.py), on each backend."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from fuselm.runtime_metal.backends import make_backend
from fuselm.runtime_metal.ops_nn import FusedRoPE, SwiGLU
from onnx import TensorProto, numpy_helper
from onnx import helper as oh

from fuselm import contract
from fuselm.reference import ort_session

B, S, H, D = 1, 4, 3, 16


def _ort(node: onnx.NodeProto, inputs: dict[str, np.ndarray], weights: dict[str, np.ndarray]) -> np.ndarray:
    """onnxruntime (fusions off) on a one-node graph carrying the contract's function for that node."""
    dtype = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int64): TensorProto.INT64}
    ins = [oh.make_tensor_value_info(k, dtype[v.dtype], list(v.shape)) for k, v in inputs.items()]
    out = oh.make_tensor_value_info(node.output[0], TensorProto.FLOAT, None)
    graph = oh.make_graph([node], "op", ins, [out], initializer=[numpy_helper.from_array(w, k) for k, w in weights.items()])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", contract.OPSET),
                                                oh.make_opsetid(contract.DOMAIN, contract.DOMAIN_VERSION)],
                          ir_version=10, functions=contract.functions_for([node]))
    return ort_session(model).run(None, inputs)[0]


@pytest.mark.parametrize("backend", ["numpy", "torch", "mlx"])
@pytest.mark.parametrize("heads,normed,interleaved", [(0, True, 0), (H, False, 0), (H, True, 0), (H, True, 1)])
def test_fused_rope_forms_match_the_function_body(backend, heads, normed, interleaved):
    """x [B,S,H,D] or [B,S,H·D] (num_heads), with or without the per-head norm weight; partial rotary."""
    b = make_backend(backend, "cpu")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, S, H * D) if heads else (B, S, H, D)).astype(np.float32)
    w = rng.standard_normal(D).astype(np.float32)
    inv = (1.0 / 10000 ** (np.arange(0, 12, 2) / 12)).astype(np.float32)  # rotary_dim 12 < head_dim 16
    pos = np.arange(5, 5 + S, dtype=np.int64)[None]
    node = contract.fused_rope_node("x", "pos", "y", "rope", inv, 1.25, interleaved, num_heads=heads,
                                    norm_weight="w" if normed else None, epsilon=1e-6)
    want = _ort(node, {"x": x, "pos": pos}, {"w": w} if normed else {})
    got = FusedRoPE(b, b.asarray(x), b.asarray(pos), b.asarray(w) if normed else None, inv_freq=inv,
                    attention_scaling=1.25, interleaved=interleaved, num_heads=heads, epsilon=1e-6)
    np.testing.assert_allclose(b.to_numpy(got), want, atol=1e-5)


@pytest.mark.parametrize("backend", ["numpy", "torch", "mlx"])
def test_swiglu_matches_the_function_body(backend):
    b = make_backend(backend, "cpu")
    x = np.random.default_rng(1).standard_normal((B, S, 24)).astype(np.float32)
    want = _ort(oh.make_node(contract.SWIGLU_OP, ["x"], ["y"], domain=contract.DOMAIN), {"x": x}, {})
    np.testing.assert_allclose(b.to_numpy(SwiGLU(b, b.asarray(x))), want, atol=1e-6)
