"""The CUDA 4/8-bit kernels (runtime_metal/backends/cuda_kernels.py), run on CPU through Triton's
interpreter and checked against the blocked dequantization written in numpy (base.dequantize_blocked).

The interpreter executes the same kernel source the GPU compiles (tile shapes, masks, nibble
order), so a layout or masking bug shows here; speed is measured on a GPU by bench/qmatmul_cuda.py."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("a GPU is present: bench/qmatmul_cuda.py checks the compiled kernels there", allow_module_level=True)
pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
in_child = pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreter child process (the test above)")

if not INTERPRETED:
    # Triton decides at import whether its language functions are interpreted, and torch may have
    # imported it already in this process: the checks below run in a child pytest started with it set.
    def test_cuda_kernels_under_triton_interpreter():
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                              env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
        assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]

from fuselm.runtime_metal.backends import cuda_kernels, torch_quant  # noqa: E402
from fuselm.runtime_metal.backends.base import dequantize_blocked  # noqa: E402


def blocked(bits: int, block: int, k: int, n: int, seed: int = 0):
    """A graph-layout weight: q [K, N], scale / zero point [K / block, N]."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 2**bits, (k, n)).astype(np.uint8)
    scale = (rng.random((k // block, n)) * 0.1 + 0.01).astype(np.float32)
    zero = rng.integers(0, 2**bits, (k // block, n)).astype(np.uint8)
    return q, scale, zero


@in_child
@pytest.mark.parametrize("bits,block,k,n,rows,tile", [
    (4, 32, 256, 40, 1, (8, 256)),     # N not a multiple of the tile
    (4, 32, 96, 24, 3, (8, 256)),      # K shorter than the tile: masked
    (8, 32, 160, 17, 2, (4, 128)),     # 8-bit, K not a multiple of the tile
    (4, 64, 512, 9, 1, (2, 256)),
    (4, 128, 384, 8, 1, (8, 128)),     # the tile widened to one whole block
])
def test_gemv_matches_blocked_dequantization(bits, block, k, n, rows, tile):
    q, scale, zero = blocked(bits, block, k, n)
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32))
    ref = x.double() @ torch.from_numpy(dequantize_blocked(q, scale, zero, block)).double()
    packed = cuda_kernels.pack(torch.from_numpy(np.ascontiguousarray(q.T)), bits)
    s, z = torch.from_numpy(np.ascontiguousarray(scale.T)), torch.from_numpy(np.ascontiguousarray(zero.T))
    y = cuda_kernels.gemv(x, packed, s, z, block, bits, tile=(tile[0], max(tile[1], block)))
    assert y.shape == (rows, n) and y.dtype == torch.float32
    np.testing.assert_allclose(y.double().numpy(), ref.numpy(), rtol=0, atol=1e-5 * float(ref.abs().max()))
    w = cuda_kernels.dequantize(packed, s, z, block, bits, torch.float32, tile=(tile[0], 64))
    np.testing.assert_array_equal(w.numpy(), dequantize_blocked(q, scale, zero, block).T)


@in_child
def test_backend_path_decode_and_prefill(monkeypatch):
    """torch_quant's CUDA path end to end (graph layout in, packing, GEMV for a few rows, one-pass bf16
    dequantization + GEMM for many), on CPU tensors through the interpreter."""

    class Cpu:  # what _prepare_cuda reads of a backend
        device = "cpu"

    monkeypatch.setattr(cuda_kernels, "available", lambda: True)
    gemv = cuda_kernels.gemv
    monkeypatch.setattr(cuda_kernels, "gemv", lambda *a, **kw: gemv(*a, tile=(8, 128)))
    q, scale, zero = blocked(4, 32, 128, 24, seed=2)
    w = torch_quant._prepare_cuda(Cpu, q, scale, zero, 32, 4)
    assert w.kind == "triton"
    dense = torch.from_numpy(dequantize_blocked(q, scale, zero, 32))
    for rows, tol in ((2, 1e-5), (torch_quant.GEMV_MAX_ROWS + 4, 2e-2)):  # prefill: bf16 weights and activations
        x = torch.randn(1, rows, 128, generator=torch.Generator().manual_seed(rows))
        y = torch_quant.matmul(x, w)
        ref = x @ dense
        assert y.shape == ref.shape and y.dtype == x.dtype
        assert float((y - ref).abs().max()) <= tol * float(ref.abs().max())


@in_child
def test_dequantize_falls_back_to_torch_ops(monkeypatch):
    """If the Triton kernel cannot run on some GPU, prefill still gets the same weight (from torch ops)."""
    q, scale, zero = blocked(8, 32, 64, 5, seed=3)
    packed = cuda_kernels.pack(torch.from_numpy(np.ascontiguousarray(q.T)), 8)
    s, z = torch.from_numpy(np.ascontiguousarray(scale.T)), torch.from_numpy(np.ascontiguousarray(zero.T))

    def broken():
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(cuda_kernels, "_dequant_kernel", broken)
    monkeypatch.setattr(cuda_kernels, "_DEQUANT_FAILED", [])
    w = cuda_kernels.dequantize(packed, s, z, 32, 8, torch.float32)
    np.testing.assert_array_equal(w.numpy(), dequantize_blocked(q, scale, zero, 32).T)
    assert cuda_kernels._DEQUANT_FAILED
