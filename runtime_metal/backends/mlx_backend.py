"""MLX: Apple's Metal kernels on a Mac (mx.fast.rope / scaled_dot_product_attention / rms_norm,
mx.quantized_matmul); the same code runs on MLX's CPU backend on Linux (slow, for tests).

Only MLX's own ops are used, so what runs here in CI is what runs on the Apple GPU.
"""

from __future__ import annotations

import functools
import os
from functools import partial

import mlx.core as mx
import numpy as np
from onnx import TensorProto

from fuselm import switches

from ..step_runs import FINISH
from . import kv_quant, mlx_forms, mlx_state
from .base import Backend, QuantizedWeight, StepQueue

MX_DTYPES = {
    TensorProto.FLOAT: mx.float32, TensorProto.FLOAT16: mx.float16, TensorProto.BFLOAT16: mx.bfloat16,
    TensorProto.DOUBLE: mx.float64, TensorProto.INT64: mx.int64, TensorProto.INT32: mx.int32,
    TensorProto.INT16: mx.int16, TensorProto.INT8: mx.int8, TensorProto.UINT8: mx.uint8,
    TensorProto.UINT16: mx.uint16, TensorProto.UINT32: mx.uint32, TensorProto.UINT64: mx.uint64,
    TensorProto.BOOL: mx.bool_,
}
_ONNX_OF = {v: k for k, v in MX_DTYPES.items()}
_INTEGER = (mx.int8, mx.int16, mx.int32, mx.int64, mx.uint8, mx.uint16, mx.uint32, mx.uint64)


def _div(a, b):
    if a.dtype in _INTEGER:  # ONNX integer division truncates toward zero
        q = mx.floor_divide(mx.abs(a), mx.abs(b))
        return mx.where((a < 0) != (b < 0), -q, q).astype(a.dtype)
    return mx.divide(a, b)


def _fmod(a, b):
    if a.dtype in _INTEGER:
        return (a - _div(a, b) * b).astype(a.dtype)
    q = a / b
    return a - mx.sign(q) * mx.floor(mx.abs(q)) * b


_UNARY = {
    "neg": mx.negative, "abs": mx.abs, "exp": mx.exp, "log": mx.log, "sqrt": mx.sqrt, "reciprocal": mx.reciprocal,
    "sin": mx.sin, "cos": mx.cos, "tan": mx.tan, "tanh": mx.tanh, "sigmoid": mx.sigmoid, "erf": mx.erf,
    "relu": lambda x: mx.maximum(x, mx.array(0, x.dtype)), "floor": mx.floor, "ceil": mx.ceil, "round": mx.round,
    "sign": mx.sign, "not": mx.logical_not, "isnan": mx.isnan, "isinf": mx.isinf, "asin": mx.arcsin,
    "acos": mx.arccos, "atan": mx.arctan, "sinh": mx.sinh, "cosh": mx.cosh, "asinh": mx.arcsinh,
    "acosh": mx.arccosh, "atanh": mx.arctanh, "softplus": lambda x: mx.logaddexp(x, mx.array(0, x.dtype)),
    "bitwise_not": mx.bitwise_invert,
}
_BINARY = {
    "add": mx.add, "sub": mx.subtract, "mul": mx.multiply, "div": _div,
    "pow": lambda a, b: mx.power(a, b.astype(a.dtype)) if a.dtype != b.dtype else mx.power(a, b),
    "max": mx.maximum, "min": mx.minimum, "mod": mx.remainder, "fmod": _fmod, "equal": mx.equal,
    "less": mx.less, "less_equal": mx.less_equal, "greater": mx.greater, "greater_equal": mx.greater_equal,
    "and": mx.logical_and, "or": mx.logical_or, "xor": mx.not_equal, "bitwise_and": mx.bitwise_and,
    "bitwise_or": mx.bitwise_or, "bitwise_xor": mx.bitwise_xor,
}


HALF = {"f16": mx.float16, "bf16": mx.bfloat16}
# The most causal query rows MLX's CUDA sdpa runs on its vector kernel: 3 in float32; in float16/bfloat16 it takes
# cuDNN for any query of more than one row (supports_sdpa_cudnn), which builds a graph per key length (~100 ms)
VECTOR_ROWS = {"f32": 3, "f16": 1, "bf16": 1}
FEW_ROWS = 16  # causal queries this few go to that kernel in groups (a verification step; a prompt: cuDNN)
# The most rows MLX's quantized matmul still runs on its vector kernel (qmv), a row at a time as a one-token step
# does; more go to its matrix kernel (qmm), which sums in another order. CUDA: fewer than 8 rows (cuda/quantized/
# quantized.cpp); Metal: fewer than get_qmv_batch_limit's, 6 on the smallest chips (metal/quantized.cpp); the CPU
# runs every row alike. Measured on an H100 in bfloat16 (run 45): 5-row verifications kept plain decode's tokens on
# every prompt, 9-row ones parted from them on 3 of 8.
QMV_ROWS = {"CUDA": 7, "Metal": 5}


def gpu_kind() -> str | None:
    """'Metal' or 'CUDA' when this MLX build has a GPU, else None."""
    if mx.metal.is_available():
        return "Metal"
    cuda = getattr(mx, "cuda", None)
    try:
        return "CUDA" if cuda is not None and cuda.is_available() else None
    except Exception:  # noqa: BLE001 - a build without the CUDA backend
        return None


class ThreadedSteps(StepQueue):
    """Generation with the step after next built by a second host thread while this one encodes the next.

    A host-bound decode token costs the Python build of its graph plus MLX's encode of it inside
    `mx.async_eval`. async_eval releases the GIL,
    so while this thread encodes step n+1 the build thread builds step n+2 (Python), and a token costs
    the larger of the two instead of their sum. Every evaluation stays on this thread and its default
    stream (MLX's streams belong to one thread; the build thread's ops name this thread's stream); the
    build thread only builds steps that read nothing back to the host: `steady()` (the compiled
    decode), else this thread builds the step itself, after queuing the one before."""

    what = "the next step built by a second host thread"

    def __init__(self, backend: Backend):
        super().__init__(backend)
        self.stream = mx.default_stream(mx.default_device())

    def _build(self, step, y):
        with mx.stream(self.stream):
            return step(y)

    def run(self, y, step, steady, n: int):
        builder = _build_thread()
        mx.async_eval(y)
        nxt = step(y) if n > 1 else None
        for i in range(n):
            ahead, after = i + 2 < n, None
            job = builder.submit(self._build, step, nxt) if ahead and steady() else None
            if nxt is not None:
                mx.async_eval(nxt)  # (the build thread builds the step after it meanwhile)
            if job is not None:
                after = job.result()
            elif ahead:
                after = step(nxt)
            if (yield int(y.item())) == FINISH:  # (`after` was built, not queued: the engine rolls it back)
                if nxt is not None:
                    yield int(nxt.item())
                return
            y, nxt = nxt, after


class _BuildThread:
    """ThreadedSteps' one build thread: a daemon thread that runs the steps it is given. Not a
    ThreadPoolExecutor: its worker is joined at exit, and on MLX's CUDA backend a thread that has built
    MLX graphs aborts the process when it ends (`terminate called without an active exception`, exit
    134 after the last token). A daemon thread is never ended."""

    def __init__(self):
        import queue
        import threading

        self.jobs = queue.SimpleQueue()
        threading.Thread(target=self._work, name="fuselm-mlx-build", daemon=True).start()

    def _work(self):
        while True:
            future, fn, args = self.jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - handed to the waiting thread, as an executor does
                    future.set_exception(e)

    def submit(self, fn, *args):
        from concurrent.futures import Future

        future = Future()
        self.jobs.put((future, fn, args))
        return future


@functools.cache
def _build_thread() -> _BuildThread:
    return _BuildThread()


def _build_thread_wanted(device: str) -> bool:
    """FUSELM_BUILD_THREAD=1 / 0 forces it on / off; by default on a GPU (a CPU's decode is compute-bound)."""
    flag = switches.setting("FUSELM_BUILD_THREAD")
    return device.startswith("gpu") if flag is None else flag


# MLX primitives that only make a view of their input (no kernel of their own)
VIEWS = {"Reshape", "Squeeze", "ExpandDims", "Broadcast", "Transpose", "Slice", "AsStrided", "Flatten", "Unflatten",
         "StopGradient", "Depends", "Split", "Copy", "View"}


def graph_kernels(outputs: list) -> dict:
    """The primitives that compute `outputs` from what is already evaluated (mx.export_to_dot): all of them,
    the ones that launch work ('kernels': not views), and the kernels by primitive, most frequent first."""
    import io
    import re

    buf = io.StringIO()
    mx.export_to_dot(buf, *outputs)
    labels = re.findall(r'\[label ="([^"]+)", shape=rectangle\]', buf.getvalue())
    by: dict[str, int] = {}
    for x in labels:
        if x not in VIEWS and not x.startswith("View"):  # "View float32": a reinterpreted dtype
            by[x] = by.get(x, 0) + 1
    return {"kernels": sum(by.values()), "primitives": len(labels), "top": sorted(by.items(), key=lambda kv: -kv[1])}


@mx.compile
def _greedy(x):
    """argmax, or -1 when the logits hold NaN or +inf: their sum is NaN or +inf then (-inf logits alone
    give -inf), so the check is one reduction and the flag and the choice one fused kernel."""
    total = mx.sum(x)
    return mx.where(mx.isnan(total) | (total == mx.inf), -1, mx.argmax(x).astype(mx.int32))


class MLXBackend(Backend):
    """`dtype` is the compute type of the graph's float32 values: "f32", or "f16" / "bf16", in which case
    every float32 tensor (weights, activations, the KV cache, quantization scales) lives in half
    precision, as mlx-lm runs; the fused kernels accumulate in float32 either way."""

    name = "mlx"
    kv_groups = (32, 64, 128)  # what mx.quantize takes
    kv_block_keys = None  # its quantized matmuls read the stored block as it is
    lazy = True
    compile_default = True
    quantized_gather_kind = "mlx"
    causal_reads = True  # sdpa_vector (CUDA) takes no array mask; on Metal it would visit every buffer row
    vector_rows: int | None = None  # causal queries in groups of this many where a few come (CUDA: VECTOR_ROWS[dtype])
    exact_rows: int | None = None  # rows a step may have and still round each as a one-token step (GPU: QMV_ROWS)
    # a GPU keeps every queued kernel's buffers until it has run it, so a prompt queued whole holds all its
    # layers' activations at once (mlx-lm's prefill peak); two layers queued keep the device busy and bounded
    inflight_layers = switches.number("FUSELM_INFLIGHT", 2) or None

    def __init__(self, device: str | None = None, dtype: str = "f32"):
        from fuselm.errors import FuselmError

        if device not in (None, "gpu", "cpu"):
            raise FuselmError(f"--device {device!r} is not an MLX device; use gpu or cpu")
        kind = gpu_kind()
        if device == "gpu" and kind is None:
            raise FuselmError("--device gpu: this MLX build has no GPU (Metal or CUDA); use --device cpu")
        if device == "gpu" or (device is None and kind is not None):
            mx.set_default_device(mx.gpu)
            self.device = f"gpu ({kind})"
            self.prefill_chunk = 2048  # as mlx-lm: big enough to fill the GPU
            self.long_sdpa = True  # Metal's and CUDA's sdpa tile the keys (the CPU fallback holds the scores)
            self.vector_rows = VECTOR_ROWS.get(dtype) if kind == "CUDA" else None
            self.exact_rows = QMV_ROWS[kind]
        else:
            mx.set_default_device(mx.cpu)
            self.device = "cpu"
        if dtype not in ("f32", *HALF):
            raise FuselmError(f"--dtype {dtype!r} is not one of f32, f16, bf16")
        if dtype == "f32":  # f32 means f32: MLX runs float32 matmuls as TF32 where the device can (CUDA, M5) unless
            os.environ.setdefault("MLX_ENABLE_TF32", "0")  # told not to; it reads this once, at its first matmul
        self.compute = dtype
        self._float = HALF.get(dtype, mx.float32)
        self._to_mx = {**MX_DTYPES, TensorProto.FLOAT: self._float}
        self._of_mx = {**_ONNX_OF, self._float: TensorProto.FLOAT}
        self._freqs: dict = {}  # constants made once per attribute array (kept with it, so ids stay unique)
        self._wide: set[tuple] = set()  # the mlx_forms keys this backend's prompt matmuls consulted (describe())
        self.build_thread = _build_thread_wanted(self.device)

    # --- data movement ---------------------------------------------------------------
    def asarray(self, value):
        value = np.asarray(value)
        if value.dtype.name == "bfloat16":
            return mx.array(value.view(np.uint16)).view(mx.bfloat16)
        if value.dtype == np.float64:  # Metal has no float64; MLX's CPU backend has
            return mx.array(value, dtype=mx.float32 if "gpu" in self.device else mx.float64)
        if value.dtype == np.float32 and self._float != mx.float32:
            return mx.array(value).astype(self._float)
        return mx.array(value)

    def step_queue(self) -> StepQueue:
        return ThreadedSteps(self) if self.build_thread else StepQueue(self)

    def to_numpy(self, x):
        if x.dtype == mx.bfloat16:
            import ml_dtypes

            return np.array(x.view(mx.uint16)).view(ml_dtypes.bfloat16)
        return np.array(x)

    def dtype(self, x):
        return self._of_mx[x.dtype]

    def cast(self, x, to):
        return x.astype(self._to_mx[to])

    def full(self, shape, value, to):
        return mx.full(tuple(shape), value, dtype=self._to_mx[to])

    def arange(self, start, limit, delta, to):
        dt = self._to_mx[to]
        if dt in _INTEGER:
            return mx.arange(int(start), int(limit), int(delta)).astype(dt)
        return mx.arange(start, limit, delta, dtype=dt)

    def sync(self, x):
        mx.eval(x)

    def async_eval(self, *xs):
        mx.async_eval(*xs)

    def item(self, x):
        return int(x.item()) if x.size == 1 else int(np.array(x).reshape(-1)[0])

    def compile_step(self, fn, args, n_inputs):
        """mx.compile of the whole decode step: KV buffers in and out (written with slice_update)."""
        return mx.compile(fn), "mx.compile"

    def pick_token(self, logits, sampler):
        """The next token on the device: greedy argmax, or sampling (temperature, top-k, top-p) with
        MLX's random ops; -1 when the logits hold NaN or +inf."""
        x = logits.reshape(-1).astype(mx.float32)
        if sampler.temperature <= 0:
            return _greedy(x)
        z = x / sampler.temperature
        if sampler.top_k and sampler.top_k < z.size:
            kth = mx.sort(z)[-sampler.top_k]
            z = mx.where(z < kth, -mx.inf, z)
        if sampler.top_p < 1.0:
            order = mx.argsort(-z)
            p = mx.softmax(z[order], precise=True)
            drop = (mx.cumsum(p) - p) >= sampler.top_p  # keep the smallest prefix reaching top_p
            z = mx.put_along_axis(z, order, mx.where(drop, -mx.inf, z[order]), axis=0)
        if sampler.device_key is None:  # seeded once from the sampler's generator
            sampler.device_key = mx.random.key(int(sampler.rng.integers(0, 2**31 - 1)))
        sampler.device_key, key = mx.random.split(sampler.device_key)
        tok = mx.random.categorical(z, key=key)
        bad = mx.any(mx.isnan(x) | (x == mx.inf))
        return mx.where(bad, -1, tok.astype(mx.int32))

    def count_kernels(self, sess) -> dict | None:
        """The kernels of one decode step as it runs now (compiled when it is); None before a decode step ran."""
        if not sess.pos or sess.pos + 1 > sess.max_len:
            return None
        mx.eval(list(sess.buffers.values()))
        saved, pos = dict(sess.buffers), sess.pos
        y = sess.decode(mx.array([1]))
        counts = graph_kernels([y, *sess.buffers.values()])
        sess.buffers, sess.pos = saved, pos  # the step is not kept: the same rows are written again later
        return {**counts, "what": "mx.compile fused graph" if sess.compiled is not None else "eager graph"}

    # --- math ---------------------------------------------------------------------------
    def unary(self, op, x):
        return _UNARY[op](x)

    def binary(self, op, a, b):
        return _BINARY[op](a, b)

    def where(self, cond, a, b):
        return mx.where(cond, a, b)

    def reduce(self, op, x, axes, keepdims):
        if op == "mean" and x.dtype in _INTEGER:
            return mx.mean(x.astype(mx.float32), axis=axes, keepdims=keepdims).astype(x.dtype)
        fn = {"sum": mx.sum, "mean": mx.mean, "max": mx.max, "min": mx.min, "prod": mx.prod}[op]
        out = fn(x, axis=axes, keepdims=keepdims)
        return out.astype(x.dtype) if out.dtype != x.dtype else out

    def arg_reduce(self, op, x, axis, keepdims):
        return (mx.argmax if op == "max" else mx.argmin)(x, axis=axis, keepdims=keepdims).astype(mx.int64)

    def matmul(self, a, b):
        if a.dtype in _INTEGER:  # MLX multiplies floats only
            return mx.matmul(a.astype(mx.float32), b.astype(mx.float32)).astype(a.dtype)
        return mx.matmul(a, b)

    def softmax(self, x, axis, log=False):
        if log:
            return x - mx.logsumexp(x, axis=axis, keepdims=True)
        return mx.softmax(x, axis=axis, precise=True)

    def cumsum(self, x, axis, exclusive, reverse):
        return mx.cumsum(x, axis=axis, reverse=reverse, inclusive=not exclusive)

    def topk(self, x, k, axis, largest, sorted_):
        key = x.astype(mx.float64 if "gpu" not in self.device else mx.float32) if x.dtype in _INTEGER else x
        order = mx.argsort(-key if largest else key, axis=axis)
        idx = mx.take(order, mx.arange(k), axis=axis)
        return mx.take_along_axis(x, idx, axis=axis), idx.astype(mx.int64)

    # --- layout -------------------------------------------------------------------------
    def reshape(self, x, shape):
        return mx.reshape(x, tuple(shape))

    def transpose(self, x, perm):
        return mx.transpose(x, tuple(perm))

    def slice(self, x, index):
        return x[index]

    def concat(self, xs, axis):
        return mx.concatenate(xs, axis=axis)

    def expand(self, x, shape):
        return mx.broadcast_to(x, tuple(shape))

    def tile(self, x, reps):
        return mx.tile(x, list(reps))

    def pad(self, x, pads, mode, value):
        if mode not in ("constant", "edge"):
            return self.asarray(np.pad(self.to_numpy(x), pads, mode={"reflect": "reflect", "wrap": "wrap"}[mode]))
        return mx.pad(x, [tuple(p) for p in pads], constant_values=value, mode=mode)

    def gather(self, x, idx, axis):
        return mx.take(x, idx, axis=axis)

    def gather_elements(self, x, idx, axis):
        return mx.take_along_axis(x, idx, axis=axis)

    def scatter_elements(self, x, idx, updates, axis, reduction):
        if reduction == "none":
            return mx.put_along_axis(x, idx, updates, axis=axis)
        from .numpy_backend import NumpyBackend

        out = NumpyBackend().scatter_elements(self.to_numpy(x), self.to_numpy(idx), self.to_numpy(updates), axis, reduction)
        return mx.array(out)

    def scatter_nd(self, x, idx, updates, reduction):
        key = tuple(idx[..., i] for i in range(idx.shape[-1]))
        if reduction == "none":
            out = mx.array(x)
            out[key] = updates
            return out
        at = x.at[key]
        return {"add": at.add, "mul": at.multiply, "max": at.maximum, "min": at.minimum}[reduction](updates)

    # --- recurrent-state ops: each token's step one compiled function (mlx_state.py) --------------------
    def state_zeros(self, shape):
        return mx.zeros(tuple(shape), mx.float32)  # float32 whatever the compute dtype

    def causal_conv1d(self, x, past, weight):
        return mlx_state.causal_conv1d(x, past, weight)

    def gated_delta(self, q, k, v, decay, beta, state):
        return mlx_state.gated_delta(q, k, v, decay, beta, state)

    def ssm_scan(self, x, dt, a_log, b, c, d, dt_bias, state, dt_min, dt_max):
        if x.shape[1] == 1:
            return mlx_state.ssm_step(x, dt, a_log, b, c, d, dt_bias, state, dt_min, dt_max)
        return mlx_state.ssm_chunked(x, dt, a_log, b, c, d, dt_bias, state, dt_min, dt_max)

    def selective_scan(self, x, dt, a_log, b, c, d, dt_bias, state):
        return mlx_state.selective_scan(x, dt, a_log, b, c, d, dt_bias, state)

    # --- fused kernels ----------------------------------------------------------------
    def rms_norm(self, x, weight, eps):
        return mx.fast.rms_norm(x, weight, eps)

    def silu_gate(self, gate, up):
        return _silu_gate(gate, up)

    def layer_norm(self, x, weight, bias, eps):
        return mx.fast.layer_norm(x, weight, bias, eps)

    def rope(self, x, position_ids, inv_freq, attention_scaling, interleaved, offset=None):
        rd = 2 * len(inv_freq)
        if offset is None or position_ids.shape[0] != 1:
            return self._rope_positions(x, position_ids, inv_freq, attention_scaling, interleaved)
        key = id(inv_freq)
        if key not in self._freqs:  # mx.fast.rope takes periods: 1 / inv_freq
            self._freqs[key] = (inv_freq, mx.array(1.0 / np.asarray(inv_freq, np.float64)).astype(mx.float32))
        freqs = self._freqs[key][1]
        y = mx.fast.rope(mx.transpose(x, (0, 2, 1, 3)), rd, traditional=bool(interleaved), base=None, scale=1.0,
                         offset=offset, freqs=freqs)
        y = mx.transpose(y, (0, 2, 1, 3))
        if attention_scaling != 1.0:  # HF scales cos/sin: only the rotated part
            d = x.shape[-1]
            s = mx.array(np.r_[np.full(rd, attention_scaling), np.ones(d - rd)].astype(np.float32)).astype(x.dtype)
            y = y * s
        return y

    def _rope_positions(self, x, position_ids, inv_freq, scaling, interleaved):
        """Arbitrary positions (not one contiguous run per batch row): cos/sin from position_ids."""
        rd = 2 * len(inv_freq)
        freqs = position_ids.astype(mx.float32)[..., None] * mx.array(np.asarray(inv_freq, np.float32))
        cos = (mx.cos(freqs) * scaling).astype(x.dtype)[:, :, None, :]
        sin = (mx.sin(freqs) * scaling).astype(x.dtype)[:, :, None, :]
        xr = x[..., :rd]
        if interleaved:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            y = mx.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(xr.shape)
        else:
            x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
            y = mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return mx.concatenate([y, x[..., rd:]], axis=-1) if rd < x.shape[-1] else y

    def rope_table(self, position_ids, inv_freq, scaling):
        """cos and sin [B, S, 1, 1, R/2] in float32 of position_ids × inv_freq (times attention_scaling)."""
        key = ("inv", id(inv_freq))
        if key not in self._freqs:
            self._freqs[key] = (inv_freq, mx.array(np.asarray(inv_freq, np.float32)))
        ang = position_ids.astype(mx.float32)[:, :, None, None, None] * self._freqs[key][1]
        cos, sin = mx.cos(ang), mx.sin(ang)
        return (cos, sin) if scaling == 1.0 else (cos * scaling, sin * scaling)

    def qkv_heads(self, qkv, cos, sin, weight, weight_rot, heads, kv_heads, eps, heads_first=False):
        """The fused QKV output [B, S, (Hq + 2Hkv)·D] as heads [B, S, Hq + 2Hkv, D]: q and k RMS-normalized
        (eps None: not normalized) and rotated (full, non-interleaved), v as it came. `weight` [H, 2, D/2] is the norm weight and
        `weight_rot` its rotate_half twin (halves swapped, the first negated), so the rotation reads the
        normalized heads through a negative-stride view: one rms_norm over every head (v's result is
        dropped) and one elementwise expression of kernel outputs and constants, which mx.compile fuses.
        `heads_first`: as [B, Hq + 2Hkv, S, D] (one reshape for one token), as a decode attention reads them."""
        h = heads + 2 * kv_heads
        key = ("qk", h, heads + kv_heads, eps, heads_first)
        if key not in self._freqs:  # which heads rotate (q and k), and the expression compiled once per layout
            rotates = mx.array((np.arange(h) < heads + kv_heads).reshape(h, 1, 1))
            self._freqs[key] = (None, mx.compile(partial(_qkv_heads, rotates=rotates, eps=eps,
                                                         heads_first=heads_first)))
        return self._freqs[key][1](qkv, cos, sin, weight, weight_rot)

    def inexact(self, rows: int) -> str | None:
        if self.exact_rows is None or rows <= self.exact_rows:
            return None
        return (f"MLX's quantized matmul on the {self.device} takes more than {self.exact_rows} rows on its matrix "
                "kernel, which sums in another order than a one-token step's")

    def sdpa(self, q, k, v, mask, scale):
        if mask is not None and not isinstance(mask, str) and mask.dtype != mx.bool_ and mask.dtype != q.dtype:
            mask = mask.astype(q.dtype)
        rows, n = q.shape[2], self.vector_rows
        if n and n < rows <= FEW_ROWS and mask == "causal":
            # a few causal queries (a speculative verification): MLX's CUDA backend would run cuDNN, which builds
            # a graph for each key length (tens of ms a step); its vector kernel takes n rows at a time, each group
            # over the keys up to its own last row (causal aligns the rows at the keys' end)
            t = k.shape[2] - rows
            return mx.concatenate([mx.fast.scaled_dot_product_attention(
                q[:, :, r:r + n], k[:, :, :t + min(rows, r + n)], v[:, :, :t + min(rows, r + n)], scale=scale,
                mask="causal") for r in range(0, rows, n)], axis=2)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    def prepare_quantized(self, q, scale, zero_point, block, bits):
        k, n = q.shape
        if block not in (32, 64, 128) or bits not in (4, 8) or k % block:
            return super().prepare_quantized(q, scale, zero_point, block, bits)
        # [N, K]: MLX quantizes rows along the last dim; transposed on the device (a host transpose of every
        # weight is most of a load)
        qt = mx.transpose(mx.array(q.astype(np.uint8, copy=False)))
        return self._affine(qt, scale.T, None if zero_point is None else zero_point.T, k, n, bits, block)

    def _affine(self, q, scale, zero_point, k, n, bits, block) -> QuantizedWeight:
        """MLX affine quantization of q [..., N, K]: w = q * scale + bias, packed into uint32 from the low bits up;
        ONNX's (q - zp) * scale is bias = -zp * scale (scales in the compute dtype)."""
        if bits == 4:
            pairs = q.reshape(*q.shape[:-1], q.shape[-1] // 2, 2)
            q = pairs[..., 0] | (pairs[..., 1] << 4)
        packed = mx.contiguous(q).view(mx.uint32)  # little endian: first value in the low bits
        s = np.ascontiguousarray(scale.astype(np.float32))
        zp = zero_point.astype(np.float32) if zero_point is not None else np.zeros_like(s)
        data = (packed, self.asarray(s), self.asarray(np.ascontiguousarray(-zp * s)))
        # evaluated now: a lazy weight would hold its unpacked uint8 source (2x a 4-bit weight) until the first step
        mx.eval(data)
        return QuantizedWeight(data, k, n, bits, block, "mlx")

    def prepared_format(self):
        return f"mlx{mx.__version__}-{self.compute}"

    def save_prepared(self, path, arrays, metadata):
        mx.save_safetensors(str(path), arrays, metadata)

    def load_prepared(self, path):
        return mx.load(str(path), return_metadata=True)

    def quantized_matmul(self, x, w):
        if w.kind != "mlx":
            return mx.matmul(x, w.data)
        wq, s, bias = w.data
        if x.size >= mlx_forms.WIDE_ROWS * x.shape[-1]:  # a prompt chunk: the faster form for this shape (mlx_forms)
            key, form = mlx_forms.choose(w, x.size // x.shape[-1], x.dtype)
            if key is not None:
                self._wide.add(key)
            if form == "dequantize":
                return mx.matmul(x, mlx_forms.dequantized(wq, s, bias, w.block, w.bits, x.dtype).T)
        return mx.quantized_matmul(x, wq, s, bias, transpose=True, group_size=w.block, bits=w.bits)

    def matmul_note(self) -> str:
        return mlx_forms.note(self._wide)

    def quantized_gather(self, w, ids):
        """mlx-lm's QuantizedEmbedding: the packed rows, their scales and biases gathered, then dequantized."""
        wq, s, bias = w.data
        flat = ids.reshape(-1)
        out = mx.dequantize(wq[flat], s[flat], bias[flat], group_size=w.block, bits=w.bits)
        return out.reshape(*ids.shape, w.in_features)

    def prepare_experts(self, q, scale, zero_point, block, bits):
        """MLX's affine format per expert ([E, N, K] is already MLX's [out, in] row layout): packed
        uint32 [E, N, K*bits/32], scales and biases [E, N, K/block], bias = -zp * scale."""
        _, n, k = q.shape
        if block not in (32, 64, 128) or bits not in (4, 8) or k % block:
            return super().prepare_experts(q, scale, zero_point, block, bits)
        return self._affine(mx.array(q.astype(np.uint8, copy=False)), scale, zero_point, k, n, bits, block)

    def select_experts(self, scores, k):
        """mlx-lm's top_k: mx.argpartition (no sort), the k largest at the end (no negation); uint32 indices,
        as mx.gather_qmm takes them."""
        e = scores.shape[-1]
        idx = mx.argpartition(scores, kth=e - k, axis=-1)[..., e - k:]
        return mx.take_along_axis(scores, idx, axis=-1), idx

    def expert_matmul(self, x, w, experts):
        """mlx-lm's SwitchLinear: x [T, K] (or [T, k, K]) as rows [T(, k), 1, K] against the experts' weights
        gathered by `experts` [T, k] -> [T, k, N]; which row each (token, slot) reads is a constant made once
        per shape (`_rows`), so the step has no arange of its own."""
        t, k = experts.shape
        shared = x.ndim == 2
        idx = experts if experts.dtype == mx.uint32 else experts.astype(mx.uint32)
        rows = self._rows(t, 1 if shared else k)
        return self._gather_matmul(mx.expand_dims(x, -2), w, idx, False, rows).reshape(t, k, -1)

    def _rows(self, t: int, k: int):
        """arange(t * k) as [t, k] uint32: the lhs rows of mx.gather_qmm / gather_mm (kept for the small decode
        shapes, t * k < 64, where the step's count of kernels matters; made each time otherwise)."""
        key = ("rows", t, k)
        if key in self._freqs:
            return self._freqs[key][1]
        rows = mx.arange(t * k, dtype=mx.uint32).reshape(t, k)
        if t * k < 64:
            mx.eval(rows)
            self._freqs[key] = (None, rows)
        return rows

    def expert_mlp(self, x, gate_up, down, experts, act, weights=None, gate_up_bias=None, down_bias=None):
        """mlx-lm's SwitchGLU: for long prompts the (token, slot) rows are sorted by expert once
        (`_gather_sort`), both projections read each expert's weights contiguously (sorted_indices), then
        unsorted; `weights` multiply the activation (and the down bias) in the sorted order, the slots summed."""
        t, k = experts.shape
        if experts.size < 64:
            return super().expert_mlp(x, gate_up, down, experts, act, weights, gate_up_bias, down_bias)
        flat = experts.reshape(-1)
        flat = flat if flat.dtype == mx.uint32 else flat.astype(mx.uint32)
        order = mx.argsort(flat)
        idx = flat[order]
        rows = mx.arange(t * k, dtype=mx.uint32)  # (MLX's default lhs rows, made once for both matmuls)
        gu = self._gather_matmul(mx.expand_dims(x, -2)[order // k], gate_up, idx, True, rows)  # [T*k, 1, 2I]
        if gate_up_bias is not None:
            gu = gu + mx.expand_dims(gate_up_bias[idx], -2)
        inter = gu.shape[-1] // 2
        h = act(gu[..., :inter], gu[..., inter:])
        w = None if weights is None else weights.reshape(-1)[order].reshape(-1, 1, 1).astype(h.dtype)
        y = self._gather_matmul(h if w is None else h * w, down, idx, True, rows)
        if down_bias is not None:
            db = mx.expand_dims(down_bias[idx], -2)
            y = y + (db if w is None else db * w)
        y = y.reshape(t * k, -1)[mx.argsort(order)].reshape(t, k, -1)
        return y if w is None else y.sum(axis=1)

    @staticmethod
    def _gather_matmul(xs, w, idx, sorted_indices: bool, rows=None):
        if isinstance(w, QuantizedWeight) and w.kind == "mlx":
            wq, s, bias = w.data
            return mx.gather_qmm(xs, wq, s, bias, lhs_indices=rows, rhs_indices=idx, transpose=True,
                                 group_size=w.block, bits=w.bits, sorted_indices=sorted_indices)
        data = w.data if isinstance(w, QuantizedWeight) else w
        return mx.gather_mm(xs, mx.swapaxes(data, -1, -2), lhs_indices=rows, rhs_indices=idx,
                            sorted_indices=sorted_indices)

    def cache_write(self, buffer, new, pos, heads: tuple[int, int] | None = None):
        """`heads`: the head range written, in a buffer that holds K and V (kvcache.packed_pairs; host `pos`)."""
        if heads is not None:
            buffer[:, heads[0]:heads[1], pos:pos + new.shape[2]] = new
            return buffer
        if isinstance(pos, int):
            buffer[:, :, pos:pos + new.shape[2]] = new
            return buffer
        return mx.slice_update(buffer, new.astype(buffer.dtype), mx.reshape(pos, (1,)).astype(mx.int32), axes=(2,))

    # --- the 8-bit KV cache: MLX's affine quantization, q packed 4 per uint32 [B, H, L, D/4] ------------
    def _kv_scale_dtype(self):
        """float16, or the compute dtype where MLX computes in half precision (bfloat16 on a GPU)."""
        return self._float if self._float in (mx.float16, mx.bfloat16) else mx.float16

    def kv_empty(self, shape, group):
        bsz, h, length, d = shape
        dt = self._kv_scale_dtype()
        return (mx.zeros((bsz, h, length, d // 4), mx.uint32), mx.zeros((bsz, h, length, d // group), dt),
                mx.zeros((bsz, h, length, d // group), dt))

    def kv_quantize(self, x, group):
        dt = self._kv_scale_dtype()
        q, s, z = mx.quantize(x if x.dtype == dt else x.astype(mx.float32), group_size=group, bits=kv_quant.BITS)
        return q, s.astype(dt), z.astype(dt)

    def kv_head_dim(self, stored):
        return int(stored[0].shape[-1]) * 4

    def kv_dequantize(self, stored, to):
        """float32 scales and biases: one rounding, at the end."""
        q, s, z = stored
        return mx.dequantize(q, s.astype(mx.float32), z.astype(mx.float32), group_size=kv_quant.group_of(self, stored),
                             bits=kv_quant.BITS).astype(MX_DTYPES[to])

    def kv_values(self, p, block):
        return self.kv_scores(p, block, transpose=False)

    def kv_scores(self, x, block, transpose: bool = True):
        """x · blockᵀ (scores) or x · block (values) on the stored 8-bit rows: one quantized matmul where this
        device's MLX implements that form (Metal, the CPU); else the block dequantized, then a plain matmul
        (MLX's CUDA backend has quantized kernels for x · Wᵀ over row-contiguous operands only)."""
        wq, s, z = block
        group = kv_quant.group_of(self, block)
        # in the scales' dtype where x is half precision too, else float32
        x = x if x.dtype == s.dtype and x.dtype in (mx.float16, mx.bfloat16) else x.astype(mx.float32)
        form = _kv_form(transpose)
        if form == "contiguous":
            wq, s, z = (mx.contiguous(a) for a in (wq, s, z))
        if form == "dequantize":
            w = self.kv_dequantize(block, _ONNX_OF[x.dtype])
            return mx.matmul(x, mx.swapaxes(w, -1, -2) if transpose else w)
        return mx.quantized_matmul(x, wq, s, z, transpose=transpose, group_size=group, bits=kv_quant.BITS)


@partial(mx.compile, shapeless=True)
def _silu_gate(gate, up):
    """SiLU(gate) · up as one kernel at any shape (mlx-lm's swiglu)."""
    return gate * mx.sigmoid(gate) * up


def _qkv_heads(qkv, cos, sin, weight, weight_rot, *, rotates, eps, heads_first=False):
    """MLXBackend.qkv_heads, compiled (mx.compile) so that a prompt chunk's rotation is one fused kernel too:
    uncompiled, each product of the expression would be its own [S, H, D] float32 array (cos and sin are float32)."""
    bsz, s, width = qkv.shape
    h = rotates.shape[0]
    d = width // h
    x = qkv.reshape(bsz, s, h, 2, d // 2)
    n = x if eps is None else mx.fast.rms_norm(qkv.reshape(bsz, s, h, d), None, eps).reshape(x.shape)
    rotated = mx.where(rotates, (n * weight * cos + n[..., ::-1, :] * weight_rot * sin).astype(x.dtype), x)
    if heads_first and s == 1:  # [B, 1, H, D] and [B, H, 1, D] hold their elements in the same order
        return rotated.reshape(bsz, h, 1, d)
    out = rotated.reshape(bsz, s, h, d)
    return out.transpose(0, 2, 1, 3) if heads_first else out


@functools.cache
def _kv_form(transpose: bool) -> str:
    """How this device's MLX runs an 8-bit cache block product, found once by running one (a capability probe,
    not a device check): "quantized" (mx.quantized_matmul on the block as it is held: a slice of the cache),
    "contiguous" (the same on a row-contiguous copy), or "dequantize" (no quantized kernel for the form)."""
    rows = mx.random.normal((1, 2, 64, 64)).astype(mx.float16)
    q, s, z = mx.quantize(rows, group_size=32, bits=kv_quant.BITS)
    view = tuple(a[:, :, 1:33] for a in (q, s, z))  # a slice of the held buffer, as the cache hands it
    x = mx.ones((1, 2, 3, 64 if transpose else 32), mx.float16)
    for form, args in (("quantized", view), ("contiguous", tuple(mx.contiguous(a) for a in view))):
        try:
            mx.eval(mx.quantized_matmul(x, *args, transpose=transpose, group_size=32, bits=kv_quant.BITS))
            return form
        except RuntimeError:
            continue
    return "dequantize"

