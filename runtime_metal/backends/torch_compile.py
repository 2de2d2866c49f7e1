"""The static decode step compiled for torch: make_fx to an aten graph, inductor, and on CUDA one
CUDA graph replayed per token.

The step's host shape work is already constants (executor plans), so make_fx traces only device
ops; inductor compiles that graph straight (no dynamo between us and the compiler): on CPU fused
C++ loops around the matmul kernels, on CUDA Triton kernels. The KV buffers are graph inputs
written in place. inductor's own mode="reduce-overhead" refuses graphs that mutate their inputs, so
the CUDA graph is captured here.
"""

from __future__ import annotations

import torch


def compile_step(fn, args: tuple, n_inputs: int, cuda: bool):
    import torch._inductor
    from torch.fx.experimental.proxy_tensor import make_fx

    def traced(*a):  # logits, the next position and the present states: buffers are written in place
        return fn(*a)[:n_inputs]

    gm = make_fx(traced)(*args)
    try:
        compiled, what = torch._inductor.compile(gm, list(args)), "inductor"
    except Exception as e:  # noqa: BLE001 - on CUDA the graph capture alone still pays off
        if not cuda:
            raise
        compiled, what = gm, f"aten graph (inductor failed: {type(e).__name__})"
    if cuda:
        compiled = CudaGraph(compiled, args, n_inputs)
        what += " + CUDA graph"

    def step(*a):
        return (*compiled(*a), *a[n_inputs:])

    step.inner = compiled
    return step, what


class CudaGraph:
    """Replays `fn` captured once over static copies of its small inputs (the KV buffers are used as
    they are: their addresses never change)."""

    def __init__(self, fn, args: tuple, n_inputs: int):
        self.fn, self.n = fn, n_inputs
        self.static = [a.clone() for a in args[:n_inputs]] + list(args[n_inputs:])
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
        for dst, src in zip(self.static[:self.n], args[:self.n], strict=True):
            dst.copy_(src, non_blocking=True)
        self.graph.replay()
        return tuple(o.clone() for o in self.out)
