"""Compiled static-shape decode: the per-token plan as one compiled function.

Static-shape decode runs the same plan every token (kvcache.py), so it can be captured once. The
step takes the token and its position; the attention mask and position_ids are computed from the
position on the device, so no host array crosses over per token. The backend compiles it
(`Backend.compile_step`): MLX mx.compile (KV buffers in and out), torch make_fx + inductor and a
CUDA graph on CUDA (runtime_metal/backends/torch_compile.py; KV buffers written in place).

The first compiled step is checked against the eager step (same inputs) before it is used.
"""

from __future__ import annotations

import time

import numpy as np

from fuselm import contract

from .kvcache import CacheView

N_INPUTS = 2  # token ids [1, 1] and the position (a 0-d integer); the KV buffers follow


def static_feeds(b, ids, pos, max_len: int, first: str = contract.INPUT_IDS) -> dict:
    """The graph's small inputs for one static decode step at 0-d device position `pos`; `ids` goes to
    `first` (a pipeline stage's hidden state: contract.HIDDEN)."""
    mask = b.cast(b.binary("less_equal", b.reshape(b.arange(0, max_len, 1, 7), (1, max_len)), b.cast(pos, 7)), 7)
    return {first: ids, contract.ATTENTION_MASK: mask,
            contract.POSITION_IDS: b.reshape(b.cast(pos, 7), (1, 1))}


class CompiledDecode:
    """The static decode plan of `sess` for one cache length as one compiled step."""

    def __init__(self, sess, plan, max_len: int):
        self.sess, self.plan, self.max_len = sess, plan, max_len
        self.names = [c.name for c in sess.caches]
        self.seconds = 0.0
        self.fn = None
        self.what = ""

    def _step(self, ids, pos, *bufs):
        sess = self.sess
        views = {n: CacheView(buf, pos, 1, static=True) for n, buf in zip(self.names, bufs, strict=True)}
        sess.executor.ctx["rope_offset"] = pos
        sess.executor.ctx["all_logits"] = False
        feeds = {**static_feeds(sess.backend, ids, pos, self.max_len, sess.first_input), **views}
        out = sess.executor._execute(self.plan, feeds)
        # the next position, on the device: no host array crosses over per token
        nxt = sess.backend.binary("add", pos, sess.backend.full((), 1, sess.backend.dtype(pos)))
        return (out[sess.output], nxt, *[views[n].buffer for n in self.names])

    def build(self, args: tuple) -> None:
        t0 = time.perf_counter()
        self.fn, self.what = self.sess.backend.compile_step(self._step, args, N_INPUTS)
        self.seconds = time.perf_counter() - t0

    def __call__(self, ids, pos, bufs: list):
        """One decode step; returns (logits, the next position as a device array, new buffers)."""
        out = self.fn(ids, pos, *bufs)
        return out[0], out[1], list(out[2:])


def agrees(backend, a, b, tol: float = 1e-3) -> bool:
    """Same logits up to `tol` of their largest magnitude (at least 1), and the same argmax."""
    x = np.asarray(backend.to_numpy(a), np.float64).reshape(-1)
    y = np.asarray(backend.to_numpy(b), np.float64).reshape(-1)
    close = np.allclose(x, y, atol=tol * max(1.0, float(np.abs(x).max())), rtol=0)
    return bool(close and np.argmax(x) == np.argmax(y))


__all__ = ["CompiledDecode", "agrees", "static_feeds", "N_INPUTS"]
