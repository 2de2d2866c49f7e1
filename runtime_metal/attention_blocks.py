"""Attention over the cache one block of keys at a time, with an online softmax (flash-attention style).

softmax(q kᵀ·scale + mask) v is computed without the [S × T] score matrix: for each block of keys,
    s = q·kᵀ (+ mask),  m' = max(m, rowmax s),  p = exp(s − m'),
    l = l·exp(m − m') + Σp,  acc = acc·exp(m − m') + p·v
and y = acc / l at the end. Its two −inf guards: a row whose keys so far are all
masked has m = m' = −inf, where exp(m − m') and exp(s − m') would be exp(NaN); here the reference
max is replaced by 0 when it is −inf, so the rescale factor exp(−inf − 0) and the weights of masked
keys exp(−inf − 0) are exactly 0, and a row that never sees a key (l = 0) comes out as 0.

Used for (runtime_metal/ops_nn.py Attention):
- a cache stored in another format than the compute dtype (float16, 8-bit: kvcache.py): each block
  is read in its stored form (the backend's kv_scores / kv_values: MLX quantized matmuls, torch
  dequantizes the block on the fly), so the cache is never widened to f32 as a whole;
- long prompts on any cache: a prefill chunk of S queries against T keys whose scores would exceed
  LONG_SCORES elements; the scores held at once are bounded by SCORE_BUDGET.
Query heads are grouped per kv head ([B, Hkv, Hq/Hkv·S, D]), so K/V are never repeated (GQA).
"""

from __future__ import annotations

import numpy as np

from .backends import kv_quant
from .kvcache import StoredKV

LONG_SCORES = 1 << 23  # Hq·S·T above this (32 MiB of f32 scores): blocked even for a plain float cache
SCORE_BUDGET = 1 << 23  # scores of one block: Hq·S·Tb ≤ this
MIN_BLOCK = 256


def wanted(b, q, k, v) -> bool:
    """Whether Attention should run blocked: a stored (non-compute-dtype) cache, or a long prompt."""
    if isinstance(k, StoredKV) or isinstance(v, StoredKV):
        return True
    _, hq, s, _ = b.shape(q)
    return hq * s * b.shape(k)[2] > LONG_SCORES and s > 1


def attention(b, q, k, v, mask, scale: float):
    """softmax(q kᵀ·scale + mask) v for q [B, Hq, S, D] and k/v arrays or StoredKV [B, Hkv, T, ·];
    mask None, bool (True attends) or additive, broadcastable to [B, Hq, S, T]. Returns [B, Hq, S, Dv]
    in q's dtype."""
    bsz, hq, s, d = b.shape(q)
    hkv, t = _shape(b, k)[1:3]
    r = hq // hkv
    length = _read_length(k, v, t)
    block = max(MIN_BLOCK, SCORE_BUDGET // max(1, hq * s))
    if b.kv_block_keys and any(isinstance(x, StoredKV) and x.quantized for x in (k, v)):
        block = min(block, b.kv_block_keys)
    qg = b.reshape(b.cast(q, 1), (bsz, hkv, r * s, d))
    qg = b.binary("mul", qg, _f32(b, scale))
    if mask is None and 0 < length <= block:  # one block, no masked row: a plain softmax (mlx-lm's quantized
        # sdpa: two quantized matmuls around it on MLX)
        p = b.softmax(_scores(b, qg, k, 0, length), 3)
        return b.cast(b.reshape(_values(b, p, v, 0, length), (bsz, hq, s, -1)), b.dtype(q))
    mask5 = _mask5(b, mask, hkv, r)
    m = l_sum = acc = None
    for t0 in range(0, length, block):
        t1 = min(length, t0 + block)
        sc = b.reshape(_scores(b, qg, k, t0, t1), (bsz, hkv, r, s, t1 - t0))
        if mask5 is not None:
            mb = mask5 if b.shape(mask5)[-1] == 1 else b.slice(mask5, (Ellipsis, slice(t0, t1)))
            sc = b.where(mb, sc, _f32(b, -np.inf)) if b.dtype(mb) == 9 else b.binary("add", sc, b.cast(mb, 1))
        top = b.reduce("max", sc, (4,), True)
        m_new = top if m is None else b.binary("max", m, top)
        ref = b.where(b.binary("equal", m_new, _f32(b, -np.inf)), _f32(b, 0.0), m_new)  # the −inf guards
        p = b.unary("exp", b.binary("sub", sc, ref))
        pv = b.reshape(_values(b, b.reshape(p, (bsz, hkv, r * s, t1 - t0)), v, t0, t1), (bsz, hkv, r, s, -1))
        block_sum = b.reduce("sum", p, (4,), True)
        if m is None:
            l_sum, acc = block_sum, pv
        else:
            alpha = b.unary("exp", b.binary("sub", m, ref))
            l_sum = b.binary("add", b.binary("mul", l_sum, alpha), block_sum)
            acc = b.binary("add", b.binary("mul", acc, alpha), pv)
        m = m_new
    if acc is None:  # no keys at all
        return b.full((bsz, hq, s, _shape(b, v)[3]), 0, b.dtype(q))
    l_sum = b.where(b.binary("equal", l_sum, _f32(b, 0.0)), _f32(b, 1.0), l_sum)
    y = b.binary("div", acc, l_sum)
    return b.cast(b.reshape(y, (bsz, hq, s, b.shape(y)[-1])), b.dtype(q))


def _f32(b, value):
    return b.asarray(np.array(value, np.float32))


def _shape(b, x) -> tuple[int, ...]:
    return tuple(int(d) for d in (x.shape if isinstance(x, StoredKV) else b.shape(x)))


def _read_length(k, v, t: int) -> int:
    """Rows to read: all T, or only those written when the host knows it (static decode on CPU)."""
    known = [x.valid for x in (k, v) if isinstance(x, StoredKV) and x.valid is not None]
    return min([t, *known])


def _mask5(b, mask, hkv: int, r: int):
    """The mask as [mb, Hkv or 1, r or 1, S or 1, T or 1], matching scores [B, Hkv, r, S, T]."""
    if mask is None:
        return None
    shape = (1,) * (4 - len(b.shape(mask))) + tuple(b.shape(mask))
    mb, mh, ms, mt = shape
    if mh == 1:
        return b.reshape(mask, (mb, 1, 1, ms, mt))
    return b.reshape(mask, (mb, hkv, r, ms, mt))


def _block(b, x, t0: int, t1: int):
    """Keys/values t0..t1: a float array (f32) or a quantized tuple."""
    if isinstance(x, StoredKV) and x.quantized:
        return kv_quant.rows(x.data, t0, t1)
    return b.cast(b.slice(x.data if isinstance(x, StoredKV) else x, (slice(None), slice(None), slice(t0, t1))), 1)


def _scores(b, qg, k, t0: int, t1: int):
    blk = _block(b, k, t0, t1)
    return b.kv_scores(qg, blk) if isinstance(blk, tuple) else b.matmul(qg, b.transpose(blk, (0, 1, 3, 2)))


def _values(b, p, v, t0: int, t1: int):
    blk = _block(b, v, t0, t1)
    return b.kv_values(p, blk) if isinstance(blk, tuple) else b.matmul(p, blk)
