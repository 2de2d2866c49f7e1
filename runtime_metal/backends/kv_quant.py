"""The 8-bit KV cache's format, the same on every backend; each backend stores and reads it (Backend.kv_*).

Format: affine per token, kv head and group of `group` channels along head_dim,
    x ≈ q · scale + bias,   q ∈ [0, 255],   scale, bias in float16 (MLX computing in bfloat16: bfloat16,
    as mlx-lm's QuantizedKVCache keeps them, so its quantized matmuls convert nothing)
i.e. MLX's own affine quantization (mx.quantize), so the MLX path reads it with mx.quantized_matmul
exactly as mlx-lm's QuantizedKVCache does. A stored cache is a tuple (q, scales, biases) of backend
arrays [B, H, L, ·]: torch and numpy keep q as uint8 [B, H, L, D], MLX packs it into uint32 [B, H, L, D/4].

Attention reads the cache one block of keys at a time (runtime_metal/attention_blocks.py) through the
backend's `kv_scores` (q·Kᵀ) and `kv_values` (p·V) on the stored block: quantized matmuls on MLX; torch
dequantizes the block on the fly, at most `kv_block_keys` keys at once.
"""

from __future__ import annotations

from fuselm.errors import FuselmError

BITS = 8
LEVELS = 2**BITS - 1


def check_group(backend, head_dim: int, group: int, what: str) -> None:
    """Refuse a group size the backend cannot store for this head_dim (exit 2, before allocating)."""
    if group <= 0 or head_dim % group:
        raise FuselmError(f"--kv-group-size {group} does not divide the {what} head_dim {head_dim}; choose a divisor "
                          f"of {head_dim} (32, 64 or 128 where they divide it)")
    groups = backend.kv_groups
    if groups is not None and group not in groups:
        raise FuselmError(f"--kv-group-size {group}: {backend.name} quantizes in groups of "
                          f"{', '.join(map(str, groups))} channels (this model's head_dim is {head_dim}); use "
                          "--kv-bits 16, or the torch backend")


def group_of(backend, stored: tuple) -> int:
    return backend.kv_head_dim(stored) // int(stored[1].shape[-1])


def rows(stored: tuple, t0: int, t1: int) -> tuple:
    """Keys t0..t1 of a stored cache (views, no copy)."""
    return tuple(a[:, :, t0:t1] for a in stored)


def write(b, stored: tuple, parts: tuple, pos, **heads) -> tuple:
    """Write quantized rows at `pos` (int or 0-d array) into each array of the stored cache."""
    return tuple(b.cache_write(a, p, pos, **heads) for a, p in zip(stored, parts, strict=True))
