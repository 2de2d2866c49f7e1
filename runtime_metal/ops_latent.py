"""fuselm::LatentAttention in the op table: multi-head latent attention over its latent cache, expanded or absorbed.

    Q [B,H,S,n+R] = (q_nope, q_rot); latent [B,1,T,r]; k_rot [B,1,T,R]; weight [r, H·(n+v)] = per head W_k [r, n], W_v [r, v]
    bias     = scale · q_rot · k_rotᵀ + mask                       [B,H,S,T] (the rotary part: one kv head)
    expanded = sdpa(q_nope, latent · W_k, latent · W_v, bias)      T latent rows expanded per head (the function body)
    absorbed = sdpa(q_nope · W_kᵀ, latent, latent, bias) · W_v     attention over the latent itself, one kv head

Both are the same sum. The kernel takes, per call, the form with fewer multiply-adds for this step's S and T
(`absorbed`): at decode (one query row against T latent rows) the absorbed form, which reads the latent once and
makes no expanded K/V of T·H·(n+v) values, so it also reads fewer bytes; for a prompt chunk (S close to T) the
expanded one, since attention over r-wide heads (r = 512 against n + v = 256 in DeepSeek-V3) costs more than
expanding the T rows. mlx-lm's DeepSeek-V3 makes the same split (absorbed for one token).
"""

from __future__ import annotations

import numpy as np

from fuselm import contract

from .ops import _scalar, op


def absorbed(s: int, t: int, r: int, nope: int, v: int) -> bool:
    """Whether the absorbed form costs fewer multiply-adds than the expanded one (the heads and the rotary part
    cost the same in both): S·r·(n+v) + 2·S·T·r < T·r·(n+v) + S·T·(n+v)."""
    return s * r * (nope + v) + 2 * s * t * r < t * r * (nope + v) + s * t * (nope + v)


@op(contract.LATENT_OP, domain=contract.DOMAIN, fused=True)
def LatentAttention(b, q, latent, k_rot, weight, mask=None, *, num_heads, qk_nope_head_dim, v_head_dim, scale):
    heads, nope, v = int(num_heads), int(qk_nope_head_dim), int(v_head_dim)
    s, t, r = b.shape(q)[2], b.shape(latent)[2], b.shape(latent)[3]
    dq = b.shape(q)[3]
    per_head = b.reshape(weight, (r, heads, nope + v))
    w_k = b.transpose(b.slice(per_head, (slice(None), slice(None), slice(0, nope))), (1, 0, 2))  # [H, r, n]
    w_v = b.transpose(b.slice(per_head, (slice(None), slice(None), slice(nope, nope + v))), (1, 0, 2))  # [H, r, v]
    q_nope = b.slice(q, (slice(None), slice(None), slice(None), slice(0, nope)))
    q_rot = b.slice(q, (slice(None), slice(None), slice(None), slice(nope, dq)))
    bias = b.binary("mul", b.matmul(q_rot, b.transpose(k_rot, (0, 1, 3, 2))), _scalar(b, q, float(scale)))
    if mask is not None:
        bias = b.where(mask, bias, _scalar(b, bias, -np.inf)) if b.dtype(mask) == 9 else \
            b.binary("add", bias, b.cast(mask, b.dtype(bias)))
    if absorbed(s, t, r, nope, v):
        q_lat = b.matmul(q_nope, b.transpose(w_k, (0, 2, 1)))  # [B,H,S,r]
        return b.matmul(b.sdpa(q_lat, latent, latent, bias, float(scale)), w_v)
    return b.sdpa(q_nope, b.matmul(latent, w_k), b.matmul(latent, w_v), bias, float(scale))
