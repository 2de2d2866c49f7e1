"""Every instruction set's CPU kernels on this machine: correct against each other, and how fast.

    python bench/cpu_isa_check.py            # exits 1 if a kernel disagrees; notes a missing AVX-512 VNNI

For a machine with AVX-512 VNNI (the development box is AVX2-only, so that kernel is only compiled
there): each ISA this CPU runs (scalar, avx2, avx512vnni) computes the same int8 and int16 products
(4- and 8-bit weights, blocks 32/128, odd shapes, 1/5/70 rows of x), which must agree with the scalar
kernel to f32 accumulation order (the scalar kernel is checked against numpy in
tests/test_cpu_kernels.py; `pytest tests/test_cpu_kernels.py -k avx512` runs those tests on the
AVX-512 kernel too). Then the decode GEMV (GB/s of weights read) and the 512-row integer GEMM
(GFLOP/s), 1 and all threads, min of several runs. Adds this CPU's entry to
bench/results/cpu-isa-check.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fuselm.runtime_metal.backends.torch_quant import ISAS, cpu_kernels  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def packed(k, n, block, bits, seed):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 2**bits, (k, n)).astype(np.uint8)
    scale = (rng.random((k // block, n)) * 0.02 + 1e-3).astype(np.float32)
    zp = rng.integers(0, 2**bits, (k // block, n)).astype(np.uint8)
    w = (q - np.repeat(zp, block, 0).astype(np.float64)) * np.repeat(scale.astype(np.float64), block, 0)
    return cpu_kernels().pack(*(torch.from_numpy(a) for a in (q, scale, zp)), block, bits), w


def best_ms(fn, runs):
    fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def main() -> int:
    kernels = cpu_kernels()
    if kernels is None:
        print("no CPU kernels (no compiler and nothing prebuilt)")
        return 1
    isas = [name for name, i in ISAS.items() if kernels.isa_supported(i)]
    print(f"this CPU runs: {', '.join(isas)}")
    if "avx512vnni" not in isas:
        print("no AVX-512 VNNI here: that kernel is not checked (run this on a machine that has it)")
    bad = 0
    for k, n, block, bits in ((96, 37, 32, 4), (2560, 40, 128, 4), (384, 33, 32, 8), (1024, 19, 128, 8)):
        p, w = packed(k, n, block, bits, seed=k + n)
        for m in (1, 5, 70):
            x = torch.from_numpy(np.random.default_rng(m).standard_normal((m, k)).astype(np.float32))
            scale = np.abs(x.numpy()).astype(np.float64) @ np.abs(w)
            for act in (8, 16):
                ref = kernels.gemv(x, *p, bits, 2, act, 0).numpy()
                for isa in isas[1:]:
                    if isa == "avx512vnni" and act == 16:
                        continue
                    d = float(np.max(np.abs(kernels.gemv(x, *p, bits, 2, act, ISAS[isa]).numpy() - ref) / scale))
                    if d > 2e-6:
                        bad += 1
                        print(f"MISMATCH {isa} int{act}: K={k} N={n} block={block} bits={bits} rows={m}: {d:.2e}")
    print("kernels agree" if not bad else f"{bad} mismatches")
    rows = []
    threads = os.cpu_count()
    for (k, n, bits) in ((1024, 6144, 4), (3072, 1024, 4), (1024, 32768, 8)):
        p, _ = packed(k, n, 32, bits, seed=0)
        nbytes = sum(t.numel() * t.element_size() for t in p)
        for isa in isas:
            for act in (8, 16):
                if isa == "avx512vnni" and act == 16:
                    continue
                for th in sorted({1, threads}):
                    x1 = torch.randn(1, k)
                    dec = best_ms(lambda: kernels.gemv(x1, *p, bits, th, act, ISAS[isa]), 5 if isa == "scalar" else 30)  # noqa: B023 - called at once
                    row = {"isa": isa, "act_bits": act, "K": k, "N": n, "bits": bits, "threads": th,
                           "decode_ms": dec, "decode_gb_s": nbytes / dec / 1e6}
                    if bits == 4 and isa != "scalar":
                        x = torch.randn(512, k)
                        pre = best_ms(lambda: kernels.gemv(x, *p, bits, th, act, ISAS[isa]), 3)  # noqa: B023 - called at once
                        row.update(prefill512_ms=pre, prefill512_gflop_s=2 * 512 * k * n / pre / 1e6)
                    rows.append(row)
                    print(f"{isa:>10} int{act:<2} {k}x{n} {bits}-bit {th} thr: decode {dec:7.3f} ms "
                          f"{row['decode_gb_s']:5.1f} GB/s" + (f", prefill 512 rows {row['prefill512_ms']:7.1f} ms "
                                                             f"{row['prefill512_gflop_s']:5.0f} GFLOP/s" if "prefill512_ms" in row else ""))
    RESULTS.mkdir(exist_ok=True)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")
    out = RESULTS / "cpu-isa-check.json"  # one entry per CPU model
    old = json.loads(out.read_text()) if out.exists() else {}
    old[cpu] = {"isas": isas, "mismatches": bad, "rows": rows}
    out.write_text(json.dumps(old, indent=2) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
