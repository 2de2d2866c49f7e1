"""MLX's fused ops counted as the one kernel each is on a GPU, on MLX's CPU backend (bench/mlx_peer.py, the kernel
count test): `fused_ops_as_one` swaps them for one-primitive stand-ins, `standin_kernels` counts a graph built so."""

from __future__ import annotations

import contextlib

import mlx.core as mx
import numpy as np
from fuselm.runtime_metal.backends.mlx_backend import _INTEGER as INTEGER
from fuselm.runtime_metal.backends.mlx_backend import graph_kernels

# the stand-in's primitive -> (the fused op it counts as, whether a Concatenate of its inputs comes with it)
_STANDINS = {"Softmax": ("RMSNorm", 0), "Partition": ("LayerNorm", 0), "CumMax": ("RoPE", 0),
             "CumLogAddExp": ("ScaledDotProductAttention", 1), "CumMin": ("Dequantize", 1)}


@contextlib.contextmanager
def fused_ops_as_one():
    """Count MLX's fused ops as the one kernel each is on a GPU. MLX's CPU backend runs mx.fast.* and
    mx.dequantize as unfused fallbacks (a dozen primitives each), so a count made there overstates what a
    Mac or CUDA launches; inside this block each call is one primitive instead: a sort or scan of its
    input, or of a Concatenate of everything it reads (so the kernels making its inputs still count),
    cut to the output's shape; the norms' stand-in is a softmax (it normalizes), so the values, wrong,
    stay bounded over any number of layers and the session decides its modes as usual. For counting
    only, on a model built inside the block; `standin_kernels` relabels the stand-ins
    (a softmax the graph has of its own, as the 8-bit cache's attention, is counted as RMSNorm there)."""
    def one(fn, first, *rest, shape):
        size = int(np.prod(shape))
        if not rest and first.size == size:
            return fn(first)
        # the output's values come from the float inputs; integer ones (packed weights) are only read
        floats = [a for a in (first, *rest) if isinstance(a, mx.array) and a.dtype not in INTEGER]
        ints = [a.reshape(-1).view(mx.float32) for a in (first, *rest)
                if isinstance(a, mx.array) and a.dtype in (mx.uint32, mx.int32)]
        flat = [a.reshape(-1).astype(mx.float32) if a.dtype != mx.float32 else a.reshape(-1) for a in floats]
        n = sum(a.size for a in flat)
        pad = [mx.broadcast_to(mx.array(0.0), (size - n,))] if n < size else []
        return fn(mx.concatenate(flat + pad + ints)[:size].reshape(shape))

    def scan(f):
        return lambda x: f(x, axis=-1)

    standins = {
        (mx.fast, "rms_norm"): lambda x, *a, **k: one(lambda y: mx.softmax(y, axis=-1), x, shape=x.shape),
        (mx.fast, "layer_norm"): lambda x, *a, **k: one(lambda y: mx.partition(y, 0), x, shape=x.shape),
        (mx.fast, "rope"): lambda x, *a, **k: one(scan(mx.cummax), x, shape=x.shape),
        (mx.fast, "scaled_dot_product_attention"): lambda q, k, v, *a, mask=None, **kw: one(
            scan(mx.logcumsumexp), q, k, v, *([mask] if isinstance(mask, mx.array) else []),
            shape=(*q.shape[:-1], v.shape[-1])),
        (mx, "dequantize"): lambda w, scales, biases=None, *a, **k: one(
            scan(mx.cummin), scales, biases, w, shape=(*w.shape[:-1], w.shape[-1] * 32 // k.get("bits", 4))),
    }
    saved = {key: getattr(*key) for key in standins}
    for (mod, name), fn in standins.items():
        setattr(mod, name, fn)
    try:
        yield
    finally:
        for (mod, name), fn in saved.items():
            setattr(mod, name, fn)


def standin_kernels(outputs: list) -> dict:
    """graph_kernels of a graph built inside `fused_ops_as_one`, its stand-ins counted as the fused ops."""
    counts = graph_kernels(outputs)
    by = dict(counts["top"])
    for label, (name, concat) in _STANDINS.items():
        n = by.pop(label, 0)
        by["Concatenate"] = by.get("Concatenate", 0) - n * concat
        by[name] = by.get(name, 0) + n
    by = {k: v for k, v in by.items() if v}
    return {**counts, "kernels": sum(by.values()), "top": sorted(by.items(), key=lambda kv: -kv[1])}
