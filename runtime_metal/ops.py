"""The op table: one function per ONNX op, named like the op, attributes as keyword defaults.

Every function takes the backend first and the node's inputs after it (None for an omitted
optional input) and returns one array or a tuple. Inputs listed in `host_inputs` arrive as
numpy arrays (shapes, axes, sizes): the executor evaluates them on the host once per input
shape. The neural-network ops (norms, attention, RoPE, quantized matmul) live in ops_nn.py and
register into the same table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from fuselm.errors import FuselmError

from .loader import NP_DTYPES, ONNX_OF_NP


@dataclass(frozen=True)
class OpSpec:
    """How the executor calls an op function."""

    fn: Callable
    host_inputs: tuple[int, ...] = ()
    shape_only: bool = False  # result depends only on input shapes (Shape, Size)
    wants_outputs: bool = False  # gets `_n_outputs=` (Split without sizes, Attention)
    wants_context: bool = False  # gets `_ctx=` (run-wide hints such as contiguous positions)
    fused: bool = False  # a fused kernel; `no_fused_kernels` runs `unfused` or the function body
    unfused: Callable | None = None


OPS: dict[tuple[str, str], OpSpec] = {}


def op(*names: str, domain: str = "", **flags):
    """Register the decorated function for the ONNX op(s) `names` in `domain`."""

    def deco(fn):
        for name in names:
            OPS[(domain, name)] = OpSpec(fn, **flags)
        return fn

    return deco


def ints(v) -> list[int]:
    return [int(i) for i in np.asarray(v).reshape(-1)]


def _axis(axis: int, rank: int, end: bool = False) -> int:
    """A possibly negative axis as an index; `end`: `rank` itself is allowed too (Flatten)."""
    if not -rank <= axis < rank + end:  # out of range: a damaged graph (onnxruntime refuses it too)
        raise FuselmError(f"axis {axis} is out of range for a tensor of rank {rank}; the graph is invalid")
    return axis + rank if axis < 0 else axis


# --- elementwise ----------------------------------------------------------------------
for _name, _prim in {
    "Neg": "neg", "Abs": "abs", "Exp": "exp", "Log": "log", "Sqrt": "sqrt", "Reciprocal": "reciprocal",
    "Sin": "sin", "Cos": "cos", "Tan": "tan", "Tanh": "tanh", "Sigmoid": "sigmoid", "Erf": "erf",
    "Relu": "relu", "Floor": "floor", "Ceil": "ceil", "Round": "round", "Sign": "sign", "Not": "not",
    "IsNaN": "isnan", "Asin": "asin", "Acos": "acos", "Atan": "atan", "Sinh": "sinh", "Cosh": "cosh",
    "Asinh": "asinh", "Acosh": "acosh", "Atanh": "atanh", "Softplus": "softplus", "BitwiseNot": "bitwise_not",
}.items():
    op(_name)(lambda b, x, *, _prim=_prim: b.unary(_prim, x))

for _name, _prim in {
    "Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Pow": "pow", "Equal": "equal", "Less": "less",
    "LessOrEqual": "less_equal", "Greater": "greater", "GreaterOrEqual": "greater_equal", "And": "and",
    "Or": "or", "Xor": "xor", "BitwiseAnd": "bitwise_and", "BitwiseOr": "bitwise_or", "BitwiseXor": "bitwise_xor",
}.items():
    op(_name)(lambda b, x, y, *, _prim=_prim: b.binary(_prim, x, y))


def _variadic(name: str, prim: str, mean: bool = False):
    def fn(b, *xs):
        out = xs[0]
        for x in xs[1:]:
            out = b.binary(prim, out, x)
        return b.binary("div", out, _scalar(b, out, len(xs))) if mean and len(xs) > 1 else out

    op(name)(fn)


_variadic("Max", "max")
_variadic("Min", "min")
_variadic("Sum", "add")
_variadic("Mean", "add", mean=True)


@op("Mod")
def Mod(b, a, c, *, fmod=0):
    return b.binary("fmod" if fmod else "mod", a, c)


@op("IsInf")
def IsInf(b, x, *, detect_negative=1, detect_positive=1):
    inf = b.unary("isinf", x)
    if detect_negative and detect_positive:
        return inf
    side = b.binary("greater" if detect_positive else "less", x, _scalar(b, x, 0))
    return b.binary("and", inf, side)


@op("Identity")
def Identity(b, x):
    return x


@op("Where")
def Where(b, cond, x, y):
    return b.where(cond, x, y)


@op("Cast")
def Cast(b, x, *, to, saturate=1, round_mode="up"):
    return b.cast(x, to)


@op("CastLike")
def CastLike(b, x, like, *, saturate=1, round_mode="up"):
    return b.cast(x, b.dtype(like))


@op("Clip")
def Clip(b, x, lo=None, hi=None, *, min=None, max=None):  # noqa: A002 - ONNX attribute names (opset < 11)
    lo = lo if lo is not None else (None if min is None else _scalar(b, x, min))
    hi = hi if hi is not None else (None if max is None else _scalar(b, x, max))
    if lo is not None:
        x = b.binary("max", x, lo)
    if hi is not None:
        x = b.binary("min", x, hi)
    return x


def _scalar(b, x, value):
    return b.asarray(np.array(value, NP_DTYPES[b.dtype(x)]))


@op("LeakyRelu")
def LeakyRelu(b, x, *, alpha=0.01):
    return b.where(b.binary("less", x, _scalar(b, x, 0)), b.binary("mul", x, _scalar(b, x, alpha)), x)


@op("Elu")
def Elu(b, x, *, alpha=1.0):
    neg = b.binary("mul", b.binary("sub", b.unary("exp", x), _scalar(b, x, 1)), _scalar(b, x, alpha))
    return b.where(b.binary("less", x, _scalar(b, x, 0)), neg, x)


@op("HardSigmoid")
def HardSigmoid(b, x, *, alpha=0.2, beta=0.5):
    y = b.binary("add", b.binary("mul", x, _scalar(b, x, alpha)), _scalar(b, x, beta))
    return b.binary("min", b.binary("max", y, _scalar(b, x, 0)), _scalar(b, x, 1))


@op("HardSwish")
def HardSwish(b, x):
    return b.binary("mul", x, HardSigmoid(b, x, alpha=1 / 6, beta=0.5))


@op("Gelu")
def Gelu(b, x, *, approximate="none"):
    if approximate == "tanh":
        inner = b.binary("mul", b.binary("add", x, b.binary("mul", b.binary("pow", x, _scalar(b, x, 3)),
                                                               _scalar(b, x, 0.044715))),
                         _scalar(b, x, float(np.sqrt(2 / np.pi))))
        t = b.unary("tanh", inner)
    else:
        t = b.unary("erf", b.binary("mul", x, _scalar(b, x, float(1 / np.sqrt(2)))))
    return b.binary("mul", b.binary("mul", x, _scalar(b, x, 0.5)), b.binary("add", t, _scalar(b, x, 1)))


@op("Swish")
def Swish(b, x, *, alpha=1.0):
    return b.binary("mul", x, b.unary("sigmoid", b.binary("mul", x, _scalar(b, x, alpha))))


# --- reductions, matmul, softmax --------------------------------------------------------
def _reduce(name: str, prim: str, pre: str | None = None, post: str | None = None):
    def fn(b, x, axes_in=None, *, axes=None, keepdims=1, noop_with_empty_axes=0):
        ax = ints(axes_in) if axes_in is not None else (list(axes) if axes is not None else [])
        if not ax and noop_with_empty_axes:
            return x
        rank = len(b.shape(x))
        if pre:
            x = b.binary("mul", x, x) if pre == "square" else b.unary(pre, x)
        axes_t = tuple(_axis(a, rank) for a in ax) if ax else tuple(range(rank))
        shape = b.shape(x)
        if any(shape[a] == 0 for a in axes_t):  # the reduction of an empty set is the op's identity
            out_shape = tuple(1 if i in axes_t else d for i, d in enumerate(shape) if keepdims == 1 or i not in axes_t)
            return b.full(out_shape, _IDENTITY[name](b.dtype(x)), b.dtype(x))
        out = b.reduce(prim, x, axes_t if ax else None, keepdims == 1)  # as ONNX's shape inference: only 1 keeps
        return b.unary(post, out) if post else out

    op(name, host_inputs=(1,))(fn)


_IDENTITY = {
    "ReduceSum": lambda t: 0, "ReduceMean": lambda t: float("nan"), "ReduceProd": lambda t: 1,
    "ReduceSumSquare": lambda t: 0, "ReduceL1": lambda t: 0, "ReduceL2": lambda t: 0,
    "ReduceLogSum": lambda t: -float("inf"), "ReduceLogSumExp": lambda t: -float("inf"),
    "ReduceMax": lambda t: False if t == TensorProto.BOOL else (-float("inf") if t in _FLOATS else np.iinfo(NP_DTYPES[t]).min),
    "ReduceMin": lambda t: True if t == TensorProto.BOOL else (float("inf") if t in _FLOATS else np.iinfo(NP_DTYPES[t]).max),
}
_FLOATS = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16)

for _name, _args in {"ReduceSum": ("sum",), "ReduceMean": ("mean",), "ReduceMax": ("max",), "ReduceMin": ("min",),
                     "ReduceProd": ("prod",), "ReduceSumSquare": ("sum", "square"), "ReduceL1": ("sum", "abs"),
                     "ReduceL2": ("sum", "square", "sqrt"), "ReduceLogSum": ("sum", None, "log"),
                     "ReduceLogSumExp": ("sum", "exp", "log")}.items():
    _reduce(_name, *_args)


def _arg_reduce(kind: str):
    def fn(b, x, *, axis=0, keepdims=1, select_last_index=0):
        axis = _axis(axis, len(b.shape(x)))
        if not select_last_index:
            return b.arg_reduce(kind, x, axis, keepdims == 1)
        last = b.arg_reduce(kind, b.slice(x, (slice(None),) * axis + (slice(None, None, -1),)), axis, keepdims == 1)
        return b.binary("sub", b.full((), b.shape(x)[axis] - 1, TensorProto.INT64), last)  # index in the flipped x

    op(f"Arg{kind.capitalize()}")(fn)


_arg_reduce("max")
_arg_reduce("min")


@op("MatMul")
def MatMul(b, a, c):
    return b.matmul(a, c)


@op("Gemm")
def Gemm(b, a, c, bias=None, *, alpha=1.0, beta=1.0, transA=0, transB=0):
    if transA:
        a = b.transpose(a, (1, 0))
    if transB:
        c = b.transpose(c, (1, 0))
    y = b.matmul(a, c)
    if alpha != 1.0:
        y = b.binary("mul", y, _scalar(b, y, alpha))
    if bias is not None:
        y = b.binary("add", y, bias if beta == 1.0 else b.binary("mul", bias, _scalar(b, bias, beta)))
    return y


@op("Softmax")
def Softmax(b, x, *, axis=-1):
    return b.softmax(x, _axis(axis, len(b.shape(x))))


@op("LogSoftmax")
def LogSoftmax(b, x, *, axis=-1):
    return b.softmax(x, _axis(axis, len(b.shape(x))), log=True)


@op("CumSum", host_inputs=(1,))
def CumSum(b, x, axis, *, exclusive=0, reverse=0):
    return b.cumsum(x, _axis(ints(axis)[0], len(b.shape(x))), bool(exclusive), bool(reverse))


@op("TopK", host_inputs=(1,))
def TopK(b, x, k, *, axis=-1, largest=1, sorted=1):  # noqa: A002 - ONNX attribute name
    return b.topk(x, ints(k)[0], _axis(axis, len(b.shape(x))), bool(largest), bool(sorted))


# --- shapes and layout -------------------------------------------------------------------
@op("Shape", shape_only=True)
def Shape(b, x, *, start=0, end=None):
    shape = b.shape(x)
    return np.array(shape[slice(start, end)], np.int64)


@op("Size", shape_only=True)
def Size(b, x):
    return np.array(int(np.prod(b.shape(x), dtype=np.int64)), np.int64)


@op("Reshape", host_inputs=(1,))
def Reshape(b, x, shape, *, allowzero=0):
    shape, old = ints(shape), b.shape(x)
    if not allowzero:
        shape = [old[i] if d == 0 else d for i, d in enumerate(shape)]
    return b.reshape(x, tuple(shape))


@op("Flatten")
def Flatten(b, x, *, axis=1):
    shape = b.shape(x)
    axis = _axis(axis, len(shape), end=True)
    return b.reshape(x, (int(np.prod(shape[:axis], dtype=np.int64)), int(np.prod(shape[axis:], dtype=np.int64))))


@op("Transpose")
def Transpose(b, x, *, perm=None):
    rank = len(b.shape(x))
    return b.transpose(x, tuple(perm) if perm is not None else tuple(reversed(range(rank))))


@op("Squeeze", host_inputs=(1,))
def Squeeze(b, x, axes_in=None, *, axes=None):
    shape = b.shape(x)
    ax = ints(axes_in) if axes_in is not None else (axes or [i for i, d in enumerate(shape) if d == 1])
    ax = {_axis(a, len(shape)) for a in ax}
    return b.reshape(x, tuple(d for i, d in enumerate(shape) if i not in ax))


@op("Unsqueeze", host_inputs=(1,))
def Unsqueeze(b, x, axes_in=None, *, axes=None):
    shape = list(b.shape(x))
    ax = ints(axes_in) if axes_in is not None else list(axes)
    rank = len(shape) + len(ax)
    for a in sorted(_axis(a, rank) for a in ax):
        shape.insert(a, 1)
    return b.reshape(x, tuple(shape))


@op("Slice", host_inputs=(1, 2, 3, 4))
def Slice(b, x, starts, ends, axes=None, steps=None):
    shape = b.shape(x)
    starts, ends = ints(starts), ints(ends)
    axes = ints(axes) if axes is not None else list(range(len(starts)))
    steps = ints(steps) if steps is not None else [1] * len(starts)
    index = [slice(None)] * len(shape)
    for s, e, a, st in zip(starts, ends, axes, steps, strict=True):
        a, dim = _axis(a, len(shape)), shape[_axis(a, len(shape))]
        if st > 0:
            s = min(max(s + dim if s < 0 else s, 0), dim)
            e = min(max(e + dim if e < 0 else e, 0), dim)
        else:
            s = min(max(s + dim if s < 0 else s, -1), dim - 1)
            e = min(max(e + dim if e < 0 else e, -1), dim - 1)
            e = None if e < 0 else e
        index[a] = slice(s, e, st)
    return b.slice(x, tuple(index))


@op("Concat")
def Concat(b, *xs, axis):
    xs = [x for x in xs if x is not None]
    return b.concat(xs, _axis(axis, len(b.shape(xs[0]))))


@op("Split", host_inputs=(1,), wants_outputs=True)
def Split(b, x, split=None, *, axis=0, num_outputs=None, _n_outputs=1):
    shape = b.shape(x)
    axis = _axis(axis, len(shape))
    if split is not None:
        sizes = ints(split)
    else:
        n = num_outputs or _n_outputs
        chunk = -(-shape[axis] // n)
        sizes = [min(chunk, shape[axis] - i * chunk) for i in range(n)]
    outs, start = [], 0
    for s in sizes:
        index = [slice(None)] * len(shape)
        index[axis] = slice(start, start + s)
        outs.append(b.slice(x, tuple(index)))
        start += s
    return tuple(outs)


@op("Expand", host_inputs=(1,))
def Expand(b, x, shape):
    xs, target = list(b.shape(x)), ints(shape)
    rank = max(len(xs), len(target))
    xs, target = [1] * (rank - len(xs)) + xs, [1] * (rank - len(target)) + target
    out = tuple(t if d == 1 else d for d, t in zip(xs, target, strict=True))
    return b.expand(b.reshape(x, tuple(xs)), out)


@op("Tile", host_inputs=(1,))
def Tile(b, x, repeats):
    return b.tile(x, tuple(ints(repeats)))


@op("Pad", host_inputs=(1, 3))
def Pad(b, x, pads, constant_value=None, axes=None, *, mode="constant"):
    rank = len(b.shape(x))
    p = ints(pads)
    axes = [_axis(a, rank) for a in ints(axes)] if axes is not None else list(range(rank))
    pairs = [(0, 0)] * rank
    for i, a in enumerate(axes):
        pairs[a] = (p[i], p[i + len(axes)])
    value = 0
    if constant_value is not None:
        value = b.to_numpy(constant_value).item() if not isinstance(constant_value, np.ndarray) else constant_value.item()
    if any(lo < 0 or hi < 0 for lo, hi in pairs):  # negative pads crop
        index = tuple(slice(max(-lo, 0), d - max(-hi, 0)) for (lo, hi), d in zip(pairs, b.shape(x), strict=True))
        x = b.slice(x, index)
        pairs = [(max(lo, 0), max(hi, 0)) for lo, hi in pairs]
    return b.pad(x, pairs, mode, value)


def _positive(b, idx, dim: int):
    """ONNX indices may be negative; wrap them (host arrays cheaply, device arrays with a where)."""
    if isinstance(idx, np.ndarray):
        return np.where(idx < 0, idx + dim, idx)
    return b.where(b.binary("less", idx, _scalar(b, idx, 0)), b.binary("add", idx, _scalar(b, idx, dim)), idx)


@op("Gather")
def Gather(b, x, idx, *, axis=0):
    axis = _axis(axis, len(b.shape(x)))
    return b.gather(x, _positive(b, idx, b.shape(x)[axis]), axis)


@op("GatherElements")
def GatherElements(b, x, idx, *, axis=0):
    axis = _axis(axis, len(b.shape(x)))
    return b.gather_elements(x, _positive(b, idx, b.shape(x)[axis]), axis)


@op("ScatterElements")
def ScatterElements(b, x, idx, updates, *, axis=0, reduction="none"):
    axis = _axis(axis, len(b.shape(x)))
    return b.scatter_elements(x, _positive(b, idx, b.shape(x)[axis]), updates, axis, reduction)


@op("GatherND")
def GatherND(b, x, idx, *, batch_dims=0):
    return b.gather_nd(x, idx, batch_dims)


@op("ScatterND")
def ScatterND(b, x, idx, updates, *, reduction="none"):
    return b.scatter_nd(x, idx, updates, reduction)


@op("Trilu", host_inputs=(1,))
def Trilu(b, x, k=None, *, upper=1):
    n, m = b.shape(x)[-2:]
    i64 = TensorProto.INT64
    diagonal = b.binary("sub", b.reshape(b.arange(0, m, 1, i64), (1, m)), b.reshape(b.arange(0, n, 1, i64), (n, 1)))
    k = b.full((), ints(k)[0] if k is not None else 0, i64)
    keep = b.binary("greater_equal" if upper else "less_equal", diagonal, k)
    return b.where(keep, x, b.full((), 0, b.dtype(x)))


@op("Range", host_inputs=(0, 1, 2))
def Range(b, start, limit, delta):
    start = np.asarray(start)
    return b.arange(start.item(), np.asarray(limit).item(), np.asarray(delta).item(),
                    ONNX_OF_NP[start.dtype])


@op("ConstantOfShape", host_inputs=(0,))
def ConstantOfShape(b, shape, *, value=None):
    v = np.zeros(1, np.float32) if value is None else np.asarray(value).reshape(-1)
    return b.full(tuple(ints(shape)), v[0].item(), ONNX_OF_NP[v.dtype])


@op("Constant")
def Constant(b, *, value=None, value_float=None, value_floats=None, value_int=None, value_ints=None,
             value_string=None, value_strings=None, sparse_value=None):
    if value is not None:
        return np.asarray(value)
    for v, dtype in ((value_float, np.float32), (value_floats, np.float32), (value_int, np.int64), (value_ints, np.int64)):
        if v is not None:
            return np.array(v, dtype)
    raise FuselmError("Constant: string and sparse values are not supported")


@op("EyeLike")
def EyeLike(b, x, *, dtype=None, k=0):
    n, m = b.shape(x)
    return b.asarray(np.eye(n, m, k, dtype=NP_DTYPES[dtype] if dtype is not None else NP_DTYPES[b.dtype(x)]))


@op("OneHot", host_inputs=(1, 2))
def OneHot(b, indices, depth, values, *, axis=-1):
    d = int(np.asarray(depth).item())
    idx = _positive(b, indices, d)
    rank = len(b.shape(idx)) + 1
    axis = _axis(axis, rank)
    shape = [1] * rank
    shape[axis] = d
    classes = b.reshape(b.arange(0, d, 1, b.dtype(idx)), tuple(shape))
    hot = b.binary("equal", b.reshape(idx, tuple(b.shape(idx)[:axis]) + (1,) + tuple(b.shape(idx)[axis:])), classes)
    values = np.asarray(values)
    return b.where(hot, b.asarray(values[1]), b.asarray(values[0]))
