"""The runtime on recurrent-state hybrids: the state ops' kernels on every backend against their function bodies in
onnxruntime, the session carrying the state across prompt chunks and decode steps, MLX's greedy tokens against
torch's, and the state kept in float32 whatever the KV cache's format."""

from __future__ import annotations

import numpy as np
import pytest
from fuselm.runtime_metal.backends import make_backend, state_kernels
from fuselm.runtime_metal.session import Session
from test_convert_hybrid import CASES, _run_op, op_of, state_op_cases

from fuselm import contract
from fuselm.reference import OrtRunner

BACKENDS = ["torch", "numpy", "mlx"]
PROMPT = [5, 17, 3, 42, 8, 1, 99, 7, 12]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_kernels_equal_the_function_bodies(backend, case, monkeypatch):
    monkeypatch.setattr(state_kernels, "SSM_CHUNK", 2)  # Mamba-2's prompt in chunks: the state crosses them
    feeds, attrs, _ = state_op_cases()[case]
    op = op_of(case)
    want = _run_op(op, feeds, **attrs)
    b = make_backend(backend, None, dtype="f32")
    args = [b.asarray(v.numpy()) for v in feeds.values()]
    kernels = {contract.CONV_OP: b.causal_conv1d, contract.GDN_OP: b.gated_delta, contract.MAMBA_OP: b.selective_scan,
               contract.MAMBA2_OP: lambda *a: b.ssm_scan(*a, attrs.get("dt_min", 0.0), attrs.get("dt_max", 0.0))}
    got = kernels[op](*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(b.to_numpy(g), np.float32), w, atol=3e-5, rtol=1e-5)


def _greedy(sess: Session, n: int) -> tuple[list[int], list[np.ndarray]]:
    sess.reset(64)
    logits, tokens, seen = sess.prefill(PROMPT), [], []
    for _ in range(n):
        seen.append(sess.logits_to_numpy(logits))
        tokens.append(int(seen[-1].argmax()))
        logits = sess.decode(tokens[-1])
    return tokens, seen


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "granitemoehybrid"])
def test_mlx_tokens_equal_torch_and_onnxruntime(hybrid, model_type):
    model = hybrid(model_type, "opt")
    want = OrtRunner(model).greedy(PROMPT, 8).tokens
    for backend in ("torch", "mlx"):
        tokens, _ = _greedy(Session(model, backend=backend), 8)
        assert tokens == want, backend


def test_prompt_in_chunks_carries_the_state(hybrid):
    sess = Session(hybrid("granitemoehybrid", "opt"), backend="torch")
    whole_tokens, whole = _greedy(sess, 4)
    sess.reset(64)
    logits = sess.prefill(PROMPT, chunk=2)
    np.testing.assert_allclose(sess.logits_to_numpy(logits), whole[0], atol=2e-5, rtol=1e-5)
    saved = sess.state.snapshot()  # a step undone and run again gives the same logits
    first = sess.logits_to_numpy(sess.decode(whole_tokens[0]))
    sess.state.restore(saved)
    sess.pos -= 1
    np.testing.assert_array_equal(sess.logits_to_numpy(sess.decode(whole_tokens[0])), first)
    np.testing.assert_allclose(first, whole[1], atol=2e-5, rtol=1e-5)


def test_int8_kv_cache_keeps_the_state_float(hybrid):
    sess = Session(hybrid("qwen3_5_text", "opt"), backend="torch", kv_bits=8)
    tokens, _ = _greedy(sess, 3)
    assert len(tokens) == 3
    assert "int8" in sess.describe() and "recurrent state float32" in sess.describe()
    assert all(str(a.dtype) == "torch.float32" for a in sess.state.arrays.values())
