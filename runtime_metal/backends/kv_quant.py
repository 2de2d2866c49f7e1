"""The 8-bit KV cache on each backend: quantize new rows, and read key/value blocks for attention.

Format (both backends): affine per token, kv head and group of `group` channels along head_dim,
    x ≈ q · scale + bias,   q ∈ [0, 255],   scale, bias in float16 (MLX computing in bfloat16: bfloat16,
    as mlx-lm's QuantizedKVCache keeps them, so its quantized matmuls convert nothing)
i.e. MLX's own affine quantization (mx.quantize), so the MLX path reads it with mx.quantized_matmul
exactly as mlx-lm's QuantizedKVCache does. A stored cache is a tuple (q, scales, biases) of backend
arrays [B, H, L, ·]: torch keeps q as uint8 [B, H, L, D], MLX packs it into uint32 [B, H, L, D/4].

Attention reads the cache one block of keys at a time (runtime_metal/attention_blocks.py):
- MLX: Q·Kᵀ and P·V are quantized matmuls on the stored block; nothing is dequantized.
- torch (CPU, CUDA): the block is dequantized on the fly (one int8→f32 conversion and the affine
  fix-up folded into the matmuls' operands), so at most one block of keys is ever held in f32.
"""

from __future__ import annotations

from fuselm.errors import FuselmError

BITS = 8
LEVELS = 2**BITS - 1
MLX_GROUPS = (32, 64, 128)
# decode folds the affine fix-up into the small [queries, keys] products; a prefill block (many
# queries) dequantizes the block instead, which costs less than G products of [queries, keys]
FOLD_MAX_QUERIES = 32


def check_group(backend_name: str, head_dim: int, group: int, what: str) -> None:
    """Refuse a group size the backend cannot store for this head_dim (exit 2, before allocating)."""
    if group <= 0 or head_dim % group:
        raise FuselmError(f"--kv-group-size {group} does not divide the {what} head_dim {head_dim}; choose a divisor "
                          f"of {head_dim} (32, 64 or 128 where they divide it)")
    if backend_name == "mlx" and group not in MLX_GROUPS:
        raise FuselmError(f"--kv-group-size {group}: MLX quantizes in groups of 32, 64 or 128 channels (this model's "
                          f"head_dim is {head_dim}); use --kv-bits 16, or the torch backend")


def empty(b, shape: tuple, group: int) -> tuple:
    """A zeroed 8-bit cache for [B, H, L, D] values."""
    bsz, h, length, d = shape
    if b.name == "mlx":
        import mlx.core as mx

        dt = _mlx_scale_dtype(b)
        return (mx.zeros((bsz, h, length, d // 4), mx.uint32), mx.zeros((bsz, h, length, d // group), dt),
                mx.zeros((bsz, h, length, d // group), dt))
    import torch

    dev = b._dev
    return (torch.zeros((bsz, h, length, d), dtype=torch.uint8, device=dev),
            torch.zeros((bsz, h, length, d // group), dtype=torch.float16, device=dev),
            torch.zeros((bsz, h, length, d // group), dtype=torch.float16, device=dev))


def head_dim(b, stored: tuple) -> int:
    q = stored[0]
    return int(q.shape[-1]) * (4 if b.name == "mlx" else 1)


def group_of(b, stored: tuple) -> int:
    return head_dim(b, stored) // int(stored[1].shape[-1])


def quantize(b, x, group: int) -> tuple:
    """x [B, H, S, D] float -> (q, scales, biases) in the stored layout."""
    if b.name == "mlx":
        import mlx.core as mx

        dt = _mlx_scale_dtype(b)
        q, s, z = mx.quantize(x if x.dtype == dt else x.astype(mx.float32), group_size=group, bits=BITS)
        return q, s.astype(dt), z.astype(dt)
    import torch

    bsz, h, s, d = x.shape
    xg = x.float().reshape(bsz, h, s, d // group, group)
    lo, hi = xg.amin(-1), xg.amax(-1)
    scale = ((hi - lo) / LEVELS).to(torch.float16)
    bias = lo.to(torch.float16)
    # quantize against the float16 scale and bias actually stored, so dequantization undoes exactly this
    sf, bf = scale.float(), bias.float()
    safe = torch.where(sf > 0, sf, torch.ones_like(sf))
    q = ((xg - bf[..., None]) / safe[..., None]).round_().clamp_(0, LEVELS).to(torch.uint8)
    return q.reshape(bsz, h, s, d), scale, bias


def dequantize(b, stored: tuple, dtype):
    """The whole stored block as floats [B, H, T, D] (graphs whose attention is not one Attention op)."""
    group = group_of(b, stored)
    if b.name == "mlx":
        import mlx.core as mx

        q, s, z = stored
        return mx.dequantize(q, s.astype(mx.float32), z.astype(mx.float32), group_size=group, bits=BITS).astype(dtype)
    q, s, z = stored
    bsz, h, t, d = q.shape
    x = q.float().reshape(bsz, h, t, d // group, group).mul_(s.float()[..., None]).add_(z.float()[..., None])
    return x.reshape(bsz, h, t, d).to(dtype)


def rows(stored: tuple, t0: int, t1: int) -> tuple:
    """Keys t0..t1 of a stored cache (views, no copy)."""
    return tuple(a[:, :, t0:t1] for a in stored)


def scores(b, q, block: tuple):
    """q [B, Hkv, R, D] (query heads grouped per kv head, already scaled) · block keysᵀ -> f32 [B, Hkv, R, T]."""
    group = group_of(b, block)
    if b.name == "mlx":
        import mlx.core as mx

        kq, ks, kz = block
        return mx.quantized_matmul(_mlx_operand(q, ks), kq, ks, kz, transpose=True, group_size=group, bits=BITS)
    # Σ_d q_d (k_d·s_g + z_g) = Σ_g s_g (q_g · k_g) + z_g Σ_{d∈g} q_d: one int8→f32 conversion of the keys,
    # the scales applied to the small [R, T] products
    kq, ks, kz = block
    bsz, h, t, d = kq.shape
    g = d // group
    qf = q.float()
    if qf.shape[2] > FOLD_MAX_QUERIES:
        return qf @ dequantize(b, block, qf.dtype).transpose(-1, -2)
    k = kq.float()
    ks, kz = ks.float().transpose(-1, -2), kz.float().transpose(-1, -2)  # [B, H, G, T]
    out = None
    for j in range(g):  # column slices of k keep unit stride: the matmuls read them in place
        c = slice(j * group, (j + 1) * group)
        dots = (qf[..., c] @ k[..., c].transpose(-1, -2)).mul_(ks[:, :, j:j + 1])
        dots.add_(qf[..., c].sum(-1, keepdim=True) * kz[:, :, j:j + 1])
        out = dots if out is None else out.add_(dots)
    return out


def values(b, p, block: tuple):
    """p f32 [B, Hkv, R, T] · block values -> f32 [B, Hkv, R, D]."""
    group = group_of(b, block)
    if b.name == "mlx":
        import mlx.core as mx

        vq, vs, vz = block
        return mx.quantized_matmul(_mlx_operand(p, vs), vq, vs, vz, transpose=False, group_size=group, bits=BITS)
    # Σ_t p_t (v_td·s_tg + z_tg) = (p ⊙ s_g) · v_g + p · z_g, per group g of channels
    import torch

    vq, vs, vz = block
    bsz, h, t, d = vq.shape
    g = d // group
    if p.shape[2] > FOLD_MAX_QUERIES:
        return p @ dequantize(b, block, p.dtype)
    v = vq.float()
    vs, vz = vs.float().transpose(-1, -2), vz.float().transpose(-1, -2)  # [B, H, G, T]
    parts = []
    for j in range(g):
        c = slice(j * group, (j + 1) * group)
        part = (p * vs[:, :, j:j + 1]) @ v[..., c]
        parts.append(part.add_(p @ vz[:, :, j, :, None]))
    return parts[0] if g == 1 else torch.cat(parts, -1)


def _mlx_scale_dtype(b):
    """float16, or the compute dtype where MLX computes in half precision (bfloat16 on a GPU)."""
    import mlx.core as mx

    return b._float if b._float in (mx.float16, mx.bfloat16) else mx.float16


def _mlx_operand(x, scales):
    """x for a quantized matmul with `scales`: in their dtype when x is half precision too, else float32."""
    import mlx.core as mx

    return x if x.dtype == scales.dtype and x.dtype in (mx.float16, mx.bfloat16) else x.astype(mx.float32)


def write(b, stored: tuple, parts: tuple, pos, **heads) -> tuple:
    """Write quantized rows at `pos` (int or 0-d array) into each array of the stored cache."""
    return tuple(b.cache_write(a, p, pos, **heads) for a, p in zip(stored, parts, strict=True))
