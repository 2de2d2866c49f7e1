"""Compiled static-shape decode: the per-token plan as one compiled function.

Static-shape decode runs the same plan every token (kvcache.py), so it can be captured once:
- torch: the plan is traced to an aten-level FX graph (make_fx; host shape work is already
  constants) and compiled by inductor (CPU: fused C++ loops around the matmul kernels; CUDA:
  mode="reduce-overhead", i.e. CUDA graphs). The KV buffers are graph inputs written in place.
- MLX: mx.compile of the same function, KV buffers in and out.

The first compiled step is checked against the eager step (same inputs) before it is used.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from .kvcache import CacheView

_log = logging.getLogger("fuselm.runtime")


class CompiledDecode:
    """Wraps the static decode plan of `sess` (which must exist) as one compiled step."""

    def __init__(self, sess, plan):
        self.sess = sess
        self.plan = plan
        self.names = [c.name for c in sess.caches]
        self.seconds = 0.0
        self.fn = None

    def _step(self, ids, mask, positions, pos, *bufs):
        sess = self.sess
        views = {n: CacheView(buf, pos, 1, static=True) for n, buf in zip(self.names, bufs, strict=True)}
        sess.executor.ctx["rope_offset"] = pos
        out = sess.executor._execute(self.plan, {"input_ids": ids, "attention_mask": mask, "position_ids": positions,
                                                 **views})
        return (out["logits"], *[views[n].buffer for n in self.names])

    def build(self, args: tuple) -> None:
        t0 = time.perf_counter()
        b = self.sess.backend
        if b.name == "torch":
            import torch
            from torch.fx.experimental.proxy_tensor import make_fx

            def traced(*a):  # logits only: buffers are written in place
                return self._step(*a)[0]

            gm = make_fx(traced)(*args)
            mode = "reduce-overhead" if b.device.startswith("cuda") else None
            self.fn = torch.compile(gm, dynamic=False, mode=mode, fullgraph=True)
        else:
            import mlx.core as mx

            self.fn = mx.compile(self._step)
        self.seconds = time.perf_counter() - t0

    def __call__(self, ids, mask, positions, pos, bufs: list):
        """One decode step; returns (logits, new buffers)."""
        b = self.sess.backend
        if b.name == "torch":
            logits = self.fn(ids, mask, positions, pos, *bufs)
            return logits, bufs
        out = self.fn(ids, mask, positions, pos, *bufs)
        return out[0], list(out[1:])


def agrees(backend, a, b, scale_floor: float = 1.0) -> bool:
    x = np.asarray(backend.to_numpy(a), np.float64)
    y = np.asarray(backend.to_numpy(b), np.float64)
    return bool(np.allclose(x, y, atol=1e-3 * max(scale_floor, float(np.abs(x).max())), rtol=0))


__all__ = ["CompiledDecode", "agrees", "_log"]
