"""The recurrent-state kernels on MLX: on a GPU each token's recurrence step is one mx.compile'd function (as
mlx-lm's gated_delta_ops / ssm step), so a decode step's recurrence is one fused kernel per layer instead of a
dozen ops; shapeless, so one compile serves every model and prompt.

Same semantics and layouts as state_kernels.py (fuselm/contract.py's ops); the state stays float32 (the inputs'
bfloat16 promotes to it inside the step) and each output is cast back to its input's dtype. Mamba-2's prompt
keeps the chunked dual form of state_kernels.py (matmuls, already few kernels).
"""

from __future__ import annotations

import mlx.core as mx

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
    """state [B,H,Dv,Dk]; q, k [B,H,Dk]; v [B,H,Dv]; g [B,H,1|Dk] (the decay, exp'd); beta [B,H]."""
    state = state * g[:, :, None, :]
    recalled = (state * k[:, :, None, :]).sum(axis=-1)
    state = state + ((v - recalled) * beta[..., None])[..., None] * k[:, :, None, :]
    return (state * q[:, :, None, :]).sum(axis=-1), state


def gated_delta(q, k, v, decay, beta, state):
    bsz, s, hk, _ = q.shape
    hv = v.shape[2]
    if hv != hk:  # each key head serves hv / hk consecutive value heads
        q, k = mx.repeat(q, hv // hk, axis=2), mx.repeat(k, hv // hk, axis=2)
    g = mx.exp(decay.astype(mx.float32)).reshape(bsz, s, hv, -1)
    ys = []
    for t in range(s):
        y, state = _fused(_delta_step)(state, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        ys.append(y)
    return mx.stack(ys, axis=1).astype(v.dtype), state


def _ssm_step(state, x, dt, a_log, b, c, d, dt_bias, lo, hi):
    """Mamba-2, one token: state [B,H,P,N]; x [B,H,P]; dt [B,H]; b, c [B,H,N]; A_log, D, dt_bias [H]."""
    dt = mx.clip(mx.logaddexp(dt.astype(mx.float32) + dt_bias, 0.0), lo, hi)
    decay = mx.exp(-mx.exp(a_log.astype(mx.float32)) * dt)
    state = state * decay[..., None, None] + (dt[..., None] * x)[..., None] * b[:, :, None, :]
    return (state * c[:, :, None, :]).sum(axis=-1) + d[:, None] * x, state


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
