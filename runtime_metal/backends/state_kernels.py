"""The recurrent-state ops over the backend primitives: any backend runs them (backends/base.py's defaults).

Each takes its state as the graph gives it (float32, fuselm/contract.py's layouts) and returns the output in the
compute dtype of its input and the new state in float32, never writing the old state (a caller may keep it:
Session.snapshot). A prompt runs one recurrence step per token, as mlx-lm's ops fallback does; Mamba-2's prompt
runs in chunks of the state-space dual form (quadratic within a chunk, the state carried between chunks).

    causal_conv1d: full = [past; x]; y_s = sum_k full[s + k] * w[:, 0, k]; present = last K-1 rows of full
    gated_delta:   S = S * exp(decay_t); S += (beta_t (v_t - S k_t)) k_t^T; y_t = S q_t     (S: [Dv, Dk] per head)
    ssm_scan:      dt = clip(softplus(dt + dt_bias)); S = S * exp(-exp(A_log) dt_t) + (dt_t x_t) B_t^T;
                   y_t = S C_t + D x_t                                                       (S: [P, N] per head)
    selective_scan (Mamba-1): dt = softplus(dt + dt_bias); S = S * exp(-exp(A_log) dt_t) + (dt_t x_t) B_t;
                   y_t = S C_t + D x_t                                                       (S: [D, N])
"""

from __future__ import annotations

import numpy as np

SSM_CHUNK = 64  # Mamba-2 prompt chunk: the dual form's [chunk, chunk] matrices per head


def causal_conv1d(b, x, past, weight):
    """x [B,S,C], past [B,K-1,C], weight [C,1,K] -> (y [B,S,C], present [B,K-1,C])."""
    s = b.shape(x)[1]
    channels, _, taps = b.shape(weight)
    full = b.concat([past, b.cast(x, b.dtype(past))], 1)
    w = b.reshape(weight, (channels, taps))
    y = None
    for j in range(taps):
        term = b.binary("mul", b.slice(full, (slice(None), slice(j, j + s))),
                        b.reshape(b.slice(w, (slice(None), slice(j, j + 1))), (channels,)))
        y = term if y is None else b.binary("add", y, term)
    return b.cast(y, b.dtype(x)), b.slice(full, (slice(None), slice(s, s + taps - 1)))


def repeat_heads(b, x, heads: int):
    """[B,S,G,D] -> [B,S,H,D], each group repeated H/G times in place (torch's repeat_interleave over dim 2)."""
    bsz, s, groups, d = b.shape(x)
    if groups == heads:
        return x
    x = b.expand(b.reshape(x, (bsz, s, groups, 1, d)), (bsz, s, groups, heads // groups, d))
    return b.reshape(x, (bsz, s, heads, d))


def gated_delta(b, q, k, v, decay, beta, state):
    """q, k [B,S,Hk,Dk], v [B,S,Hv,Dv], decay [B,S,Hv] or [B,S,Hv,Dk], beta [B,S,Hv], state [B,Hv,Dv,Dk]
    -> (y [B,S,Hv,Dv], state)."""
    bsz, s, _, dk = b.shape(q)
    hv, dv = b.shape(v)[2:]
    q, k = repeat_heads(b, q, hv), repeat_heads(b, k, hv)
    g = b.unary("exp", decay)
    width = b.shape(g)[3] if len(b.shape(g)) == 4 else 1  # one decay per head, or per key channel (Kimi)
    ys = []
    for t in range(s):
        at = (slice(None), slice(t, t + 1))
        k_t = b.reshape(b.slice(k, at), (bsz, hv, 1, dk))
        state = b.binary("mul", state, b.reshape(b.slice(g, at), (bsz, hv, 1, width)))
        recalled = b.reduce("sum", b.binary("mul", state, k_t), (3,), True)  # [B,Hv,Dv,1]
        delta = b.binary("mul", b.binary("sub", b.reshape(b.slice(v, at), (bsz, hv, dv, 1)), recalled),
                         b.reshape(b.slice(beta, at), (bsz, hv, 1, 1)))
        state = b.binary("add", state, b.binary("mul", delta, k_t))
        y = b.reduce("sum", b.binary("mul", state, b.reshape(b.slice(q, at), (bsz, hv, 1, dk))), (3,), False)
        ys.append(b.reshape(y, (bsz, 1, hv, dv)))
    return b.cast(ys[0] if s == 1 else b.concat(ys, 1), b.dtype(v)), state


def ssm_scan(b, x, dt, a_log, bm, cm, d, dt_bias, state, dt_min: float, dt_max: float):
    """Mamba-2: x [B,S,H,P], dt [B,S,H], A_log / D / dt_bias [H], B / C [B,S,G,N], state [B,H,P,N] -> (y, state)."""
    bsz, s, h, _ = b.shape(x)
    f32 = b.dtype(state)
    x32, dt = b.cast(x, f32), b.cast(dt, f32)
    dt = b.unary("softplus", b.binary("add", dt, b.cast(dt_bias, f32)))
    dt = b.binary("min", b.binary("max", dt, b.full((), dt_min, f32)), b.full((), dt_max, f32))
    a = b.unary("neg", b.unary("exp", b.cast(a_log, f32)))
    log_decay = b.binary("mul", dt, a)  # [B,S,H]
    xdt = b.binary("mul", x32, b.reshape(dt, (bsz, s, h, 1)))
    bm, cm = repeat_heads(b, b.cast(bm, f32), h), repeat_heads(b, b.cast(cm, f32), h)
    if s == 1:
        y, state = _ssm_step(b, state, log_decay, xdt, bm, cm)
    else:
        ys = []
        for start in range(0, s, SSM_CHUNK):
            part = (slice(None), slice(start, min(s, start + SSM_CHUNK)))
            y, state = _ssm_chunk(b, state, *(b.slice(t, part) for t in (log_decay, xdt, bm, cm)))
            ys.append(y)
        y = ys[0] if len(ys) == 1 else b.concat(ys, 1)
    y = b.binary("add", y, b.binary("mul", x32, b.reshape(b.cast(d, f32), (h, 1))))
    return b.cast(y, b.dtype(x)), state


def _ssm_step(b, state, log_decay, xdt, bm, cm):
    """One token: state [B,H,P,N], log_decay [B,1,H], xdt [B,1,H,P], B / C [B,1,H,N] -> (y [B,1,H,P], state)."""
    bsz, _, h, p = b.shape(xdt)
    n = b.shape(bm)[3]
    decay = b.reshape(b.unary("exp", log_decay), (bsz, h, 1, 1))
    update = b.binary("mul", b.reshape(xdt, (bsz, h, p, 1)), b.reshape(bm, (bsz, h, 1, n)))
    state = b.binary("add", b.binary("mul", state, decay), update)
    y = b.reduce("sum", b.binary("mul", state, b.reshape(cm, (bsz, h, 1, n))), (3,), False)
    return b.reshape(y, (bsz, 1, h, p)), state


def _ssm_chunk(b, state, log_decay, xdt, bm, cm):
    """A chunk of L tokens in the state-space dual form (Mamba-2's SSD), per head:
    cum = cumsum(log_decay); y = ((C B^T) * exp(cum_l - cum_s) [s <= l]) xdt + exp(cum_l) C state;
    state = exp(cum_L) state + sum_s exp(cum_L - cum_s) xdt_s B_s^T."""
    bsz, length, h, _ = b.shape(xdt)
    f32 = b.dtype(state)
    heads_first = (0, 2, 1, 3)
    cum = b.transpose(b.cumsum(log_decay, 1, False, False), (0, 2, 1))  # [B,H,L]
    gaps = b.binary("sub", b.reshape(cum, (bsz, h, length, 1)), b.reshape(cum, (bsz, h, 1, length)))  # cum_l - cum_s
    causal = b.asarray(np.tril(np.ones((length, length), bool)))
    weights = b.where(causal, b.unary("exp", b.where(causal, gaps, b.full((), 0.0, f32))), b.full((), 0.0, f32))
    bh, ch, xh = (b.transpose(t, heads_first) for t in (bm, cm, xdt))  # [B,H,L,N], [B,H,L,N], [B,H,L,P]
    scores = b.binary("mul", b.matmul(ch, b.transpose(bh, (0, 1, 3, 2))), weights)  # [B,H,L,L]
    y = b.matmul(scores, xh)  # [B,H,L,P]
    y = b.binary("add", y, b.binary("mul", b.matmul(ch, b.transpose(state, (0, 1, 3, 2))),
                                    b.reshape(b.unary("exp", cum), (bsz, h, length, 1))))
    last = b.slice(cum, (slice(None), slice(None), slice(length - 1, length)))  # [B,H,1]
    to_end = b.unary("exp", b.binary("sub", last, cum))  # [B,H,L]
    carried = b.matmul(b.transpose(b.binary("mul", xh, b.reshape(to_end, (bsz, h, length, 1))), (0, 1, 3, 2)), bh)
    state = b.binary("add", b.binary("mul", state, b.reshape(b.unary("exp", last), (bsz, h, 1, 1))), carried)
    return b.transpose(y, heads_first), state


def selective_scan(b, x, dt, a_log, bm, cm, d, dt_bias, state):
    """Mamba-1: x / dt [B,S,D], A_log [D,N], B / C [B,S,N], D / dt_bias [D], state [B,D,N] -> (y [B,S,D], state)."""
    bsz, s, ch = b.shape(x)
    n = b.shape(a_log)[1]
    f32 = b.dtype(state)
    x32 = b.cast(x, f32)
    dt = b.unary("softplus", b.binary("add", b.cast(dt, f32), b.cast(dt_bias, f32)))
    a = b.unary("neg", b.unary("exp", b.cast(a_log, f32)))
    xdt = b.binary("mul", x32, dt)
    ys = []
    for t in range(s):
        at = (slice(None), slice(t, t + 1))
        decay = b.unary("exp", b.binary("mul", b.reshape(b.slice(dt, at), (bsz, ch, 1)), a))
        update = b.binary("mul", b.reshape(b.slice(xdt, at), (bsz, ch, 1)), b.reshape(b.cast(b.slice(bm, at), f32), (bsz, 1, n)))
        state = b.binary("add", b.binary("mul", state, decay), update)
        y = b.reduce("sum", b.binary("mul", state, b.reshape(b.cast(b.slice(cm, at), f32), (bsz, 1, n))), (2,), False)
        ys.append(b.reshape(y, (bsz, 1, ch)))
    y = b.binary("add", ys[0] if s == 1 else b.concat(ys, 1), b.binary("mul", x32, b.cast(d, f32)))
    return b.cast(y, b.dtype(x)), state
