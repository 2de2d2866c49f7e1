"""Quantized matmul for torch: which kernel runs a blocked (q - zero_point) * scale weight.

Measured on the 2-core AVX2 CPU this project is developed on (torch 2.13, M=1 decode GEMV,
1024x4096 weight): f32 matmul 0.42 ms, `_weight_int4pack_mm_for_cpu` 4.7 ms, `_weight_int8pack_mm`
8.6 ms, bf16 matmul 23 ms; torch's CPU low-bit kernels are scalar without AVX-512. So on CPU the
weight is dequantized once at load to the activation dtype (f32), the fastest correct path there.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import QuantizedWeight, dequantize_blocked


def prepare(backend, q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, block: int,
            bits: int) -> QuantizedWeight:
    k, n = q.shape
    w = dequantize_blocked(q, scale, zero_point, block)
    data = backend.asarray(w.astype(scale.dtype, copy=False))
    return QuantizedWeight(data, k, n, bits, block, "dequant")


def matmul(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    return torch.matmul(x, w.data)
