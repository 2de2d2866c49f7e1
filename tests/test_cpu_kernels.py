"""The AVX2 low-bit kernels (runtime_metal/backends/cpu_kernels.cpp) against numpy references.

The GEMV rounds x to int16 per 32 values; the reference applies the same rounding, so what is left
is f32 accumulation order (relative 1e-6), and a second check bounds the rounding itself. Odd
shapes exercise the padding to whole groups of 256, blocks of 64 and 128 the repeated scales, up
to 16 rows the multi-row tiles, 17+ rows the dequantize + GEMM path of torch_quant.matmul.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fuselm.runtime_metal.backends import make_backend
from fuselm.runtime_metal.backends.torch_quant import GEMV_MAX_ROWS, attention, cpu_kernels, matmul, prepare

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="no AVX2 kernels on this machine")


def _weights(k, n, block, bits, seed, zero_points=True):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 2**bits, (k, n)).astype(np.uint8)
    scale = (rng.random((k // block, n)) * 0.02 + 1e-3).astype(np.float32)
    zp = rng.integers(0, 2**bits, (k // block, n)).astype(np.uint8) if zero_points else None
    return q, scale, zp


def _dequantized(q, scale, zp, block):  # [K, N] float64
    z = np.zeros_like(scale) if zp is None else zp.astype(np.float64)
    return (q.astype(np.float64) - np.repeat(z, block, 0)) * np.repeat(scale.astype(np.float64), block, 0)


def _int16_rounded(x):
    """x as the GEMV sees it: per 32 values, round(x / d) * d with d = max|x| / 32767 (f32 math)."""
    m, k = x.shape
    b = x.reshape(m, k // 32, 32)
    amax = np.abs(b).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(32767) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    d = (amax / np.float32(32767)).astype(np.float32)
    return (np.rint(b * inv) * d).reshape(m, k).astype(np.float64)


CASES = [  # (K, N, block)
    (96, 37, 32),  # K pads 96 -> 256
    (320, 9, 32),
    (384, 40, 64),
    (384, 33, 128),
    (1024, 64, 32),
    (2560, 24, 128),  # ten groups, as Qwen3-4B's hidden size
]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k,n,block", CASES)
def test_gemv_matches_reference(k, n, block, bits):
    kernels = cpu_kernels()
    q, scale, zp = _weights(k, n, block, bits, seed=k + n + bits)
    w = _dequantized(q, scale, zp, block)
    packed = kernels.pack(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(zp), block, bits)
    rng = np.random.default_rng(1)
    for m in (1, 2, 3, 4, 5, 16):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[0, :32] *= 100  # an outlier sub-block: its scale must not leak into the others
        y = kernels.gemv(torch.from_numpy(x), *packed, bits, 2).numpy()
        ref = _int16_rounded(x) @ w
        tol = np.abs(_int16_rounded(x)) @ np.abs(w)  # the scale of the sum's rounding errors
        assert np.all(np.abs(y - ref) <= 2e-6 * tol + 1e-30), (m, np.max(np.abs(y - ref) / tol))
        exact = x.astype(np.float64) @ w  # the int16 rounding itself: 1.5e-5 of a sub-block's max per value
        assert np.max(np.abs(y - exact) / tol) < 1e-4


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k,n,block", CASES)
def test_dequant_matches_reference(k, n, block, bits):
    kernels = cpu_kernels()
    q, scale, zp = _weights(k, n, block, bits, seed=2 * k + n)
    packed = kernels.pack(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(zp), block, bits)
    out = kernels.dequant(*packed, k, bits, torch.empty(n * k + 5), 2).numpy()
    ref = _dequantized(q, scale, zp, block).T
    assert out.shape == (n, k)
    assert np.max(np.abs(out - ref)) <= 1e-6 * np.max(np.abs(ref))


@pytest.mark.parametrize("rows", [1, 7, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 40])
def test_matmul_through_prepare(rows):
    """torch_quant.prepare + matmul as the runtime calls them: GEMV up to 16 rows, dequantize + GEMM beyond,
    weights without zero points (symmetric) included."""
    backend = make_backend("torch", "cpu")
    for bits, zero_points in ((4, True), (8, False)):
        q, scale, zp = _weights(320, 21, 64, bits, seed=rows + bits, zero_points=zero_points)
        w = prepare(backend, q, scale, zp, 64, bits)
        assert w.kind == "avx2"
        x = np.random.default_rng(rows).standard_normal((1, rows, 320)).astype(np.float32)
        y = matmul(torch.from_numpy(x), w).numpy()
        ref = x.astype(np.float64) @ _dequantized(q, scale, zp, 64)
        assert y.shape == (1, rows, 21)
        assert np.max(np.abs(y - ref)) < 1e-4 * np.max(np.abs(ref))


def test_layout_errors_are_clear():
    kernels = cpu_kernels()
    q, scale, zp = _weights(256, 8, 32, 4, seed=0)
    packed = kernels.pack(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(zp), 32, 4)
    with pytest.raises(RuntimeError, match="does not match the packed weights"):
        kernels.gemv(torch.zeros(1, 512), *packed, 4, 1)
    with pytest.raises(RuntimeError, match="disagree on Kp"):
        kernels.gemv(torch.zeros(1, 256), packed[0], packed[1], packed[2], 8, 1)
    with pytest.raises(RuntimeError, match="multiple of 32 dividing K"):
        kernels.pack(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(zp), 48, 4)


@pytest.mark.parametrize("hq,hkv,s,t,d", [(16, 8, 1, 193, 128), (32, 8, 3, 50, 64), (4, 4, 5, 17, 128), (8, 2, 16, 40, 32)])
def test_attention_matches_sdpa(hq, hkv, s, t, d):
    """torch_quant.attention (grouped kv heads, keys in a strided cache view) against torch's SDPA, with no
    mask, a bool mask (a static cache's causal rows) and additive masks; a fully masked row attends nothing."""
    g = torch.Generator().manual_seed(hq + t)
    q = torch.randn(2, hq, s, d, generator=g)
    k = torch.randn(2, hkv, t + 9, d, generator=g)[:, :, :t]  # a view into a longer buffer
    v = torch.randn(2, hkv, t, d, generator=g)
    allowed = torch.arange(t)[None, None, None, :] <= (t - 6 - s + torch.arange(s))[None, None, :, None]
    additive = torch.where(allowed, torch.randn(1, hq, s, t, generator=g), float("-inf"))
    for mask in (None, allowed, torch.where(allowed, 0.0, float("-inf")), additive):
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.1, enable_gqa=True)
        out = attention(q, k, v, mask, 0.1)
        assert out.shape == ref.shape and torch.allclose(out, ref, atol=2e-6, rtol=0), (out - ref).abs().max()
    dead = allowed.clone().expand(2, hq, s, t).contiguous()
    dead[1, 0, 0] = False
    out = attention(q, k, v, dead, 0.1)
    assert torch.all(out[1, 0, 0] == 0)
    assert attention(q.double(), k.double(), v.double(), None, 0.1) is None  # not f32: the caller's path runs
