"""Compiled static-shape decode: the per-token plan as one compiled function.

Static-shape decode runs the same plan every token (kvcache.py), so it can be captured once:
- torch: the plan is traced to an aten-level FX graph (make_fx; host shape work is already
  constants) and compiled by inductor (torch._inductor.compile: CPU fused C++ loops around the
  matmul kernels, CUDA Triton kernels). The KV
  buffers are graph inputs written in place. On CUDA the compiled step is then captured in a CUDA
  graph (torch.cuda.CUDAGraph) over static input tensors and replayed each token: one launch per
  token. (inductor's own mode="reduce-overhead" refuses graphs that mutate their inputs.)
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
        self.what = "mx.compile" if sess.backend.name == "mlx" else ""

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
            import torch._inductor
            from torch.fx.experimental.proxy_tensor import make_fx

            def traced(*a):  # logits only: buffers are written in place
                return self._step(*a)[0]

            gm = make_fx(traced)(*args)
            try:  # inductor straight on the aten graph: no dynamo between us and the compiler
                self.fn = torch._inductor.compile(gm, list(args))
                self.what = "inductor"
            except Exception as e:  # noqa: BLE001 - on CUDA the graph capture alone still pays off
                if not b.device.startswith("cuda"):
                    raise
                self.fn, self.what = gm, f"aten graph (inductor failed: {type(e).__name__})"
            if b.device.startswith("cuda"):
                self.fn = _CudaGraph(self.fn, args)
                self.what += " + CUDA graph"
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


class _CudaGraph:
    """Replays `fn` captured once over static copies of its inputs (the KV buffers are used as they are:
    their addresses never change)."""

    def __init__(self, fn, args: tuple):
        import torch

        n_small = 4  # ids, mask, positions, pos are copied in; the KV buffers are the graph's own
        self.fn = fn
        self.static = [a.clone() for a in args[:n_small]] + list(args[n_small:])
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: compile, autotune, allocate outside the capture
                fn(*self.static)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = fn(*self.static)

    def __call__(self, *args):
        for dst, src in zip(self.static[:4], args[:4], strict=True):
            dst.copy_(src, non_blocking=True)
        self.graph.replay()
        return self.out.clone()


def agrees(backend, a, b, tol: float = 1e-3) -> bool:
    """Same logits up to `tol` of their largest magnitude (at least 1), and the same argmax."""
    x = np.asarray(backend.to_numpy(a), np.float64).reshape(-1)
    y = np.asarray(backend.to_numpy(b), np.float64).reshape(-1)
    close = np.allclose(x, y, atol=tol * max(1.0, float(np.abs(x).max())), rtol=0)
    return bool(close and np.argmax(x) == np.argmax(y))


__all__ = ["CompiledDecode", "agrees", "_log"]
