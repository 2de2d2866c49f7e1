"""The recurrent-state ops over the backend primitives: any backend runs them (backends/base.py's defaults).

Each takes its state as the graph gives it (float32, fuselm/contract.py's layouts) and returns the output in the
compute dtype of its input and the new state in float32, never writing the old state (a caller may keep it:
Session.snapshot). Prompts run in chunks, matmuls within a chunk and the state carried between chunks: the gated
delta rule's (one decay per head) in the WY form of transformers' torch_chunk_gated_delta_rule, Mamba-2's in the
state-space dual form; Mamba-1 and a decay per key channel run one recurrence step per token.

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
GDN_CHUNK = 64  # gated delta rule prompt chunk (transformers' and FLA's)
GDN_CHUNKED_FROM = 16  # tokens from which a prompt runs in chunks (fewer: the per-token steps are fewer kernels)


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
    if s >= GDN_CHUNKED_FROM and len(b.shape(decay)) == 3:
        return gated_delta_chunked(b, q, k, v, decay, beta, state)
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


def chunk_masks(length: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """For a chunk of `length` (a power of two): the causal mask (i >= j), the strict one (i > j), and per level
    b = 1, 2, 4, ... the b-blocks just below the diagonal of each 2b-block (`unit_lower_inverse`)."""
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    levels, width = [], 1
    while width < length:
        levels.append(((i // width) % 2 == 1) & (j // width == i // width - 1))
        width *= 2
    return i >= j, i > j, levels


def unit_lower_inverse(b, a, levels: list):
    """(I + a)^-1 for `a` [..., L, L] strictly lower triangular, by block doubling: X inverts the diagonal b-blocks
    of I + a; with E the blocks just below them in each 2b-block, (X^-1 + E)^-1 = X - X E X (E X E = 0). Matmuls
    only, as a blocked forward substitution (no triangular solve, which not every device has)."""
    length = b.shape(a)[-1]
    x = b.cast(b.asarray(np.eye(length, dtype=bool)), b.dtype(a))  # (a float32 constant may become the compute dtype)
    zero = b.full((), 0.0, b.dtype(a))
    for mask in levels:
        e = b.where(b.asarray(mask), a, zero)
        x = b.binary("sub", x, b.matmul(x, b.matmul(e, x)))
    return x


def gated_delta_chunked(b, q, k, v, decay, beta, state):
    """The gated delta rule over a prompt in chunks of GDN_CHUNK (one decay per head; q, k already one per value
    head), per head with St = state^T [Dk, Dv], cum = cumsum(decay) within the chunk and Γ[i, j] = exp(cum_i - cum_j)
    for i >= j:
      T = I + strict_lower((β k) k^T Γ); U = T^-1 (β v); W = T^-1 (β k exp(cum))
      v_new = U - W St;  y = (q exp(cum)) St + ((q k^T) Γ) v_new;  St = exp(cum_L) St + (k exp(cum_L - cum))^T v_new
    equal to the per-token recurrence (the updates of a chunk solved at once: the WY representation)."""
    bsz, s, h, dk = b.shape(q)
    dv = b.shape(v)[3]
    f32, length = b.dtype(state), GDN_CHUNK
    n = -(-s // length)
    pad = n * length - s
    causal, strict, levels = chunk_masks(length)

    def chunks(x, width):  # [B,S,H(,D)] -> [B,H,N,L(,D)] float32, zero-padded to whole chunks
        x = b.cast(x, f32)
        if pad:
            x = b.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (len(b.shape(x)) - 2), "constant", 0.0)
        if width is None:
            return b.reshape(b.transpose(x, (0, 2, 1)), (bsz, h, n, length))
        return b.reshape(b.transpose(x, (0, 2, 1, 3)), (bsz, h, n, length, width))

    q, k, v, g, beta = chunks(q, dk), chunks(k, dk), chunks(v, dv), chunks(decay, None), chunks(beta, None)
    zero = b.full((), 0.0, f32)
    cum = b.cumsum(g, 3, False, False)  # [B,H,N,L]
    gaps = b.binary("sub", b.reshape(cum, (bsz, h, n, length, 1)), b.reshape(cum, (bsz, h, n, 1, length)))
    within = b.where(b.asarray(causal), b.unary("exp", b.where(b.asarray(causal), gaps, zero)), zero)  # Γ
    col = lambda x: b.reshape(x, (bsz, h, n, length, 1))  # noqa: E731 - a per-token factor over the last dim
    kt = b.transpose(k, (0, 1, 2, 4, 3))
    kb = b.binary("mul", k, col(beta))
    t = b.where(b.asarray(strict), b.binary("mul", b.matmul(kb, kt), within), zero)
    inv = unit_lower_inverse(b, t, levels)
    u = b.matmul(inv, b.binary("mul", v, col(beta)))
    w = b.matmul(inv, b.binary("mul", kb, col(b.unary("exp", cum))))
    scores = b.binary("mul", b.matmul(q, kt), within)
    qd = b.binary("mul", q, col(b.unary("exp", cum)))
    last = b.slice(cum, (slice(None), slice(None), slice(None), slice(length - 1, length)))  # [B,H,N,1]
    kd = b.transpose(b.binary("mul", k, col(b.unary("exp", b.binary("sub", last, cum)))), (0, 1, 2, 4, 3))
    carry = b.reshape(b.unary("exp", last), (bsz, h, n, 1, 1))
    st = b.transpose(state, (0, 1, 3, 2))  # [B,H,Dk,Dv]
    ys = []
    for i in range(n):
        u_i, w_i, qd_i, scores_i, kd_i, carry_i = (
            b.reshape(b.slice(x, (slice(None), slice(None), slice(i, i + 1))), (bsz, h, *b.shape(x)[3:]))
            for x in (u, w, qd, scores, kd, carry))
        v_new = b.binary("sub", u_i, b.matmul(w_i, st))
        ys.append(b.binary("add", b.matmul(qd_i, st), b.matmul(scores_i, v_new)))
        st = b.binary("add", b.binary("mul", st, carry_i), b.matmul(kd_i, v_new))
    y = ys[0] if n == 1 else b.concat(ys, 2)  # [B,H,N·L,Dv]
    y = b.transpose(b.slice(y, (slice(None), slice(None), slice(0, s))), (0, 2, 1, 3))
    return b.cast(y, b.dtype(v)), b.transpose(st, (0, 1, 3, 2))


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
        y, state = _ssm_chunks(b, state, log_decay, xdt, bm, cm)
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


def _ssm_chunks(b, state, log_decay, xdt, bm, cm):
    """A prompt in chunks of L = SSM_CHUNK tokens in the state-space dual form (Mamba-2's SSD), every chunk at once,
    per head: within chunk c, cum = cumsum(log_decay) and
      y = ((C B^T) * exp(cum_l - cum_s) [s <= l]) xdt + exp(cum_l) C S_c,  R_c = sum_s exp(cum_L - cum_s) xdt_s B_s^T;
    between chunks, with e_c = the log decay up to chunk c's end and a_c = its own (e_c - a_c: up to its start), the
    state entering chunk c is S_c = exp(e_c - a_c) S + sum_{j<c} exp(e_c - a_c - e_j) R_j (a linear recurrence: one
    [n, n] weighting of the chunks' R, no loop). log_decay [B,S,H], xdt [B,S,H,P], B / C [B,S,H,N] -> (y, state)."""
    bsz, s, h, p = b.shape(xdt)
    n_state = b.shape(bm)[3]
    f32 = b.dtype(state)
    length = min(SSM_CHUNK, s)
    n = -(-s // length)
    pad = n * length - s

    def chunks(t):  # [B,S,H,...] -> [B,H,n,L,...], zero-padded to whole chunks (no decay, no input)
        rest = b.shape(t)[3:]
        if pad:
            t = b.pad(t, [(0, 0), (0, pad)] + [(0, 0)] * (1 + len(rest)), "constant", 0.0)
        t = b.reshape(t, (bsz, n, length, h, *rest))
        return b.transpose(t, (0, 3, 1, 2, 4) if rest else (0, 3, 1, 2))

    def decays(to, since, mask):  # exp(to - since) where `mask`, else 0
        zero = b.full((), 0.0, f32)
        return b.where(mask, b.unary("exp", b.where(mask, b.binary("sub", to, since), zero)), zero)

    log_decay, xdt, bm, cm = chunks(log_decay), chunks(xdt), chunks(bm), chunks(cm)
    cum = b.cumsum(log_decay, 3, False, False)  # [B,H,n,L]
    causal = b.asarray(np.tril(np.ones((length, length), bool)))
    weights = decays(b.reshape(cum, (bsz, h, n, length, 1)), b.reshape(cum, (bsz, h, n, 1, length)), causal)
    y = b.matmul(b.binary("mul", b.matmul(cm, b.transpose(bm, (0, 1, 2, 4, 3))), weights), xdt)  # [B,H,n,L,P]
    own = b.slice(cum, (slice(None), slice(None), slice(None), slice(length - 1, length)))  # [B,H,n,1]
    to_end = b.reshape(b.unary("exp", b.binary("sub", own, cum)), (bsz, h, n, length, 1))
    carried = b.matmul(b.transpose(b.binary("mul", xdt, to_end), (0, 1, 2, 4, 3)), bm)  # R: [B,H,n,P,N]
    own = b.reshape(own, (bsz, h, n))
    ends = b.cumsum(own, 2, False, False)
    starts = b.binary("sub", ends, own)
    flat = b.reshape(carried, (bsz, h, n, p * n_state))
    earlier = b.asarray(np.tril(np.ones((n, n), bool), -1))
    entering = b.matmul(decays(b.reshape(starts, (bsz, h, n, 1)), b.reshape(ends, (bsz, h, 1, n)), earlier), flat)
    entering = b.binary("add", b.reshape(entering, (bsz, h, n, p, n_state)),
                        b.binary("mul", b.reshape(state, (bsz, h, 1, p, n_state)),
                                 b.reshape(b.unary("exp", starts), (bsz, h, n, 1, 1))))
    inter = b.matmul(cm, b.transpose(entering, (0, 1, 2, 4, 3)))  # [B,H,n,L,P]
    y = b.binary("add", y, b.binary("mul", inter, b.reshape(b.unary("exp", cum), (bsz, h, n, length, 1))))
    last = b.slice(ends, (slice(None), slice(None), slice(n - 1, n)))  # [B,H,1]
    tail = b.matmul(b.reshape(b.unary("exp", b.binary("sub", last, ends)), (bsz, h, 1, n)), flat)
    state = b.binary("add", b.reshape(tail, (bsz, h, p, n_state)),
                     b.binary("mul", state, b.reshape(b.unary("exp", last), (bsz, h, 1, 1))))
    y = b.reshape(b.transpose(y, (0, 2, 3, 1, 4)), (bsz, n * length, h, p))
    return (b.slice(y, (slice(None), slice(0, s))) if pad else y), state


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
