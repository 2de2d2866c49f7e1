"""The CPU low-bit kernels (runtime_metal/backends/cpu_kernels.cpp) against numpy references, on every
instruction set this CPU runs (scalar and AVX2 here; AVX-512 VNNI where the CPU has it, skipped
elsewhere: `pytest tests/test_cpu_kernels.py -k avx512` on such a machine).

The kernels round x per 32 values to int8 or int16; the reference applies the same rounding, so what
is left is f32 accumulation order (relative 1e-6), and further checks bound the rounding itself:
int16 within 1e-4 of f64 math, int8 no further from it than onnxruntime's MatMulNBits at accuracy
level 4 (its int8 activations) on the same weights. Odd shapes exercise the padding to whole groups
of 256, blocks of 64 and 128 the repeated scales, up to 16 rows the multi-row tiles, 70 rows the
chunks of 64 rows of the integer GEMM (prefill), the dequantize + GEMM path of int16 prefill.
"""

import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from fuselm.runtime_metal.backends import kernel_build, make_backend, torch_quant
from fuselm.runtime_metal.backends.torch_quant import (
    GEMV_MAX_ROWS,
    ISAS,
    cpu_kernels,
    matmul,
    prepare,
)

from fuselm import contract
from fuselm.errors import FuselmError
from fuselm.reference import ort_session

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="no CPU kernels (no compiler)")


@pytest.fixture(autouse=True)
def two_thread_team(monkeypatch):
    """matmul runs with a team of 2 (as gemv's calls below ask), whatever torch's thread count: the
    split of rows between threads is tested even in a one-thread xdist worker."""
    monkeypatch.setitem(torch_quant.KERNEL_THREADS, "n", 2)


def _on(isa, *more):  # a parameter set skipped where the CPU lacks `isa`
    lacks = cpu_kernels() is None or not cpu_kernels().isa_supported(ISAS[isa])
    return pytest.param(isa, *more, marks=pytest.mark.skipif(lacks, reason=f"this CPU lacks {isa}"))


KERNEL_ISAS = [_on(isa) for isa in ISAS]
ACT = [_on(isa, act) for isa in ISAS for act in (8, 16) if not (isa == "avx512vnni" and act == 16)]


def _weights(k, n, block, bits, seed, zero_points=True):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 2**bits, (k, n)).astype(np.uint8)
    scale = (rng.random((k // block, n)) * 0.02 + 1e-3).astype(np.float32)
    zp = rng.integers(0, 2**bits, (k // block, n)).astype(np.uint8) if zero_points else None
    return q, scale, zp


def _dequantized(q, scale, zp, block):  # [K, N] float64
    z = np.zeros_like(scale) if zp is None else zp.astype(np.float64)
    return (q.astype(np.float64) - np.repeat(z, block, 0)) * np.repeat(scale.astype(np.float64), block, 0)


def _rounded(x, act_bits):
    """x as the kernels see it: per 32 values, round(x / d) * d with d = max|x| / qmax (f32 math)."""
    qmax = np.float32(127 if act_bits == 8 else 32767)
    m, k = x.shape
    b = x.reshape(m, k // 32, 32)
    amax = np.abs(b).max(-1, keepdims=True)
    inv = np.where(amax > 0, qmax / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return (np.rint(b * inv) * (amax / qmax).astype(np.float32)).reshape(m, k).astype(np.float64)


def _pack(q, scale, zp, block, bits):
    return cpu_kernels().pack(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(zp), block, bits)


CASES = [  # (K, N, block)
    (96, 37, 32),  # K pads 96 -> 256
    (320, 9, 32),
    (384, 40, 64),
    (384, 33, 128),
    (2560, 24, 128),  # ten groups, as Qwen3-4B's hidden size
]


@pytest.mark.parametrize("isa,act_bits", ACT)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k,n,block", CASES)
def test_gemv_matches_reference(k, n, block, bits, isa, act_bits):
    q, scale, zp = _weights(k, n, block, bits, seed=k + n + bits)
    w = _dequantized(q, scale, zp, block)
    packed = _pack(q, scale, zp, block, bits)
    rng = np.random.default_rng(1)
    for m in (1, 2, 3, 4, 5, 16, 70):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[0, :32] *= 100  # an outlier sub-block: its scale must not leak into the others
        y = cpu_kernels().gemv(torch.from_numpy(x), *packed, bits, 2, act_bits, ISAS[isa]).numpy()
        xr = _rounded(x, act_bits)
        ref, tol = xr @ w, np.abs(xr) @ np.abs(w)  # tol: the scale of the sum's rounding errors
        assert np.all(np.abs(y - ref) <= 2e-6 * tol + 1e-30), (m, np.max(np.abs(y - ref) / tol))
        if act_bits == 16:  # the int16 rounding itself: 1.5e-5 of a sub-block's max per value
            assert np.max(np.abs(y - x.astype(np.float64) @ w) / tol) < 1e-4


@pytest.mark.parametrize("isa", [p for p in KERNEL_ISAS if p.values[0] != "avx512vnni"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k,n,block", CASES)
def test_dequant_matches_reference(k, n, block, bits, isa):
    q, scale, zp = _weights(k, n, block, bits, seed=2 * k + n)
    out = cpu_kernels().dequant(*_pack(q, scale, zp, block, bits), k, bits, torch.empty(n * k + 5), 2, ISAS[isa]).numpy()
    ref = _dequantized(q, scale, zp, block).T
    assert out.shape == (n, k)
    assert np.max(np.abs(out - ref)) <= 1e-6 * np.max(np.abs(ref))


def _ort_level4(q, scale, zp, block, x):
    """onnxruntime's MatMulNBits at accuracy level 4 (int8 activations) on DequantizeLinear -> MatMul."""
    from onnx import TensorProto, helper, numpy_helper

    flat = q.reshape(-1)
    uint4 = lambda name, a: helper.make_tensor(name, TensorProto.UINT4, a.shape, (a.reshape(-1)[0::2] | (a.reshape(-1)[1::2] << 4)).tobytes(), raw=True)  # noqa: E731
    assert flat.size % 2 == 0 and zp.size % 2 == 0
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["q", "s", "z"], ["w"], axis=0, block_size=block),
         helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [x.shape[0], q.shape[1]])],
        [uint4("q", q), numpy_helper.from_array(scale, "s"), uint4("z", zp)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", contract.OPSET)])
    return ort_session(model, optimize=True, accuracy_level=4).run(None, {"x": x})[0]


@pytest.mark.parametrize("isa", [p for p in KERNEL_ISAS if p.values[0] != "scalar"])
@pytest.mark.parametrize("rows", [1, 64])
def test_int8_error_within_onnxruntime_level4(isa, rows):
    """The int8 path's error against f64 math, beside onnxruntime's int8 activations (level 4) on the same
    4-bit weights, decode (1 row) and prefill (64 rows): held within 1.5x of level 4's; int16 far below."""
    k, n, block = 2048, 512, 32
    q, scale, zp = _weights(k, n, block, 4, seed=7)
    x = np.random.default_rng(3).standard_normal((rows, k)).astype(np.float32)
    exact = x.astype(np.float64) @ _dequantized(q, scale, zp, block)
    rel = lambda y: float(np.abs(y - exact).max() / np.abs(exact).max())  # noqa: E731
    packed = _pack(q, scale, zp, block, 4)
    err = {act: rel(cpu_kernels().gemv(torch.from_numpy(x), *packed, 4, 2, act, ISAS[isa if act == 8 else "avx2"]).numpy())
           for act in (8, 16)}
    ort4 = rel(_ort_level4(q, scale, zp, block, x))
    assert err[8] <= 1.5 * ort4, (err, ort4)
    assert err[16] < 1e-4 and err[16] < ort4 / 50, (err, ort4)


@pytest.mark.parametrize("act", ["int8", "int16"])
@pytest.mark.parametrize("rows", [1, 7, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 40])
def test_matmul_through_prepare(rows, act, monkeypatch):
    """torch_quant.prepare + matmul as the runtime calls them, in both activation modes: int8's integer
    kernel for every row count, int16's GEMV up to 16 rows and dequantize + GEMM beyond; weights
    without zero points (symmetric) included."""
    monkeypatch.setenv("FUSELM_CPU_ACTIVATIONS", act)
    backend = make_backend("torch", "cpu")
    for bits, zero_points in ((4, True), (8, False)):
        q, scale, zp = _weights(320, 21, 64, bits, seed=rows + bits, zero_points=zero_points)
        w = prepare(backend, q, scale, zp, 64, bits)
        assert w.kind == torch_quant.cpu_kind(torch_quant.cpu_isa(), act, bits)
        x = np.random.default_rng(rows).standard_normal((1, rows, 320)).astype(np.float32)
        y = matmul(torch.from_numpy(x), w).numpy()
        ref = x.astype(np.float64) @ _dequantized(q, scale, zp, 64)
        assert y.shape == (1, rows, 21)
        bound = 2e-2 if w.kind.endswith("int8") else 1e-4
        assert np.max(np.abs(y - ref)) < bound * np.max(np.abs(ref))


def test_isa_and_activations_selection(monkeypatch):
    """FUSELM_CPU_ISA picks the kernels (scalar runs anywhere); an unknown or missing one is a clear error."""
    backend = make_backend("torch", "cpu")
    q, scale, zp = _weights(256, 8, 32, 4, seed=0)
    monkeypatch.setenv("FUSELM_CPU_ISA", "scalar")
    assert prepare(backend, q, scale, zp, 32, 4).kind == "scalar-int8"
    monkeypatch.setenv("FUSELM_CPU_ISA", "sse9")
    with pytest.raises(FuselmError, match="not one of scalar, avx2, avx512vnni"):
        prepare(backend, q, scale, zp, 32, 4)
    missing = next((n for n, i in ISAS.items() if not cpu_kernels().isa_supported(i)), None)
    if missing:
        monkeypatch.setenv("FUSELM_CPU_ISA", missing)
        with pytest.raises(FuselmError, match="this CPU lacks it"):
            prepare(backend, q, scale, zp, 32, 4)
    monkeypatch.delenv("FUSELM_CPU_ISA")
    monkeypatch.setenv("FUSELM_CPU_ACTIVATIONS", "int4")
    with pytest.raises(FuselmError, match="not one of int8, int16"):
        prepare(backend, q, scale, zp, 32, 4)


def test_fallback_without_kernels(monkeypatch, tmp_path, caplog):
    """No prebuilt kernels (or a damaged file) and no compiler: load says so and returns None; prepare then dequantizes at load
    (kind "dequant") and matmul stays correct."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, "fuselm.runtime"):
        assert kernel_build.load(tmp_path / "empty") is None
    assert "no C++ compiler" in caplog.text and "dequantized to f32 at load" in caplog.text
    damaged = kernel_build.library_path(tmp_path / "damaged")  # not a library: removed, then as above
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"not an ELF file")
    assert kernel_build.load(tmp_path / "damaged") is None and not damaged.exists()
    monkeypatch.setattr(torch_quant, "cpu_kernels", lambda: None)
    q, scale, zp = _weights(320, 21, 32, 4, seed=5)
    w = prepare(make_backend("torch", "cpu"), q, scale, zp, 32, 4)
    assert w.kind == "dequant"
    x = np.random.default_rng(0).standard_normal((3, 320)).astype(np.float32)
    ref = x.astype(np.float64) @ _dequantized(q, scale, zp, 32)
    assert np.max(np.abs(matmul(torch.from_numpy(x), w).numpy() - ref)) < 1e-5 * np.max(np.abs(ref))


def test_prebuilt_kernels_load_without_a_compiler(tmp_path):
    """A fresh process finds the kernels this session built (same sources, torch, Python) in the cache and
    imports them with no compiler on PATH: nothing is rebuilt."""
    code = ("import logging, sys; logging.basicConfig(); from fuselm.runtime_metal.backends import kernel_build; "
            "m = kernel_build.load(); sys.exit(0 if m is not None and m.isa_supported(0) else 3)")
    keep = ("TORCH_EXTENSIONS_DIR", "FUSELM_KERNEL_DIR", "XDG_CACHE_HOME", "HOME", "PYTHONPATH")
    env = {**{k: v for k, v in os.environ.items() if k in keep}, "PATH": str(tmp_path), "CXX": str(tmp_path / "c++")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "building" not in r.stderr and "no C++ compiler" not in r.stderr


def test_layout_errors_are_clear():
    kernels = cpu_kernels()
    q, scale, zp = _weights(256, 8, 32, 4, seed=0)
    packed = _pack(q, scale, zp, 32, 4)
    with pytest.raises(RuntimeError, match="does not match the packed weights"):
        kernels.gemv(torch.zeros(1, 512), *packed, 4, 1, 8, 0)
    with pytest.raises(RuntimeError, match="disagree on Kp"):
        kernels.gemv(torch.zeros(1, 256), packed[0], packed[1], packed[2], 8, 1, 8, 0)
    with pytest.raises(RuntimeError, match="multiple of 32 dividing K"):
        kernels.pack(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(zp), 48, 4)
    with pytest.raises(RuntimeError, match="values above 15"):
        kernels.pack(torch.from_numpy(q + 16), torch.from_numpy(scale), torch.from_numpy(zp), 32, 4)
    with pytest.raises(RuntimeError, match="act_bits must be 8 or 16"):
        kernels.gemv(torch.zeros(1, 256), *packed, 4, 1, 4, 0)
