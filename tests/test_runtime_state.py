"""The runtime on recurrent-state hybrids: the state ops' kernels on every backend against their function bodies in
onnxruntime, a prompt's chunked kernels against the per-token recurrence, the session carrying the state across
prompt chunks and decode steps, the compiled decode step carrying it as the eager step does, MLX's greedy tokens
against torch's, and the state kept in float32 whatever the KV cache's format."""

from __future__ import annotations

import numpy as np
import pytest
from fuselm.runtime_metal.backends import make_backend, mlx_state, state_kernels
from fuselm.runtime_metal.backends.torch_backend import TorchBackend
from fuselm.runtime_metal.session import Decode, Session
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


def _spy(monkeypatch, module, name: str) -> list:
    """Count the calls of module.name (the chunked kernels: the test must see them run)."""
    calls, fn = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or fn(*a, **k))
    return calls


def _long_inputs(case: str, s: int = 150):
    """A prompt of `s` tokens for the gated delta rule (grouped heads, unit keys as the graph normalizes them) or
    Mamba-2, and a state from earlier tokens: three chunks of 64, the last one padded."""
    g = np.random.default_rng(1)
    r = lambda *shape, scale=1.0: (g.standard_normal(shape) * scale).astype(np.float32)  # noqa: E731
    if case == contract.GDN_OP:
        k = r(1, s, 2, 16)
        return [r(1, s, 2, 16, scale=0.25), k / np.linalg.norm(k, axis=-1, keepdims=True), r(1, s, 4, 12),
                -np.abs(r(1, s, 4, scale=0.3)), 1 / (1 + np.exp(-r(1, s, 4))), r(1, 4, 12, 16)]
    return [r(1, s, 4, 8), r(1, s, 4), r(4, scale=0.5), r(1, s, 2, 16), r(1, s, 2, 16), r(4), r(4), r(1, 4, 8, 16)]


def _per_token(b, case: str, args: list):
    """The recurrence one token at a time (each step the kernels' one-token path), outputs concatenated."""
    *seq, state = args
    ys = []
    for t in range(b.shape(seq[0])[1]):
        at = [x if len(b.shape(x)) == 1 else b.slice(x, (slice(None), slice(t, t + 1))) for x in seq]
        y, state = b.gated_delta(*at, state) if case == contract.GDN_OP else b.ssm_scan(*at, state, 0.0, 0.8)
        ys.append(np.asarray(b.to_numpy(y)))
    return np.concatenate(ys, 1), np.asarray(b.to_numpy(state))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", [contract.GDN_OP, contract.MAMBA2_OP])
def test_prompt_kernels_in_chunks_equal_the_per_token_recurrence(backend, case, monkeypatch):
    b = make_backend(backend, None, dtype="f32")
    owner = mlx_state if backend == "mlx" else state_kernels
    calls = _spy(monkeypatch, owner, "gated_delta_chunked" if case == contract.GDN_OP else
                 "ssm_chunked" if backend == "mlx" else "_ssm_chunks")
    args = [b.asarray(a) for a in _long_inputs(case)]
    y, state = b.gated_delta(*args) if case == contract.GDN_OP else b.ssm_scan(*args, 0.0, 0.8)
    assert calls == [1]
    want_y, want_state = _per_token(b, case, args)
    scale = max(1.0, float(np.abs(want_y).max()))
    np.testing.assert_allclose(np.asarray(b.to_numpy(y)), want_y, atol=3e-6 * scale, rtol=0)
    np.testing.assert_allclose(np.asarray(b.to_numpy(state)), want_state, atol=3e-6 * scale, rtol=0)


def test_chunked_gated_delta_equals_transformers():
    """state_kernels.gated_delta_chunked against transformers' torch_chunk_gated_delta_rule (its state [Dk, Dv])."""
    import torch
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    q, k, v, decay, beta, state = _long_inputs(contract.GDN_OP, 100)
    b = make_backend("torch", None, dtype="f32")
    t = [torch.from_numpy(x) for x in (q, k, v, decay, beta)]
    rep = [x.repeat_interleave(2, dim=2) for x in t[:2]]
    want_y, want_state = torch_chunk_gated_delta_rule(*rep, *t[2:], initial_state=torch.from_numpy(state).transpose(-1, -2),
                                                      output_final_state=True)
    y, got = state_kernels.gated_delta_chunked(b, *rep, *t[2:], torch.from_numpy(state))
    np.testing.assert_allclose(y.numpy(), want_y.numpy() * 16**0.5, atol=2e-5)  # (it scales q by Dk^-1/2 itself)
    np.testing.assert_allclose(got.numpy(), want_state.transpose(-1, -2).numpy(), atol=2e-5)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "granitemoehybrid"])
def test_long_prompt_in_chunks_equals_whole_and_per_token(hybrid, model_type):
    """40 tokens on MLX: whole (the chunked kernels), in pieces of 24 and 16 (chunked, the state carried between)
    and one token at a time (the recurrence's one-token step): the same logits and states."""
    sess = Session(hybrid(model_type, "opt"), backend="mlx")
    ids = [int(i) for i in np.random.default_rng(2).integers(3, 200, 40)]
    runs = []
    for chunk in (None, 24, 1):
        sess.reset(48)
        logits = sess.logits_to_numpy(sess.prefill(ids, chunk=chunk))
        runs.append((logits, [np.asarray(sess.backend.to_numpy(a)) for a in sess.state.values()]))
    for logits, states in runs[1:]:
        np.testing.assert_allclose(logits, runs[0][0], atol=5e-5 * max(1.0, np.abs(runs[0][0]).max()))
        for got, want in zip(states, runs[0][1], strict=True):
            np.testing.assert_allclose(got, want, atol=5e-5 * max(1.0, np.abs(want).max()))


@pytest.fixture
def step_as_is(monkeypatch):
    """torch's compile_step as the step itself (inductor on CPU takes minutes): the compiled path, its inputs and
    outputs and its check run as under a real compiler."""
    monkeypatch.setattr(TorchBackend, "compile_step", lambda self, fn, args, n: (fn, "the step uncompiled (test)"))


@pytest.mark.parametrize("backend", ["torch", "mlx"])
@pytest.mark.parametrize("model_type", ["qwen3_5_text", "granitemoehybrid"])
def test_compiled_step_carries_the_states(hybrid, model_type, backend, step_as_is):
    """The compiled decode step (torch: CompiledDecode; MLX: PiecewiseDecode, mx.compile) takes the past states and
    gives the presents: every step's logits as the eager static step's."""
    model = hybrid(model_type, "opt")
    _, eager = _greedy(Session(model, backend=backend, compile=False), 6)
    sess = Session(model, backend=backend, compile=True)
    _, compiled = _greedy(sess, 6)
    assert sess.mode is Decode.COMPILED and sess.compile_failed is None, sess.describe()
    np.testing.assert_allclose(compiled, eager, atol=2e-5 * np.abs(eager).max())


def test_compiled_step_with_other_states_is_refused(hybrid, monkeypatch):
    """A compiled step whose logits agree but whose present states do not is not kept."""

    def off(self, fn, args, n):
        def step(*a):
            out = fn(*a)
            return (*out[:2], *[s + 1.0 for s in out[2:n]], *out[n:])
        return step, "states off by one"

    monkeypatch.setattr(TorchBackend, "compile_step", off)
    model = hybrid("granitemoehybrid", "opt")
    sess = Session(model, backend="torch", compile=True)
    tokens, _ = _greedy(sess, 4)
    assert sess.mode is Decode.STATIC and "recurrent states differ from the eager step's" in sess.describe()
    assert tokens == _greedy(Session(model, backend="torch", compile=False), 4)[0]
