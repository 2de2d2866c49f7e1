"""The torch CPU backend's decode attention: torch's grouped matmuls over the keys some query sees (a
static cache's unwritten tail is not read), against torch's SDPA over the whole cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fuselm.runtime_metal.backends import make_backend


@pytest.mark.parametrize("hq,hkv,s,t,d", [(16, 8, 1, 193, 128), (32, 8, 3, 50, 64), (4, 4, 5, 17, 128), (8, 2, 16, 40, 32)])
def test_decode_attention_skips_the_unwritten_tail(hq, hkv, s, t, d):
    """Grouped kv heads, keys in a strided cache view; no mask, a bool mask (a static cache's causal
    rows with an unwritten tail), its additive form and additive masks with values."""
    g = torch.Generator().manual_seed(hq + t)
    q = torch.randn(2, hq, s, d, generator=g)
    k = torch.randn(2, hkv, t + 9, d, generator=g)[:, :, :t]  # a view into a longer buffer
    v = torch.randn(2, hkv, t, d, generator=g)
    allowed = torch.arange(t)[None, None, None, :] <= (t - 6 - s + torch.arange(s))[None, None, :, None]
    additive = torch.where(allowed, torch.randn(1, hq, s, t, generator=g), float("-inf"))
    b = make_backend("torch", "cpu")
    for mask in (None, allowed, torch.where(allowed, 0.0, float("-inf")), additive):
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.1, enable_gqa=True)
        out = b.sdpa(q, k, v, mask, 0.1)
        assert out.shape == ref.shape and torch.allclose(out, ref, atol=2e-6, rtol=0), (out - ref).abs().max()
