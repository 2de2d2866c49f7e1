"""The backend interface the op table is written against: a few dozen array primitives.

Every op in runtime_metal/ops.py calls only these. A backend implements them for one array
library (numpy on the host for shape work, torch, mlx). Element types are ONNX TensorProto codes
everywhere, so the op table never names a library's dtype.

Conventions: `shape`/`axes`/`perm` arguments are Python ints; `x`, `a`, `b` are the backend's
arrays. Fused kernels (rms_norm, rope, sdpa, quantized_matmul) have the layouts the fused ONNX
ops have, so the op table hands tensors over without copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from ..step_runs import FINISH
from . import kv_quant, state_kernels


@dataclass
class QuantizedWeight:
    """A DequantizeLinear -> MatMul weight as the backend prepared it at load (opaque `data`)."""

    data: object
    in_features: int
    out_features: int
    bits: int
    block: int
    kind: str  # what the backend chose: "mlx", "int4pack", "dequant", ...


class Backend:
    """One array library on one device. Subclasses implement every method below.

    Capabilities (class attributes the session reads instead of checking backend names):
    `lazy` — arrays are computed on demand (MLX), so the next decode step is queued while the
    device runs this one; `compile_default` — compiling the static decode step is cheap enough to
    do without being asked; `compute` — the compute type of the graph's float32 values;
    `causal_reads` — Attention reads only the filled rows of the cache, with no array mask at decode
    and mask "causal" at prefill (`sdpa`), where the graph's mask allows it (rewrites/causal_masks.py): what the
    backend's fused attention needs (MLX); the decode step's attention shapes then grow with the cache;
    `long_sdpa` — `sdpa` runs long prompts without holding their [S × T] scores (a flash kernel), so
    Attention need not split the keys into blocks (attention_blocks.py). `inexact(rows)` says why a step of that many
    rows may give a row other numbers than a one-token step (speculation's verification steps are such steps)."""

    name = "base"
    device = "cpu"
    lazy = False
    compile_default = False
    causal_reads = False
    long_sdpa = False
    compute = "f32"
    prefill_chunk = 512  # prompt tokens per prefill step: activations stay bounded
    # a lazy backend's long run (a prefill chunk) queues at most this many layers before it waits for the
    # oldest (executor.InFlight); None: the whole run is queued at once, then computed
    inflight_layers: int | None = None
    # the 8-bit KV cache (kv_quant.py has the format): channel groups the backend can store (None: any divisor of
    # head_dim), and keys a blocked read may dequantize at once (None: it dequantizes nothing; 4096·Hkv·D f32 is
    # 16 MiB at Hkv=8, D=128)
    kv_groups: tuple[int, ...] | None = None
    kv_block_keys: int | None = 4096
    # the QuantizedWeight kind whose rows `quantized_gather` reads (MLX: [N, K] packed, as mlx-lm's
    # QuantizedEmbedding): a 4-bit embedding is then gathered from the tied lm_head's copy (None: QGather)
    quantized_gather_kind: str | None = None
    step_memo: dict | None = None  # values shared by the ops of one graph run (reset by `new_step`)

    # --- data movement ---------------------------------------------------------------
    def inexact(self, rows: int) -> str | None:
        """Why a step of `rows` tokens may round a row otherwise than a one-token step; None: it does not."""
        return None

    def asarray(self, value: np.ndarray):
        """A host numpy array (any ONNX dtype, bf16 via ml_dtypes) as a backend array."""
        raise NotImplementedError

    def to_numpy(self, x) -> np.ndarray:
        raise NotImplementedError

    def shape(self, x) -> tuple[int, ...]:
        return tuple(int(d) for d in x.shape)

    def dtype(self, x) -> int:
        """The ONNX TensorProto element type of `x`."""
        raise NotImplementedError

    def cast(self, x, to: int):
        raise NotImplementedError

    def full(self, shape: tuple, value, to: int):
        raise NotImplementedError

    def arange(self, start, limit, delta, to: int):
        raise NotImplementedError

    def sync(self, x) -> None:
        """Wait until `x` is computed (profiling); a no-op where execution is eager and synchronous."""

    def new_step(self) -> None:
        """A graph run begins: the values its ops share (`step_memo`) start empty."""
        self.step_memo = {}

    def async_eval(self, *xs) -> None:
        """Start computing `xs` without waiting (lazy backends); a no-op where execution is eager."""

    def item(self, x) -> int:
        """A one-element integer array as a Python int (waits for it)."""
        return int(self.to_numpy(x).reshape(-1)[0])

    def step_queue(self) -> StepQueue:
        """How generation queues its steps on this backend (generate's loop; see StepQueue)."""
        return StepQueue(self)

    def matmul_note(self) -> str:
        """What describe() adds about how the quantized matmuls ran (", ..."), or ""."""
        return ""

    def set_threads(self, decode: bool) -> None:
        """Size the backend's CPU thread pools for a decode step (True) or a prefill chunk (False)."""

    def host_int(self, pos) -> int | None:
        """A cache position (a Python int or a 0-d integer array) as a Python int where reading it costs
        nothing (no device sync, not inside a trace); else None."""
        return pos if isinstance(pos, int) else None

    def count_kernels(self, sess) -> dict | None:
        """The kernels one decode step of `sess` launches ({"kernels", "top", "what"}), for `--profile`;
        None where the backend cannot count them."""
        return None

    def int8_activations(self, weights: list[QuantizedWeight]) -> bool:
        """Whether these weights' matmuls round their activations to int8 (validate then compares with
        onnxruntime's own int8 activations, MatMulNBits at accuracy level 4)."""
        return False

    def drift_tolerance(self, weights: list[QuantizedWeight]) -> float:
        """How far two orders of the same float work (static vs dynamic decode, the compiled vs the eager
        step) may drift, as a share of the largest logit, for a graph with these quantized weights: half
        precision rounds at every matmul, and a last-bit difference upstream flips roundings that grow over
        the layers; f32 stays within 1e-3. A backend whose weight kinds round activations says so here."""
        return 3e-2 if self.compute != "f32" else 1e-3

    def compile_step(self, fn, args: tuple, n_inputs: int):
        """Compile `fn(*args) -> (logits, next position, *states, *buffers)`, whose first `n_inputs` args are the
        per-step inputs (ids, position, recurrent states: as many as the results before the buffers) and the rest
        KV buffers; returns (callable with the same signature and result, what)."""
        raise NotImplementedError

    def pick_token(self, logits, sampler):
        """The next token as a one-element device integer array, -1 when the logits hold NaN or +inf.

        This default picks greedily on the device and samples on the host."""
        if not sampler.greedy:
            x = np.asarray(self.to_numpy(logits), np.float32).reshape(-1)
            tok = -1 if np.isnan(x).any() or np.isposinf(x).any() else sampler.pick(x)
            return self.asarray(np.array([tok], np.int64))
        x = self.reshape(logits, (-1,))
        tok = self.arg_reduce("max", x, 0, True)
        bad = self.binary("or", self.unary("isnan", x), self.binary("equal", x, self.full((1,), np.inf, self.dtype(x))))
        bad = self.reduce("max", self.cast(bad, 6), (0,), True)  # int32
        return self.where(self.cast(bad, 9), self.full((1,), -1, 7), tok)

    # --- math ---------------------------------------------------------------------------
    def unary(self, op: str, x):
        raise NotImplementedError

    def binary(self, op: str, a, b):
        raise NotImplementedError

    def where(self, cond, a, b):
        raise NotImplementedError

    def reduce(self, op: str, x, axes: tuple | None, keepdims: bool):
        raise NotImplementedError

    def arg_reduce(self, op: str, x, axis: int, keepdims: bool):
        """int64 index of the first max / min along `axis`."""
        raise NotImplementedError

    def matmul(self, a, b):
        raise NotImplementedError

    def softmax(self, x, axis: int, log: bool = False):
        raise NotImplementedError

    def cumsum(self, x, axis: int, exclusive: bool, reverse: bool):
        raise NotImplementedError

    def topk(self, x, k: int, axis: int, largest: bool, sorted_: bool):
        raise NotImplementedError

    # --- layout -------------------------------------------------------------------------
    def reshape(self, x, shape: tuple):
        raise NotImplementedError

    def transpose(self, x, perm: tuple):
        raise NotImplementedError

    def slice(self, x, index: tuple):
        """x[index] for a tuple of Python slices (steps may be negative)."""
        raise NotImplementedError

    def concat(self, xs: list, axis: int):
        raise NotImplementedError

    def expand(self, x, shape: tuple):
        """Broadcast `x` to `shape` (already the broadcast of both, as ONNX Expand defines)."""
        raise NotImplementedError

    def tile(self, x, reps: tuple):
        raise NotImplementedError

    def pad(self, x, pads: list[tuple[int, int]], mode: str, value):
        raise NotImplementedError

    def gather(self, x, idx, axis: int):
        """np.take semantics; `idx` has non-negative entries."""
        raise NotImplementedError

    def gather_elements(self, x, idx, axis: int):
        raise NotImplementedError

    def scatter_elements(self, x, idx, updates, axis: int, reduction: str):
        raise NotImplementedError

    def gather_nd(self, x, idx, batch_dims: int):
        """Advanced indexing by the last axis of `idx` (numpy, torch and mlx arrays share it), per batch entry."""
        if batch_dims == 0:
            return x[tuple(idx[..., j] for j in range(self.shape(idx)[-1]))]
        xb = self.reshape(x, (-1, *self.shape(x)[batch_dims:]))
        ib = self.reshape(idx, (-1, *self.shape(idx)[batch_dims:]))
        outs = [self.gather_nd(xb[i], ib[i], 0) for i in range(self.shape(xb)[0])]
        out = self.concat([self.reshape(o, (1, *self.shape(o))) for o in outs], 0)
        return self.reshape(out, (*self.shape(x)[:batch_dims], *self.shape(outs[0])))

    def scatter_nd(self, x, idx, updates, reduction: str):
        raise NotImplementedError

    # --- recurrent-state ops (fuselm::CausalConv1D / GatedDeltaNet / Mamba2 / Mamba): state_kernels.py over the primitives;
    # a backend with its own kernels overrides them. States are float32 whatever the compute dtype.
    def state_zeros(self, shape: tuple):
        """A recurrent state before the first token: float32 zeros (never the compute dtype)."""
        return self.full(tuple(shape), 0, 1)  # TensorProto.FLOAT

    def causal_conv1d(self, x, past, weight):
        return state_kernels.causal_conv1d(self, x, past, weight)

    def gated_delta(self, q, k, v, decay, beta, state):
        return state_kernels.gated_delta(self, q, k, v, decay, beta, state)

    def ssm_scan(self, x, dt, a_log, b, c, d, dt_bias, state, dt_min: float, dt_max: float):
        return state_kernels.ssm_scan(self, x, dt, a_log, b, c, d, dt_bias, state, dt_min, dt_max)

    def selective_scan(self, x, dt, a_log, b, c, d, dt_bias, state):
        return state_kernels.selective_scan(self, x, dt, a_log, b, c, d, dt_bias, state)

    # --- fused kernels ----------------------------------------------------------------
    def silu_gate(self, gate, up):
        """SiLU(gate) · up (fuselm::SwiGLU): three elementwise ops; a backend with one kernel for it overrides."""
        return self.binary("mul", self.binary("mul", gate, self.unary("sigmoid", gate)), up)

    def rms_norm(self, x, weight, eps: float):
        """RMS normalization over the last axis, times `weight` (broadcast over the last axis)."""
        raise NotImplementedError

    def layer_norm(self, x, weight, bias, eps: float):
        raise NotImplementedError

    def rope(self, x, position_ids, inv_freq: np.ndarray, attention_scaling: float, interleaved: bool,
             offset=None):
        """Rotary embedding of x [B, S, H, D] at positions [B, S]; rotary_dim = 2 * len(inv_freq).

        `offset` ([B] or scalar array), when given, promises position_ids[b, s] == offset[b] + s, which
        lets a backend use a kernel that takes a start offset (mx.fast.rope)."""
        raise NotImplementedError

    def sdpa(self, q, k, v, mask, scale: float):
        """softmax(q kᵀ·scale + mask) v for q [B, Hq, S, D], k/v [B, Hkv, T, D]; GQA without repeating.

        `mask` is None, a boolean (True = attend) or an additive float array broadcastable to
        [B, Hq, S, T], or "causal" (bottom-right: query i sees keys up to T - S + i; only where
        `causal_reads`)."""
        raise NotImplementedError

    def rope_table(self, position_ids, inv_freq: np.ndarray, scaling: float):
        """cos and sin [B, S, 1, 1, R/2] (float32) of position_ids × inv_freq, times `scaling`: the rotary table
        QKVHeads reads (rewrites/qkv_heads.py; optional with `qkv_heads`, `offers` says whether a backend has it)."""
        raise NotImplementedError

    def qkv_heads(self, qkv, cos, sin, weight, weight_rot, heads: int, kv_heads: int, eps: float | None,
                  heads_first: bool = False):
        """A fused QKV output [B, S, (Hq + 2Hkv)·D] as heads [B, S, Hq + 2Hkv, D] ([B, H, S, D] with `heads_first`),
        q and k RMS-normalized by `weight` (eps None: not normalized) and rotated by (cos, sin), v as it came: one
        fusable expression where the backend compiles (optional, as `rope_table`)."""
        raise NotImplementedError

    def offers(self, method: str) -> bool:
        """Whether this backend implements an optional primitive (`rope_table`, `qkv_heads`)."""
        return getattr(type(self), method) is not getattr(Backend, method)

    def prepare_quantized(self, q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None,
                          block: int, bits: int) -> QuantizedWeight:
        """Convert a blocked DequantizeLinear weight once, at load.

        q [K, N] unsigned integers (one value per byte), scale/zero_point [K/block, N]: the weight is
        (q - zero_point) * scale, blocks along K (the MatMul's reduction dim). This default dequantizes it to the
        scales' float dtype ("dequant")."""
        w = dequantize_blocked(q, scale, zero_point, block).astype(scale.dtype, copy=False)
        return QuantizedWeight(self.asarray(w), q.shape[0], q.shape[1], bits, block, "dequant")

    def quantized_matmul(self, x, w: QuantizedWeight):
        """x [..., K] @ dequantize(w) [K, N] (this default: `w` dequantized at load)."""
        return self.matmul(x, w.data)

    def quantized_gather(self, w: QuantizedWeight, ids):
        """Rows `ids` (any shape) of the [N, K] table whose transpose `w` holds, dequantized: [*ids, K]
        (`quantized_gather_kind`: the kind of `w` it takes)."""
        raise NotImplementedError

    def prepare_experts(self, q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None,
                        block: int, bits: int) -> QuantizedWeight:
        """Convert a stacked blocked DequantizeLinear expert weight once, at load (fuselm::MoE).

        q [E, N, K] unsigned integers (one value per byte), scale/zero_point [E, N, K/block]: expert e's
        weight is (q[e] - zero_point[e]) * scale[e], [out, in] with blocks along K (the input dim). This default
        dequantizes them, as `prepare_quantized`'s."""
        w = dequantize_blocked(q, scale, zero_point, block, axis=-1).astype(scale.dtype, copy=False)
        return QuantizedWeight(self.asarray(w), q.shape[2], q.shape[1], bits, block, "dequant")

    def expert_matmul(self, x, w, experts):
        """Each token's selected experts: x [T, K] (shared by the slots) or [T, k, K] (one per slot),
        w the stacked [E, N, K] weights (an array, or `prepare_experts`'), experts int [T, k]
        -> [T, k, N] with out[t, j] = x[t(, j)] @ w[experts[t, j]]^T."""
        raise NotImplementedError

    def select_experts(self, scores, k: int):
        """(values, indices) of each row's k largest `scores` [T, E], in any order (the order of the
        chosen experts does not change a weighted sum); indices in the dtype `expert_matmul` takes."""
        return self.topk(scores, k, -1, True, False)

    def expert_mlp(self, x, gate_up, down, experts, act, weights=None, gate_up_bias=None, down_bias=None):
        """The selected experts' MLPs: x [T, K], gate_up [E, 2I, K], down [E, K, I], experts [T, k] ->
        [T, k, K] = down(act(gate, up)) (+ down_bias [E, K]) per (token, slot), `act` an op-table function
        of two arrays, gate_up_bias [E, 2I] (gpt-oss) added to each slot's gate/up projection; with
        `weights` [T, k]: [T, K] = sum over the slots of down(weights * act(gate, up)) + weights * down_bias.
        Two `expert_matmul`s here; a backend may keep its own order between them (MLX sorts once)."""
        gu = self.expert_matmul(x, gate_up, experts)
        if gate_up_bias is not None:
            gu = self.binary("add", gu, self.gather(gate_up_bias, experts, 0))
        inter = self.shape(gu)[-1] // 2
        gate, up = (self.slice(gu, (slice(None), slice(None), part)) for part in (slice(0, inter), slice(inter, None)))
        h = act(gate, up)
        w = None if weights is None else self.cast(self.reshape(weights, tuple(self.shape(weights)) + (1,)),
                                                   self.dtype(h))
        y = self.expert_matmul(h if w is None else self.binary("mul", h, w), down, experts)
        if down_bias is not None:
            db = self.gather(down_bias, experts, 0)
            y = self.binary("add", y, db if w is None else self.binary("mul", db, w))
        return y if w is None else self.reduce("sum", y, (1,), False)

    # --- prepared weights kept beside the model (runtime_metal/prepared.py) -------------------
    def prepared_format(self) -> str | None:
        """A tag naming the format of this backend's prepared weights (versions, compute dtype), or None
        when the backend keeps no prepared copy."""
        return None

    def save_prepared(self, path, arrays: dict, metadata: dict[str, str]) -> None:
        """Write prepared arrays (this backend's) and string metadata to a safetensors file."""
        raise NotImplementedError

    def load_prepared(self, path) -> tuple[dict, dict[str, str]]:
        """(arrays, metadata) of a file `save_prepared` wrote, the arrays memory-mapped where possible."""
        raise NotImplementedError

    def cache_write(self, buffer, new, pos):
        """buffer[:, :, pos:pos+S] = new for a KV buffer [B, H, L, D]; returns the buffer (mlx: a new one).

        `pos` is a Python int or a 0-d integer array (static-shape decode, compiled graphs)."""
        raise NotImplementedError

    # --- the 8-bit KV cache (format: kv_quant.py) --------------------------------------------
    # A stored cache is a tuple (q, scales, biases) of arrays [B, H, L, ·] in the backend's layout; these defaults
    # keep q uint8 [B, H, L, D], float16 scales and biases [B, H, L, D/group], and dequantize every block read.
    def kv_empty(self, shape: tuple, group: int) -> tuple:
        """A zeroed 8-bit cache for [B, H, L, D] values in groups of `group` channels."""
        b, h, length, d = shape
        return (self.full(shape, 0, TensorProto.UINT8),
                *(self.full((b, h, length, d // group), 0, TensorProto.FLOAT16) for _ in range(2)))

    def kv_quantize(self, x, group: int) -> tuple:
        """New rows x [B, H, S, D] (floats) as (q, scales, biases) in the stored layout, quantized against the
        float16 scale and bias actually stored, so dequantization undoes exactly this."""
        f32, levels = TensorProto.FLOAT, kv_quant.LEVELS
        b, h, s, d = self.shape(x)
        xg = self.reshape(self.cast(x, f32), (b, h, s, d // group, group))
        lo = self.reduce("min", xg, (4,), False)
        span = self.binary("sub", self.reduce("max", xg, (4,), False), lo)
        scale = self.cast(self.binary("div", span, self.full((), levels, f32)), TensorProto.FLOAT16)
        bias = self.cast(lo, TensorProto.FLOAT16)
        sf, bf = (self.reshape(self.cast(a, f32), (b, h, s, d // group, 1)) for a in (scale, bias))
        safe = self.where(self.binary("greater", sf, self.full((), 0, f32)), sf, self.full((), 1, f32))
        q = self.unary("round", self.binary("div", self.binary("sub", xg, bf), safe))
        q = self.binary("min", self.binary("max", q, self.full((), 0, f32)), self.full((), levels, f32))
        return self.reshape(self.cast(q, TensorProto.UINT8), (b, h, s, d)), scale, bias

    def kv_head_dim(self, stored: tuple) -> int:
        """head_dim D of a stored cache (the default layout keeps one q value per element)."""
        return int(stored[0].shape[-1])

    def kv_dequantize(self, stored: tuple, to: int):
        """Stored rows as floats [B, H, T, D] of ONNX element type `to`."""
        q, s, z = stored
        b, h, t, d = self.shape(q)
        g = self.shape(s)[-1]
        s, z = (self.reshape(self.cast(a, TensorProto.FLOAT), (b, h, t, g, 1)) for a in (s, z))
        x = self.reshape(self.cast(q, TensorProto.FLOAT), (b, h, t, g, d // g))
        x = self.binary("add", self.binary("mul", x, s), z)
        return self.cast(self.reshape(x, (b, h, t, d)), to)

    def kv_scores(self, q, block: tuple):
        """q [B, Hkv, R, D] (query heads grouped per kv head, already scaled) · the block's keysᵀ: f32 [B, Hkv, R, T]."""
        k = self.kv_dequantize(block, TensorProto.FLOAT)
        return self.matmul(self.cast(q, TensorProto.FLOAT), self.transpose(k, (0, 1, 3, 2)))

    def kv_values(self, p, block: tuple):
        """p f32 [B, Hkv, R, T] · the block's values: f32 [B, Hkv, R, D]."""
        return self.matmul(self.cast(p, TensorProto.FLOAT), self.kv_dequantize(block, TensorProto.FLOAT))


def dequantize_blocked(q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, block: int,
                       axis: int = 0) -> np.ndarray:
    """Host reference of a blocked DequantizeLinear along `axis` (0: [K, N] weights; -1: stacked [E, N, K]
    experts)."""
    k = q.shape[axis]
    cut = (slice(None),) * (axis % q.ndim) + (slice(0, k),)
    s = np.repeat(scale.astype(np.float32), block, axis=axis)[cut]
    z = np.repeat(zero_point.astype(np.float32), block, axis=axis)[cut] if zero_point is not None else 0.0
    return (q.astype(np.float32) - z) * s


class StepQueue:
    """How generation queues its decode steps on the device (Session.generate).

    `run(y, step, steady, n)` yields the n tokens whose first is `y` (the prefill's pick, not yet computed):
    `step(y)` builds the next token's step from the token before, `steady()` says whether the next step to
    build reads nothing back to the host. Here (one thread) each step is queued before the token before it
    is read (async_eval on a lazy backend), so the host builds step n+1 while the device runs step n; a
    backend whose host can also build while it queues returns its own (MLX: mlx_backend.ThreadedSteps).
    FINISH sent in for a token: the next token, whose step is queued already, comes and the run ends
    (step_runs.py)."""

    what = ""  # how the steps are queued, when describe() should say so

    def __init__(self, backend: Backend):
        self.b = backend

    def run(self, y, step, steady, n: int):
        b = self.b
        b.async_eval(y)
        for i in range(n):
            nxt = None
            if i + 1 < n:
                nxt = step(y)
                b.async_eval(nxt)
            if (yield b.item(y)) == FINISH:
                if nxt is not None:
                    yield b.item(nxt)
                return
            y = nxt
