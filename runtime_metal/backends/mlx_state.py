"""The recurrent-state kernels on MLX: on a GPU each token's recurrence step is one mx.compile'd function (as
mlx-lm's gated_delta_ops / ssm step), so a decode step's recurrence is one fused kernel per layer instead of a
dozen ops; shapeless, so one compile serves every model and prompt.

Same semantics and layouts as state_kernels.py (fuselm/contract.py's ops); the state stays float32 (the inputs'
bfloat16 promotes to it inside the step) and each output is cast back to its input's dtype. A gated delta rule
prompt runs in chunks (state_kernels.gated_delta_chunked's algorithm: every chunk's own work one compiled function,
each step between chunks another), a Mamba-2 prompt in the dual form with every chunk at once (one compiled function).
"""

from __future__ import annotations

from functools import cache, lru_cache

import mlx.core as mx

from . import state_kernels

_COMPILED: dict = {}


def _fused(fn):
    """`fn` compiled (shapeless) on a GPU; as written on MLX's CPU backend (tests, correctness), which builds each
    compiled kernel with the system compiler: tens of seconds the first time for no speed that matters there."""
    if mx.default_device() != mx.gpu:
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = mx.compile(fn, shapeless=True)
    return _COMPILED[fn]


def _conv(x, past, weight):
    """x [B,S,C], past [B,K-1,C], weight [C,1,K] -> (y [B,S,C] float32, present [B,K-1,C]); K products, not compiled
    (its slices depend on the shapes)."""
    full = mx.concatenate([past, x.astype(past.dtype)], axis=1)
    s, taps = x.shape[1], weight.shape[-1]
    y = full[:, 0:s] * weight[:, 0, 0]
    for j in range(1, taps):
        y = y + full[:, j:j + s] * weight[:, 0, j]
    return y, full[:, s:]


def causal_conv1d(x, past, weight):
    y, present = _conv(x, past, weight)
    return y.astype(x.dtype), present


def _delta_step(state, q, k, v, g, beta):
    """state [B,H,Dv,Dk]; q, k [B,H,Dk]; v [B,H,Dv]; g [B,H,1|Dk] (the decay, exp'd); beta [B,H] -> (y [B,H,Dv,1],
    state). Three kernels: the decay folded into the first product ((S g) k = S (g k)), the update one elementwise
    kernel, the read a product."""
    recalled = state @ (g * k)[..., None]  # [B,H,Dv,1]
    state = state * g[:, :, None, :] + ((v[..., None] - recalled) * beta[..., None, None]) * k[:, :, None, :]
    return state @ q[..., None], state


def gated_delta(q, k, v, decay, beta, state):
    bsz, s, hk, _ = q.shape
    hv = v.shape[2]
    if hv != hk:  # each key head serves hv / hk consecutive value heads
        q, k = mx.repeat(q, hv // hk, axis=2), mx.repeat(k, hv // hk, axis=2)
    if s >= state_kernels.GDN_CHUNKED_FROM and decay.ndim == 3:
        return gated_delta_chunked(q, k, v, decay, beta, state)
    g = mx.exp(decay.astype(mx.float32)).reshape(bsz, s, hv, -1)
    ys = []
    for t in range(s):
        y, state = _fused(_delta_step)(state, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        ys.append(y[..., 0])
    return mx.stack(ys, axis=1).astype(v.dtype), state


@cache
def _masks(length: int):
    causal, strict, levels = state_kernels.chunk_masks(length)
    return mx.array(causal), mx.array(strict), [mx.array(m) for m in levels]


def _delta_chunks(q, k, v, g, beta, causal, strict, *levels):
    """Every chunk's share of state_kernels.gated_delta_chunked at once: q, k [B,H,N,L,Dk], v [B,H,N,L,Dv], g (the
    log decay), beta [B,H,N,L] -> (U, W, the intra-chunk scores, q·exp(cum), (k·exp(cum_L - cum))^T, exp(cum_L))."""
    cum = mx.cumsum(g, axis=-1)
    gaps = cum[..., :, None] - cum[..., None, :]
    within = mx.where(causal, mx.exp(mx.where(causal, gaps, 0.0)), 0.0)
    kt = k.swapaxes(-1, -2)
    kb = k * beta[..., None]
    t = mx.where(strict, (kb @ kt) * within, 0.0)
    inv = (causal & ~strict).astype(t.dtype)  # (I + t)^-1 by block doubling, from I (broadcast by the first level)
    for mask in levels:
        inv = inv - inv @ (mx.where(mask, t, 0.0) @ inv)
    last = g.sum(axis=-1, keepdims=True)  # cum's last column (a slice would keep it from compiling shapeless)
    return (inv @ (v * beta[..., None]), inv @ (kb * mx.exp(cum)[..., None]), (q @ kt) * within,
            q * mx.exp(cum)[..., None], (k * mx.exp(last - cum)[..., None]).swapaxes(-1, -2), mx.exp(last)[..., None])


def _delta_carry(st, u, w, scores, qd, kd, carry):
    """One chunk after the state St [B,H,Dk,Dv] it starts from -> (y [B,H,L,Dv], the state after it)."""
    v_new = u - w @ st
    return qd @ st + scores @ v_new, st * carry + kd @ v_new


def gated_delta_chunked(q, k, v, decay, beta, state):
    """state_kernels.gated_delta_chunked in mx ops (q, k one per value head)."""
    bsz, s, h, _ = q.shape
    length = state_kernels.GDN_CHUNK
    n = -(-s // length)
    pad = n * length - s

    def chunks(x):  # [B,S,H,...] -> [B,H,N,L,...] float32, zero-padded to whole chunks
        x = mx.pad(x.astype(mx.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) if pad else x.astype(mx.float32)
        x = x.reshape(bsz, n, length, *x.shape[2:])
        return x.transpose(0, 3, 1, 2, 4) if x.ndim == 5 else x.transpose(0, 3, 1, 2)

    causal, strict, levels = _masks(length)
    parts = _fused(_delta_chunks)(chunks(q), chunks(k), chunks(v), chunks(decay), chunks(beta), causal, strict, *levels)
    st, ys = state.swapaxes(-1, -2), []
    for i in range(n):
        y, st = _fused(_delta_carry)(st, *(p[:, :, i] for p in parts))
        ys.append(y)
    y = (ys[0] if n == 1 else mx.concatenate(ys, axis=2))[:, :, :s]
    return y.swapaxes(1, 2).astype(v.dtype), st.swapaxes(-1, -2)


def _ssm_step(state, x, dt, a_log, b, c, d, dt_bias, lo, hi):
    """Mamba-2, one token: state [B,H,P,N]; x [B,H,P]; dt [B,H]; b, c [B,H,N]; A_log, D, dt_bias [H]."""
    dt = mx.clip(mx.logaddexp(dt.astype(mx.float32) + dt_bias, 0.0), lo, hi)
    decay = mx.exp(-mx.exp(a_log.astype(mx.float32)) * dt)
    state = state * decay[..., None, None] + (dt[..., None] * x)[..., None] * b[:, :, None, :]
    return (state * c[:, :, None, :]).sum(axis=-1) + d[:, None] * x, state


@lru_cache(maxsize=64)
def _tri(n: int, k: int):
    """The mask j <= i + k of an [n, n] matrix, evaluated once (a constant, no kernels per prompt)."""
    mask = mx.tri(n, n, k, dtype=mx.bool_)
    mx.eval(mask)
    return mask


def _ssd(state, log_decay, xdt, b, c, causal, earlier):
    """state_kernels._ssm_chunks' every-chunk-at-once form with no reshape (it compiles shapeless): state [B,H,P,N],
    log_decay [B,H,n,L], xdt [B,H,n,L,P], b, c [B,H,n,L,N]; causal [L,L], earlier [n,n] (j < c) -> (y, state)."""
    cum = mx.cumsum(log_decay, axis=-1)
    within = mx.where(causal, mx.exp(mx.where(causal, cum[..., :, None] - cum[..., None, :], 0.0)), 0.0)
    y = ((c @ b.swapaxes(-1, -2)) * within) @ xdt
    own = log_decay.sum(axis=-1)  # [B,H,n]: each chunk's log decay
    carried = (xdt * mx.exp(own[..., None] - cum)[..., None]).swapaxes(-1, -2) @ b  # [B,H,n,P,N]
    ends = mx.cumsum(own, axis=-1)
    starts = ends - own
    weights = mx.where(earlier, mx.exp(mx.where(earlier, starts[..., :, None] - ends[..., None, :], 0.0)), 0.0)
    entering = (weights[:, :, None] @ carried.swapaxes(2, 3)).swapaxes(2, 3)  # [B,H,n,P,N]: over the chunk axis
    entering = entering + state[:, :, None] * mx.exp(starts)[..., None, None]
    y = y + (c @ entering.swapaxes(-1, -2)) * mx.exp(cum)[..., None]
    total = own.sum(axis=-1, keepdims=True)
    state = state * mx.exp(total)[..., None] + (carried * mx.exp(total - ends)[..., None, None]).sum(axis=2)
    return y, state


def ssm_chunked(x, dt, a_log, b, c, d, dt_bias, state, dt_min: float, dt_max: float):
    """Mamba-2 over a prompt: x [B,S,H,P], dt [B,S,H], B / C [B,S,G,N] -> (y, state), in chunks of
    state_kernels.SSM_CHUNK in the dual form, every chunk at once (`_ssd`)."""
    bsz, s, h, p = x.shape
    length = min(state_kernels.SSM_CHUNK, s)
    n = -(-s // length)
    pad = n * length - s
    dt = mx.clip(mx.logaddexp(dt.astype(mx.float32) + dt_bias, 0.0), dt_min, dt_max)
    x32 = x.astype(mx.float32)
    b, c = (mx.repeat(t.astype(mx.float32), h // t.shape[2], axis=2) for t in (b, c))

    def chunks(t):  # [B,S,H,...] -> [B,H,n,L,...], zero-padded to whole chunks (no decay, no input)
        t = mx.pad(t, [(0, 0), (0, pad)] + [(0, 0)] * (t.ndim - 2)) if pad else t
        t = t.reshape(bsz, n, length, *t.shape[2:])
        return t.transpose(0, 3, 1, 2, 4) if t.ndim == 5 else t.transpose(0, 3, 1, 2)

    causal, earlier = _tri(length, 0), _tri(n, -1)
    # (MLX 0.32's shapeless compile crashes on a sum over an axis of size 1: one chunk runs as written)
    y, state = (_fused(_ssd) if n > 1 else _ssd)(state, chunks(-mx.exp(a_log.astype(mx.float32)) * dt), chunks(x32 * dt[..., None]),
                            chunks(b), chunks(c), causal, earlier)
    y = y.transpose(0, 2, 3, 1, 4).reshape(bsz, n * length, h, p)[:, :s]
    return (y + d[:, None] * x32).astype(x.dtype), state


def ssm_step(x, dt, a_log, b, c, d, dt_bias, state, dt_min: float, dt_max: float):
    """Mamba-2 at one token: x [B,1,H,P], dt [B,1,H], B / C [B,1,G,N] -> (y [B,1,H,P], state)."""
    heads = x.shape[2]
    b, c = (mx.repeat(t[:, 0], heads // t.shape[2], axis=1) for t in (b, c))
    lo, hi = mx.array(dt_min, mx.float32), mx.array(dt_max, mx.float32)
    y, state = _fused(_ssm_step)(state, x[:, 0], dt[:, 0], a_log, b, c, d, dt_bias, lo, hi)
    return y[:, None].astype(x.dtype), state


def _selective_step(state, x, dt, a, b, c):
    """Mamba-1, one token: state [B,D,N]; x, dt [B,D] (dt after softplus); a [D,N] (-exp(A_log)); b, c [B,N]."""
    state = state * mx.exp(dt[..., None] * a) + (dt * x)[..., None] * b[:, None, :]
    return (state * c[:, None, :]).sum(axis=-1), state


def selective_scan(x, dt, a_log, b, c, d, dt_bias, state):
    dt = mx.logaddexp(dt.astype(mx.float32) + dt_bias, 0.0)
    a = -mx.exp(a_log.astype(mx.float32))
    ys = []
    for t in range(x.shape[1]):
        y, state = _fused(_selective_step)(state, x[:, t], dt[:, t], a, b[:, t], c[:, t])
        ys.append(y)
    return (mx.stack(ys, axis=1) + x * d).astype(x.dtype), state
