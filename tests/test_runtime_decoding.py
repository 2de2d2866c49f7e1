"""Decode strategies (runtime_metal/decoding.py): the strategy each step runs is chosen in one place, and
`describe()` tells what ran: a sliding window shorter than the cache goes dynamic and says why, the
profiler times the eager static step, a compiled step is per cache length and its failures are reported.
Tokens and logits are the same whatever ran, checked against the numpy backend (the host reference)."""

from __future__ import annotations

import numpy as np
import pytest
from fuselm.runtime_metal.backends.torch_backend import TorchBackend
from fuselm.runtime_metal.session import Decode, Session

IDS = [3, 9, 4, 7, 1]


def _greedy(sess, ids, n, max_len=None):
    """Prefill `ids`, then n - 1 greedy decode steps: every step's logits."""
    sess.reset(max_len or len(ids) + n)
    out = [sess.logits_to_numpy(sess.prefill(ids))]
    for _ in range(n - 1):
        out.append(sess.logits_to_numpy(sess.decode(int(np.argmax(out[-1])))))
    return np.stack(out)


def _same(got, want):
    assert [int(np.argmax(r)) for r in got] == [int(np.argmax(r)) for r in want]
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())


@pytest.fixture
def eager_compile(monkeypatch):
    """torch's compile_step as the step itself (inductor on CPU takes minutes): the compiled path, its
    per-length steps and its check run as they do under a real compiler."""
    monkeypatch.setattr(TorchBackend, "compile_step", lambda self, fn, args, n: (fn, "the step uncompiled (test)"))


def test_window_shorter_than_the_cache_decodes_dynamic_and_says_why(optimized):
    model = optimized("mistral", "f32", sliding_window=4)
    sess = Session(model, backend="torch")
    got = _greedy(sess, IDS, 6)  # an 11-token cache, a 4-token window
    assert sess.mode is Decode.DYNAMIC and not sess.static_decode
    assert "dynamic decode (the sliding window of 4 tokens is shorter than the cache (11)" in sess.describe()
    assert "static-shape" not in sess.describe()
    _same(got, _greedy(Session(model, backend="numpy"), IDS, 6))
    short = _greedy(sess, [3, 9], 2)  # a 3-token cache fits in the window: static shapes from the check on
    assert sess.static_checked and "static-shape decode, checked against dynamic decode" in sess.describe()
    _same(short, _greedy(Session(model, backend="numpy"), [3, 9], 2))


def test_tokens_are_the_same_whatever_strategy_ran(optimized, eager_compile):
    model = optimized("qwen3", "f32")
    want = _greedy(Session(model, backend="numpy"), IDS, 6)
    runs = {"dynamic": Session(model, backend="torch", static_decode=False),
            "static": Session(model, backend="torch", compile=False),
            "compiled": Session(model, backend="torch", compile=True)}
    for sess in runs.values():
        _same(_greedy(sess, IDS, 6), want)
    assert "dynamic decode (static-shape decode is off)" in runs["dynamic"].describe()
    assert runs["static"].mode is Decode.STATIC and "compile" not in runs["static"].describe()
    assert runs["compiled"].mode is Decode.COMPILED
    assert "static-shape decode, compiled: the step uncompiled (test)" in runs["compiled"].describe()


def test_profiling_reports_the_eager_static_step(optimized, eager_compile):
    sess = Session(optimized("qwen3", "f32"), backend="torch", compile=True)
    sess.reset(12)
    sess.prefill(IDS)
    for t in range(3):
        sess.decode(t)
    assert sess.mode is Decode.COMPILED
    sess.profiler.enabled = True
    sess.decode(4)
    assert sess.mode is Decode.STATIC and "eager while the profiler times its ops" in sess.describe()
    assert sess.profiler.times.get("Attention", [0])[0] == 2  # the two layers' Attention ops, timed one by one
    sess.profiler.enabled = False
    sess.decode(5)
    assert sess.mode is Decode.COMPILED and sess.profiler.times["Attention"][0] == 2


def test_a_compiled_step_per_cache_length(optimized, eager_compile):
    sess = Session(optimized("qwen3", "f32"), backend="torch", compile=True)
    _greedy(sess, IDS, 4)
    assert sess.mode is Decode.COMPILED and set(sess.decoding.compiled) == {9}
    sess.reset(7)
    sess.prefill(IDS)
    sess.decode(1)  # no compiled step for 7 rows: the eager static step runs and one is built from it
    assert sess.mode is Decode.STATIC and sess.compiled is not None and "run eagerly while its compiled step was built" in sess.describe()
    sess.decode(2)
    assert sess.mode is Decode.COMPILED and set(sess.decoding.compiled) == {7, 9}


def test_compile_failures_are_reported(optimized, monkeypatch):
    model = optimized("qwen3", "f32")

    def broken(self, fn, args, n):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(TorchBackend, "compile_step", broken)
    sess = Session(model, backend="torch", compile=True)
    _same(_greedy(sess, IDS, 4), _greedy(Session(model, backend="numpy"), IDS, 4))
    assert sess.mode is Decode.STATIC and sess.compiled is None
    assert sess.compile_failed == "RuntimeError: no compiler here"
    assert "static-shape decode, compile failed (RuntimeError: no compiler here)" in sess.describe()

    def wrong(self, fn, args, n):  # a step whose logits are off
        return (lambda *a: (lambda out: (out[0] + 1.0, *out[1:]))(fn(*a))), "off by one"

    monkeypatch.setattr(TorchBackend, "compile_step", wrong)
    sess = Session(model, backend="torch", compile=True)
    _greedy(sess, IDS, 4)
    assert sess.mode is Decode.STATIC and "compiled logits differ from the eager step by 1" in sess.describe()


def test_a_check_that_disagrees_keeps_dynamic_decode(optimized, monkeypatch):
    """Nothing is within a negative tolerance: the first static step is refused, its cache rows and logits
    are the dynamic step's, and every step after it runs dynamic."""
    model = optimized("qwen3", "f32")
    monkeypatch.setattr(TorchBackend, "drift_tolerance", lambda self, weights: -1.0)
    sess = Session(model, backend="torch", compile=False)
    _same(_greedy(sess, IDS, 5), _greedy(Session(model, backend="numpy"), IDS, 5))
    assert sess.mode is Decode.DYNAMIC and not sess.static_decode
    assert "dynamic decode (static-shape decode differed from it by" in sess.describe()
