"""numpy on the host: evaluates shape subgraphs and constants once per input shape, never per token; and
`--backend numpy`, the host reference (f32 on the CPU, every op in plain numpy, the 8-bit cache
dequantized per block): slow, for checking the other backends."""

from __future__ import annotations

import numpy as np

from ..loader import NP_DTYPES, ONNX_OF_NP
from .base import Backend, QuantizedWeight


def _erf(x):
    import math

    return np.vectorize(math.erf, otypes=[x.dtype])(x)


def _div(a, b):
    if np.issubdtype(np.result_type(a, b), np.integer):
        return np.trunc(np.true_divide(a, b)).astype(np.result_type(a, b))
    return np.true_divide(a, b)


_UNARY = {
    "neg": np.negative, "abs": np.abs, "exp": np.exp, "log": np.log, "sqrt": np.sqrt,
    "reciprocal": np.reciprocal, "sin": np.sin, "cos": np.cos, "tan": np.tan, "tanh": np.tanh,
    "sigmoid": lambda x: (1.0 / (1.0 + np.exp(-x))).astype(x.dtype), "erf": _erf,
    "relu": lambda x: np.maximum(x, 0).astype(x.dtype), "floor": np.floor, "ceil": np.ceil, "round": np.round,
    "sign": np.sign, "not": np.logical_not, "isnan": np.isnan, "isinf": np.isinf, "asin": np.arcsin,
    "acos": np.arccos, "atan": np.arctan, "sinh": np.sinh, "cosh": np.cosh, "asinh": np.arcsinh,
    "acosh": np.arccosh, "atanh": np.arctanh, "softplus": lambda x: np.log1p(np.exp(x)).astype(x.dtype),
    "bitwise_not": np.invert,
}
_BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": _div,
    "pow": lambda a, b: np.power(a, b).astype(a.dtype), "max": np.maximum, "min": np.minimum,
    "mod": np.mod, "fmod": np.fmod, "equal": np.equal, "less": np.less, "less_equal": np.less_equal,
    "greater": np.greater, "greater_equal": np.greater_equal, "and": np.logical_and, "or": np.logical_or,
    "xor": np.logical_xor, "bitwise_and": np.bitwise_and, "bitwise_or": np.bitwise_or,
    "bitwise_xor": np.bitwise_xor,
}
_SCATTER = {"none": None, "add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


class NumpyBackend(Backend):
    name = "numpy"
    device = "host"

    def asarray(self, value):
        return np.asarray(value)

    def to_numpy(self, x):
        return np.asarray(x)

    def dtype(self, x):
        return ONNX_OF_NP[np.asarray(x).dtype]

    def cast(self, x, to):
        return np.asarray(x).astype(NP_DTYPES[to])

    def full(self, shape, value, to):
        return np.full(shape, value, NP_DTYPES[to])

    def arange(self, start, limit, delta, to):
        return np.arange(start, limit, delta).astype(NP_DTYPES[to])

    def unary(self, op, x):
        return np.asarray(_UNARY[op](x))

    def binary(self, op, a, b):
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return np.asarray(_BINARY[op](a, b))

    def where(self, cond, a, b):
        return np.where(cond, a, b)

    def reduce(self, op, x, axes, keepdims):
        fn = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "prod": np.prod}[op]
        return np.asarray(fn(x, axis=axes, keepdims=keepdims)).astype(x.dtype)

    def arg_reduce(self, op, x, axis, keepdims):
        out = (np.argmax if op == "max" else np.argmin)(x, axis=axis).astype(np.int64)
        return np.expand_dims(out, axis) if keepdims else out

    def matmul(self, a, b):
        return np.matmul(a, b)

    def softmax(self, x, axis, log=False):
        m = x - x.max(axis=axis, keepdims=True)
        e = np.exp(m)
        s = e.sum(axis=axis, keepdims=True)
        return (m - np.log(s)).astype(x.dtype) if log else (e / s).astype(x.dtype)

    def cumsum(self, x, axis, exclusive, reverse):
        if reverse:
            x = np.flip(x, axis)
        out = np.cumsum(x, axis=axis, dtype=x.dtype)
        if exclusive:
            out = out - x
        return np.flip(out, axis) if reverse else out

    def topk(self, x, k, axis, largest, sorted_):
        order = np.argsort(-x if largest else x, axis=axis, kind="stable")
        idx = np.take(order, np.arange(k), axis=axis)
        return np.take_along_axis(x, idx, axis), idx.astype(np.int64)

    def reshape(self, x, shape):
        return np.reshape(x, shape)

    def transpose(self, x, perm):
        return np.transpose(x, perm)

    def slice(self, x, index):
        return np.asarray(x)[index]

    def concat(self, xs, axis):
        return np.concatenate(xs, axis=axis)

    def expand(self, x, shape):
        return np.broadcast_to(x, shape)

    def tile(self, x, reps):
        return np.tile(x, reps)

    def pad(self, x, pads, mode, value):
        if mode == "constant":
            return np.pad(x, pads, mode="constant", constant_values=value)
        return np.pad(x, pads, mode={"reflect": "reflect", "edge": "edge", "wrap": "wrap"}[mode])

    def gather(self, x, idx, axis):
        return np.take(x, idx, axis=axis)

    def gather_elements(self, x, idx, axis):
        return np.take_along_axis(x, idx, axis)

    def scatter_elements(self, x, idx, updates, axis, reduction):
        full_idx = list(np.indices(idx.shape))
        full_idx[axis] = idx
        return self._scatter(x, tuple(full_idx), updates, reduction)

    def scatter_nd(self, x, idx, updates, reduction):
        return self._scatter(x, tuple(np.moveaxis(idx, -1, 0)), updates, reduction)

    @staticmethod
    def _scatter(x, key: tuple, updates, reduction: str):
        """A copy of x with updates written (or reduced, ufunc.at: repeated indices accumulate) at `key`."""
        out = np.array(x, copy=True)
        if _SCATTER[reduction] is None:
            out[key] = updates
        else:
            _SCATTER[reduction].at(out, key, updates)
        return out

    def rms_norm(self, x, weight, eps):
        xf = x.astype(np.float32)
        y = xf / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + eps)
        return (y * weight).astype(x.dtype)

    def layer_norm(self, x, weight, bias, eps):
        xf = x.astype(np.float32)
        mu = xf.mean(axis=-1, keepdims=True)
        y = (xf - mu) / np.sqrt(((xf - mu) ** 2).mean(axis=-1, keepdims=True) + eps) * weight
        return (y + bias if bias is not None else y).astype(x.dtype)

    def rope(self, x, position_ids, inv_freq, attention_scaling, interleaved, offset=None):
        rd = 2 * len(inv_freq)
        freqs = position_ids.astype(np.float32)[..., None] * np.asarray(inv_freq, np.float32)  # [B,S,rd/2]
        cos = (np.cos(freqs) * attention_scaling)[:, :, None, :]
        sin = (np.sin(freqs) * attention_scaling)[:, :, None, :]
        xr, xp = x[..., :rd], x[..., rd:]
        if interleaved:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            y = np.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(xr.shape)
        else:
            x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
            y = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return np.concatenate([y.astype(x.dtype), xp], axis=-1)

    def sdpa(self, q, k, v, mask, scale):
        rep = q.shape[1] // k.shape[1]
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
        if mask is not None:
            s = np.where(mask, s, -np.inf) if mask.dtype == np.bool_ else s + mask
        return np.matmul(self.softmax(s, -1), v).astype(q.dtype)

    def expert_matmul(self, x, w, experts):
        w = w.data if isinstance(w, QuantizedWeight) else w
        t, k = experts.shape
        xs = np.broadcast_to(x[:, None, :], (t, k, x.shape[-1])) if x.ndim == 2 else x
        out = np.empty((t, k, w.shape[1]), np.result_type(x.dtype, w.dtype))
        for e in np.unique(experts):  # grouped by expert: one matmul over every (token, slot) it serves
            rows, slots = np.nonzero(experts == e)
            out[rows, slots] = xs[rows, slots] @ w[e].T
        return out

    def cache_write(self, buffer, new, pos):
        buffer[:, :, int(pos):int(pos) + new.shape[2]] = new
        return buffer

    def host_int(self, pos):
        return int(pos)
