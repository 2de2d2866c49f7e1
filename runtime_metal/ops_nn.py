"""Neural-network ops: norms, attention, rotary embeddings, (de)quantization, KV-cache appends.

Fused ops call the backend's fused kernel; each has an `unfused` twin built from elementary
primitives the way the op's ONNX function body computes it, which `no_fused_kernels` selects
(fuselm::FusedRoPE runs its model-local FunctionProto instead: see executor.py).
"""

from __future__ import annotations

import numpy as np

from fuselm import contract
from fuselm.errors import FuselmError

from . import attention_blocks
from .kvcache import CacheView, StoredKV
from .ops import _axis, _scalar, op

RUNTIME = "fuselm.runtime"  # ops the runtime introduces at load; never written to a file


# --- normalization -----------------------------------------------------------------------
def _rms_norm_unfused(b, x, scale, *, axis=-1, epsilon=1e-5, stash_type=1):
    rank = len(b.shape(x))
    axes = tuple(range(_axis(axis, rank), rank))
    xf = b.cast(x, stash_type)
    ms = b.reduce("mean", b.binary("mul", xf, xf), axes, True)
    rms = b.unary("sqrt", b.binary("add", ms, _scalar(b, ms, epsilon)))
    return b.binary("mul", b.cast(b.binary("div", xf, rms), b.dtype(x)), scale)


@op("RMSNormalization", fused=True, unfused=_rms_norm_unfused)
def RMSNormalization(b, x, scale, *, axis=-1, epsilon=1e-5, stash_type=1):
    rank = len(b.shape(x))
    if _axis(axis, rank) != rank - 1 or len(b.shape(scale)) > 1:
        return _rms_norm_unfused(b, x, scale, axis=axis, epsilon=epsilon, stash_type=stash_type)
    if b.dtype(x) != stash_type:
        return b.cast(b.rms_norm(b.cast(x, stash_type), b.cast(scale, stash_type), epsilon), b.dtype(x))
    return b.rms_norm(x, scale, epsilon)


def _layer_norm_unfused(b, x, scale, bias=None, *, axis=-1, epsilon=1e-5, stash_type=1, _n_outputs=1):
    rank = len(b.shape(x))
    axes = tuple(range(_axis(axis, rank), rank))
    xf = b.cast(x, stash_type)
    mean = b.reduce("mean", xf, axes, True)
    d = b.binary("sub", xf, mean)
    var = b.reduce("mean", b.binary("mul", d, d), axes, True)
    inv = b.unary("reciprocal", b.unary("sqrt", b.binary("add", var, _scalar(b, var, epsilon))))
    y = b.binary("mul", b.cast(b.binary("mul", d, inv), b.dtype(x)), scale)
    y = b.binary("add", y, bias) if bias is not None else y
    return (y, mean, inv)[:_n_outputs]


@op("LayerNormalization", fused=True, unfused=_layer_norm_unfused, wants_outputs=True)
def LayerNormalization(b, x, scale, bias=None, *, axis=-1, epsilon=1e-5, stash_type=1, _n_outputs=1):
    rank = len(b.shape(x))
    if _n_outputs > 1 or _axis(axis, rank) != rank - 1 or len(b.shape(scale)) > 1 or b.dtype(x) != stash_type:
        return _layer_norm_unfused(b, x, scale, bias, axis=axis, epsilon=epsilon, stash_type=stash_type,
                                   _n_outputs=_n_outputs)
    return b.layer_norm(x, scale, bias, epsilon)


# --- attention ------------------------------------------------------------------------------
def _heads_first(b, x, heads: int):
    """[B, S, heads*D] -> [B, heads, S, D] (Attention's 3-D input form)."""
    bsz, s, hidden = b.shape(x)
    return b.transpose(b.reshape(x, (bsz, s, heads, hidden // heads)), (0, 2, 1, 3))


def _check_3d_heads(b, Q, K, V, q_heads: int, kv_heads: int) -> None:
    """3-D q/k/v [B, S, heads*D]: the head counts must split the widths into one head size (as
    onnxruntime requires); anything else is a damaged graph, not a shape to guess."""
    widths = (b.shape(Q)[2], b.shape(K)[2], b.shape(V)[2])
    if len(b.shape(K)) != 3 or len(b.shape(V)) != 3 or q_heads <= 0 or kv_heads <= 0 or q_heads % kv_heads \
            or widths[0] % q_heads or widths[1] % kv_heads or widths[2] % kv_heads \
            or widths[0] // q_heads != widths[1] // kv_heads:
        raise FuselmError(f"Attention: q_num_heads {q_heads} / kv_num_heads {kv_heads} do not split its 3-D inputs "
                          f"(widths {widths}, ranks {len(b.shape(Q))}/{len(b.shape(K))}/{len(b.shape(V))}) into "
                          "heads of one size; the graph is invalid")


def _append(b, past, new, stored_ok: bool = False):
    if past is None:
        return new
    if isinstance(past, CacheView):
        return past.append(b, new, stored_ok)
    return b.concat([past, new], 2)


def _step_memo(b, key: tuple, keep: tuple, make):
    """One value per graph run for `key` (every layer's Attention builds the same mask from the same inputs):
    the executor gives the backend a fresh `step_memo` per run. The memo holds `keep`, the objects whose ids
    are in the key, so no id is reused by another array within the run."""
    memo = b.step_memo
    if memo is None:
        return make()
    if key not in memo:
        memo[key] = (make(), keep)
    return memo[key][0]


def _attention_bias(b, attn_mask, past, s: int, t: int, is_causal: int, nonpad=None, left: int = -1, right: int = -1):
    """The mask Attention applies (bool or additive) or None. Causal and windows are aligned bottom-right:
    query i sits at position offset + i, offset = the keys before it (past length, nonpad - S, or pos)."""
    static = isinstance(past, CacheView) and past.static
    key = ("bias", id(attn_mask), id(past.pos) if static else None, None if past is None else b.shape(past)[2], s, t,
           is_causal, id(nonpad), left, right)
    keep = (attn_mask, past.pos if static else None, nonpad)
    return _step_memo(b, key, keep, lambda: _make_bias(b, attn_mask, past, s, t, is_causal, nonpad, left, right))


def _make_bias(b, attn_mask, past, s, t, is_causal, nonpad, left, right):
    mask = attn_mask
    if mask is not None and b.shape(mask)[-1] < t:  # a short mask is padded as masked
        pad = [(0, 0)] * (len(b.shape(mask)) - 1) + [(0, t - b.shape(mask)[-1])]
        mask = b.pad(mask, pad, "constant", False if b.dtype(mask) == 9 else -np.inf)
    static = isinstance(past, CacheView) and past.static
    allowed = None
    if is_causal or left >= 0 or right >= 0 or (static and mask is None):
        j = b.reshape(b.arange(0, t, 1, 7), (1, 1, 1, t))
        i = b.reshape(b.arange(0, s, 1, 7), (1, 1, s, 1))
        if static:
            offset = b.reshape(b.cast(past.pos, 7), (1, 1, 1, 1))
        elif nonpad is not None and past is None:
            offset = b.binary("sub", b.reshape(b.cast(nonpad, 7), (-1, 1, 1, 1)), _scalar(b, i, s))
        else:
            offset = _scalar(b, i, b.shape(past)[2] if past is not None else 0)
        qpos = b.binary("add", i, offset)
        if is_causal:
            allowed = b.binary("less_equal", j, qpos)
        elif static:  # only the rows written so far hold keys
            allowed = b.binary("less", j, b.binary("add", offset, _scalar(b, offset, s)))
        for bound, op, sign in ((left, "greater_equal", "sub"), (right, "less_equal", "add")):
            if bound >= 0:
                inside = b.binary(op, j, b.binary(sign, qpos, _scalar(b, qpos, bound)))
                allowed = inside if allowed is None else b.binary("and", allowed, inside)
    if nonpad is not None:
        valid = b.binary("less", b.reshape(b.arange(0, t, 1, 7), (1, 1, 1, t)), b.reshape(b.cast(nonpad, 7), (-1, 1, 1, 1)))
        allowed = valid if allowed is None else b.binary("and", allowed, valid)
    if allowed is None:
        return mask
    if mask is None:
        return allowed
    if b.dtype(mask) == 9:
        return b.binary("and", mask, allowed)
    return b.where(allowed, mask, _scalar(b, mask, -np.inf))


def _attention(b, Q, K, V, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None, kv_rows=None, *,
               is_causal=0, kv_num_heads=0, q_num_heads=0, qk_matmul_output_mode=0, scale=None, softcap=0.0,
               softmax_precision=None, left_window_size=-1, right_window_size=-1, causal_rows=None, causal_chunk=None,
               _n_outputs=1, _ctx=None, fused=True):
    three_d = len(b.shape(Q)) == 3
    if three_d:
        _check_3d_heads(b, Q, K, V, q_num_heads, kv_num_heads)
        Q, K, V = _heads_first(b, Q, q_num_heads), _heads_first(b, K, kv_num_heads), _heads_first(b, V, kv_num_heads)
    elif (q_num_heads and b.shape(Q)[1] != q_num_heads) or (kv_num_heads and b.shape(K)[1] != kv_num_heads):
        # onnxruntime refuses this too: heads that contradict the attributes mean a damaged graph
        raise FuselmError(f"Attention: q_num_heads {q_num_heads} / kv_num_heads {kv_num_heads} contradict the inputs' "
                          f"{b.shape(Q)[1]} / {b.shape(K)[1]} heads; the graph is invalid")
    s = b.shape(Q)[2]
    blockwise = fused and not softcap and _n_outputs < 4 and softmax_precision in (None, b.dtype(Q))
    scale = float(1.0 / np.sqrt(b.shape(Q)[3])) if scale is None else float(scale)
    rows = _filled_rows(past_key, past_value, s, causal_rows, _ctx, causal_chunk) \
        if blockwise and nonpad_kv_seqlen is None else None
    qk_out = None
    if rows is not None:  # the filled rows, and no array mask (rewrites/causal_masks.py)
        (t0, t1), causal = rows
        if kv_rows is not None and past_key.heads is not None and _same(past_key.buffer, past_value.buffer):
            # one buffer holds K and V (kvcache.packed_pairs), and the layer made their rows as one array
            K, V = past_key.append_both(past_value, b, b.transpose(kv_rows, (0, 2, 1, 3)), True, (t0, t1))
        else:
            K, V = past_key.append(b, K, True, (t0, t1)), past_value.append(b, V, True, (t0, t1))
        stored = isinstance(K, StoredKV) or isinstance(V, StoredKV)
        if stored or (attention_blocks.wanted(b, Q, K, V) and not b.long_sdpa):
            Y = attention_blocks.attention(b, Q, K, V, _causal(b, s, t1 - t0) if causal else None, scale)
        else:
            Y = b.sdpa(Q, K, V, "causal" if causal else None, scale)
    else:
        K, V = _append(b, past_key, K, blockwise), _append(b, past_value, V, blockwise)
        t = K.shape[2] if isinstance(K, StoredKV) else b.shape(K)[2]
        mask = _attention_bias(b, attn_mask, past_key, s, t, is_causal, nonpad_kv_seqlen, left_window_size,
                               right_window_size)
        if blockwise:
            # a cache stored as float16/int8, or a long prompt: keys in blocks, online softmax
            Y = attention_blocks.attention(b, Q, K, V, mask, scale) if attention_blocks.wanted(b, Q, K, V) else \
                b.sdpa(Q, K, V, mask, scale)
            if mask is not None and (mask is not attn_mask or b.dtype(mask) == 9):
                # a query row with every key masked attends nothing (Y = 0), as the spec says; the graph's
                # own float masks (finite minimum) never mask a whole row, so decode skips this
                attends = _step_memo(b, ("attends", id(mask)), (mask,), lambda: _row_attends(b, mask))
                Y = b.where(attends, Y, _scalar(b, Y, 0))
        else:
            Y, qk_out = _sdpa_unfused(b, Q, K, V, mask, scale, softcap, softmax_precision, qk_matmul_output_mode)
    if three_d:
        bsz, h, _, dv = b.shape(Y)
        Y = b.reshape(b.transpose(Y, (0, 2, 1, 3)), (bsz, s, h * dv))
    return (Y, K, V, qk_out)[:max(_n_outputs, 1)]


def _filled_rows(past_key, past_value, s: int, window, ctx, chunk=None) -> tuple | None:
    """((t0, t1), causal) when this Attention may read cache rows t0..t1 without an array mask: the backend
    reads the filled rows (ctx["causal_reads"], set by the session for its plain feeds), the mask is a causal
    band (`causal_rows`, rewrites/causal_masks.py) and the cache position is known on the host. Causal is needed only
    for a prompt chunk (S > 1); a window cuts the rows at decode and must not cut into a chunk's rows; a chunked
    band (`causal_chunk`) starts at its block's first row, and queries in two blocks take the graph's mask."""
    if window is None or not (ctx or {}).get("causal_reads") or not isinstance(past_key, CacheView) or \
            not isinstance(past_value, CacheView) or not isinstance(past_key.pos, int):
        return None
    t1 = past_key.pos + s
    t0 = first_row(t1, window, chunk)
    if s > 1 and (window and t1 > window or chunk and t0 > t1 - s):  # not one causal triangle: the graph's mask
        return None
    return (t0, t1), s > 1


def first_row(t1: int, window: int, chunk: int | None) -> int:
    """The first cache row the last of the queries ending at row t1 attends (a window, or its chunk's start)."""
    if chunk:
        return (t1 - 1) // chunk * chunk
    return max(0, t1 - window) if window else 0


def _same(a, b) -> bool:
    """The same cache storage (an array, or the arrays of an 8-bit cache)."""
    return (a[0] if isinstance(a, tuple) else a) is (b[0] if isinstance(b, tuple) else b)


def _causal(b, s: int, t: int):
    """The bottom-right causal mask [S, T] (bool) for the blockwise path, which takes arrays only."""
    j = b.reshape(b.arange(0, t, 1, 7), (1, t))
    i = b.reshape(b.arange(t - s, t, 1, 7), (s, 1))
    return b.binary("less_equal", j, i)


def _row_attends(b, mask):
    """[..., S, 1]: whether a query row has at least one key it may attend."""
    if b.dtype(mask) == 9:
        return b.binary("greater", b.reduce("max", b.cast(mask, 1), (len(b.shape(mask)) - 1,), True), _scalar(b, b.cast(mask, 1), 0))
    top = b.reduce("max", mask, (len(b.shape(mask)) - 1,), True)
    return b.binary("greater", top, _scalar(b, top, -np.inf))


def _sdpa_unfused(b, Q, K, V, mask, scale, softcap, softmax_precision, mode):
    """The Attention-23 function body: GQA by repeating K/V heads, scaled QKᵀ, mask, softmax, ·V."""
    hq, hkv = b.shape(Q)[1], b.shape(K)[1]
    if hq != hkv:
        rep = hq // hkv
        bsz, _, t, d = b.shape(K)
        K = b.reshape(b.expand(b.reshape(K, (bsz, hkv, 1, t, d)), (bsz, hkv, rep, t, d)), (bsz, hq, t, d))
        dv = b.shape(V)[3]
        V = b.reshape(b.expand(b.reshape(V, (bsz, hkv, 1, t, dv)), (bsz, hkv, rep, t, dv)), (bsz, hq, t, dv))
    qk = b.matmul(Q, b.transpose(K, (0, 1, 3, 2)))
    qk = b.binary("mul", qk, _scalar(b, qk, scale))
    if softcap:
        qk = b.binary("mul", b.unary("tanh", b.binary("div", qk, _scalar(b, qk, softcap))), _scalar(b, qk, softcap))
    qk_out = qk
    if mask is not None:
        qk = b.where(mask, qk, _scalar(b, qk, -np.inf)) if b.dtype(mask) == 9 else b.binary("add", qk, mask)
    if mode == 2:
        qk_out = qk
    dtype = b.dtype(qk)
    probs = b.softmax(b.cast(qk, softmax_precision) if softmax_precision else qk, 3)
    if mask is not None:  # a row with every key masked attends nothing (Y = 0), as the function body says
        probs = b.where(_row_attends(b, mask), probs, _scalar(b, probs, 0))
    probs = b.cast(probs, dtype)
    if mode == 3:
        qk_out = probs
    return b.matmul(probs, V), qk_out


def _attention_unfused(b, *inputs, **attrs):
    return _attention(b, *inputs, **attrs, fused=False)


@op("Attention", fused=True, unfused=_attention_unfused, wants_outputs=True, wants_context=True)
def Attention(b, *inputs, **attrs):
    return _attention(b, *inputs, **attrs)


# --- rotary embeddings ---------------------------------------------------------------------
@op(contract.ROPE_OP, domain=contract.DOMAIN, fused=True, wants_context=True)
def FusedRoPE(b, x, position_ids, norm_weight=None, *, inv_freq, attention_scaling=1.0, interleaved=0, num_heads=0,
              epsilon=contract.RMS_EPSILON, _ctx=None):
    """x [B,S,H,D] (or [B,S,H·D] with num_heads), each head RMS-normalized by `norm_weight` first when given:
    the backend's rms_norm and rope kernels (reshapes are views)."""
    shape = b.shape(x)
    if num_heads:
        x = b.reshape(x, (shape[0], shape[1], num_heads, shape[2] // num_heads))
    if norm_weight is not None:
        x = RMSNormalization(b, x, norm_weight, axis=-1, epsilon=epsilon, stash_type=1)
    offset = (_ctx or {}).get("rope_offset")
    y = b.rope(x, position_ids, inv_freq, float(attention_scaling), bool(interleaved), offset=offset)
    return b.reshape(y, shape) if num_heads else y


@op(contract.SWIGLU_OP, domain=contract.DOMAIN, fused=True)
def SwiGLU(b, x):
    """gate·Sigmoid(gate)·up of x = [gate | up] (last axis): slices are views, the rest `Backend.silu_gate`
    (MLX: one compiled kernel at every shape, so a prompt chunk holds no [S, I] sigmoid or SiLU array)."""
    i = b.shape(x)[-1] // 2
    return b.silu_gate(b.slice(x, (Ellipsis, slice(0, i))), b.slice(x, (Ellipsis, slice(i, 2 * i))))


@op("RotaryEmbedding")
def RotaryEmbedding(b, x, cos_cache, sin_cache, position_ids=None, *, interleaved=0, num_heads=0,
                    rotary_embedding_dim=0):
    shape = b.shape(x)
    if len(shape) == 4:  # [B, H, S, D] -> [B, S, H, D]
        x = b.transpose(x, (0, 2, 1, 3))
    else:
        x = b.reshape(x, (shape[0], shape[1], num_heads, shape[2] // num_heads))
    d = b.shape(x)[3]
    rd = rotary_embedding_dim or d
    if position_ids is not None:
        cos_cache, sin_cache = b.gather(cos_cache, position_ids, 0), b.gather(sin_cache, position_ids, 0)
    cos = b.reshape(cos_cache, b.shape(cos_cache)[:2] + (1, rd // 2))
    sin = b.reshape(sin_cache, b.shape(sin_cache)[:2] + (1, rd // 2))
    xr = b.slice(x, (Ellipsis, slice(0, rd)))
    if interleaved:
        x1, x2 = b.slice(xr, (Ellipsis, slice(0, None, 2))), b.slice(xr, (Ellipsis, slice(1, None, 2)))
    else:
        x1, x2 = b.slice(xr, (Ellipsis, slice(0, rd // 2))), b.slice(xr, (Ellipsis, slice(rd // 2, rd)))
    real = b.binary("sub", b.binary("mul", cos, x1), b.binary("mul", sin, x2))
    imag = b.binary("add", b.binary("mul", sin, x1), b.binary("mul", cos, x2))
    if interleaved:
        s4 = b.shape(real)
        y = b.reshape(b.concat([b.reshape(real, s4 + (1,)), b.reshape(imag, s4 + (1,))], 4), s4[:3] + (rd,))
    else:
        y = b.concat([real, imag], 3)
    if rd < d:
        y = b.concat([y, b.slice(x, (Ellipsis, slice(rd, d)))], 3)
    if len(shape) == 4:
        return b.transpose(y, (0, 2, 1, 3))
    return b.reshape(y, shape)


# --- quantization -------------------------------------------------------------------------------
def _expand_blocks(b, v, axis: int, block: int, size: int):
    """Repeat each entry of `v` `block` times along `axis`, cut to `size` (blocked quantization)."""
    shape = list(b.shape(v))
    rep = shape[:axis + 1] + [block] + shape[axis + 1:]
    v = b.expand(b.reshape(v, tuple(shape[:axis + 1] + [1] + shape[axis + 1:])), tuple(rep))
    merged = shape[:axis] + [shape[axis] * block] + shape[axis + 1:]
    v = b.reshape(v, tuple(merged))
    index = [slice(None)] * len(merged)
    index[axis] = slice(0, size)
    return b.slice(v, tuple(index))


def _per_tensor(b, scale, block: int) -> bool:
    return len(b.shape(scale)) == 0 or (len(b.shape(scale)) == 1 and b.shape(scale)[0] == 1 and not block)


def _per_axis(b, v, x_shape, axis: int, block: int):
    if _per_tensor(b, v, block):
        return v
    if block:
        return _expand_blocks(b, v, axis, block, x_shape[axis])
    shape = [1] * len(x_shape)
    shape[axis] = x_shape[axis]
    return b.reshape(v, tuple(shape))


@op("DequantizeLinear")
def DequantizeLinear(b, x, scale, zero_point=None, *, axis=1, block_size=0, output_dtype=0):
    shape = b.shape(x)
    axis = _axis(axis, len(shape)) if shape and not _per_tensor(b, scale, block_size) else 0  # else ignored
    xf = b.cast(x, 1)
    if zero_point is not None:
        xf = b.binary("sub", xf, b.cast(_per_axis(b, zero_point, shape, axis, block_size), 1))
    y = b.binary("mul", xf, b.cast(_per_axis(b, scale, shape, axis, block_size), 1))
    return b.cast(y, output_dtype or b.dtype(scale))


@op("QuantizeLinear")
def QuantizeLinear(b, x, scale, zero_point=None, *, axis=1, block_size=0, output_dtype=0, saturate=1,
                   precision=0):
    shape = b.shape(x)
    axis = _axis(axis, len(shape)) if shape and not _per_tensor(b, scale, block_size) else 0  # else ignored
    to = b.dtype(zero_point) if zero_point is not None else (output_dtype or 2)
    lo, hi = {2: (0, 255), 3: (-128, 127), 4: (0, 65535), 5: (-32768, 32767)}[to]
    y = b.unary("round", b.binary("div", b.cast(x, 1), b.cast(_per_axis(b, scale, shape, axis, block_size), 1)))
    if zero_point is not None:
        y = b.binary("add", y, b.cast(_per_axis(b, zero_point, shape, axis, block_size), 1))
    y = b.binary("min", b.binary("max", y, _scalar(b, y, lo)), _scalar(b, y, hi))
    return b.cast(y, to)


@op("QMatMul", domain=RUNTIME)
def QMatMul(b, x, *, weight, source=""):
    """DequantizeLinear -> MatMul folded at load into the backend's quantized matmul."""
    return b.quantized_matmul(x, weight)


@op("QGather", domain=RUNTIME)
def QGather(b, q, scale, zero_point, ids, *, axis=0, block_size=0, packed4=0):
    """DequantizeLinear -> Gather(axis 0) folded at load: gather quantized rows, dequantize only those.
    packed4=1: q is a uint4 table as stored, [rows, cols / 2] bytes (low nibble first)."""
    cols = b.shape(q)[1] * (2 if packed4 else 1)
    out_shape = tuple(b.shape(ids)) + (cols,)
    ids = b.reshape(ids, (-1,))
    rows = b.gather(q, ids, 0)
    if packed4:
        n = b.shape(ids)[0]
        lo = b.binary("bitwise_and", rows, _scalar(b, rows, 15))
        hi = b.binary("div", rows, _scalar(b, rows, 16))
        rows = b.reshape(b.concat([b.reshape(lo, (n, cols // 2, 1)), b.reshape(hi, (n, cols // 2, 1))], 2), (n, cols))
    if axis == 0:  # blocks run along the rows: row r uses scale row r // block
        sid = b.binary("div", ids, _scalar(b, ids, block_size))
        s, z = b.gather(scale, sid, 0), (b.gather(zero_point, sid, 0) if zero_point is not None else None)
        per = lambda v: v  # noqa: E731 - already one scale per gathered row
    else:
        s, z = b.gather(scale, ids, 0), (b.gather(zero_point, ids, 0) if zero_point is not None else None)
        per = lambda v: _expand_blocks(b, v, 1, block_size, b.shape(rows)[1])  # noqa: E731
    y = b.cast(rows, 1)
    if z is not None:
        y = b.binary("sub", y, b.cast(per(z), 1))
    return b.reshape(b.binary("mul", y, b.cast(per(s), 1)), out_shape)


@op("QGatherRows", domain=RUNTIME)
def QGatherRows(b, ids, *, weight, source=""):
    """DequantizeLinear -> Gather(axis 0) of a table a tied lm_head also reads, folded at load onto that head's
    prepared weight (`Backend.quantized_gather`): the table is held once, as mlx-lm's QuantizedEmbedding."""
    return b.quantized_gather(weight, ids)


@op("LastRows", domain=RUNTIME, wants_context=True)
def LastRows(b, x, *, _ctx=None):
    """The lm_head's input [B, S, hidden] cut to its last `logit_rows` positions when the run needs only those
    logits (a prefill chunk: the next token's; a verification step: the drafts'); all positions otherwise."""
    rows = (_ctx or {}).get("logit_rows")
    if rows is None or b.shape(x)[1] <= rows:
        return x
    return b.slice(x, (slice(None), slice(b.shape(x)[1] - rows, None)))


@op("KVAppend", domain=RUNTIME)
def KVAppend(b, past, new):
    """Concat(past_key_values.i.*, new, axis=2) rewritten at load: appends into the preallocated cache."""
    return _append(b, past, new)


@op("RoPETable", domain=RUNTIME)
def RoPETable(b, position_ids, *, inv_freq, attention_scaling=1.0):
    return b.rope_table(position_ids, inv_freq, float(attention_scaling))


@op("QKVHeads", domain=RUNTIME)
def QKVHeads(b, qkv, cos, sin, weight, weight_rot, *, heads, kv_heads, epsilon=None, heads_first=0):
    """Q, K, V [B, S, H·D] and the K and V rows [B, S, 2Hkv, D]; `heads_first` (a decode piece handing them to
    its attention, compiled.py): Q, K, V and the rows as [B, H, S, D], no merge and split between."""
    if heads_first:
        out = b.qkv_heads(qkv, cos, sin, weight, weight_rot, heads, kv_heads, epsilon, heads_first=True)
        return tuple(b.slice(out, (slice(None), slice(h0, h1))) for h0, h1 in
                     ((0, heads), (heads, heads + kv_heads), (heads + kv_heads, heads + 2 * kv_heads),
                      (heads, heads + 2 * kv_heads)))
    out = b.qkv_heads(qkv, cos, sin, weight, weight_rot, heads, kv_heads, epsilon)
    bsz, s, _, d = b.shape(out)

    def merged(h0, h1):
        return b.reshape(b.slice(out, (slice(None), slice(None), slice(h0, h1))), (bsz, s, (h1 - h0) * d))

    kv = b.slice(out, (slice(None), slice(None), slice(heads, heads + 2 * kv_heads)))
    return merged(0, heads), merged(heads, heads + kv_heads), merged(heads + kv_heads, heads + 2 * kv_heads), kv


__all__ = ["RUNTIME"]
