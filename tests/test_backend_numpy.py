"""`--backend numpy`, the host reference (f32 on the CPU): a backend added as numpy_backend.py plus its
branch in backends/__init__.py, nothing else. Checked against torch on the same graphs (greedy tokens of
a trained q4 model, the 8-bit cache's drift) and, through `fuselm validate`, against onnxruntime."""

from __future__ import annotations

import numpy as np
from test_kv_cache import PROMPT, _logits, _Null, assert_greedy_agree  # the torch and MLX cache tests' runs

import fuselm
from fuselm.cli import main


def test_run_and_validate_on_numpy(optimized, make_ckpt, capsys):
    model = str(optimized("qwen3", "q4"))
    assert main(["run", model, "--backend", "numpy", "--prompt-ids", "1,2,3", "--max-tokens", "4", "--ignore-eos"]) == 0
    assert "numpy on host" in capsys.readouterr().err
    for kv in ([], ["--kv-bits", "8"]):  # greedy tokens and logits against onnxruntime on the same q4 graph
        assert main(["validate", model, "--backend", "numpy", "--reference", str(make_ckpt("qwen3")), "--tokens", "6",
                     *kv]) == 0


def test_greedy_tokens_equal_torch(optimized):
    """A trained q4 model: 24 greedy tokens on numpy are torch's (or part at a near-tie), with the float and the 8-bit
    cache."""
    model = optimized("qwen3", "q4", train_steps=40)
    runs = {(backend, bits): fuselm.run(model, prompt=PROMPT, max_tokens=24, ignore_eos=True, quiet=True,
                                        backend=backend, stream=_Null(), kv_bits=bits)["tokens"]
            for backend in ("numpy", "torch") for bits in (None, 8)}
    assert len(set(runs["torch", None])) > 3  # a real continuation, not one repeated token
    for bits in (None, 8):
        assert_greedy_agree(model, runs["torch", bits], [runs["numpy", bits]], backend="torch", kv_bits=bits)


def test_int8_cache_drift_within_torch(optimized):
    """The same 8-bit format on both: numpy's drift from its float cache is within torch's (x1.5), and the
    two 8-bit runs agree to 1% of that drift."""
    path = optimized("qwen3")
    ref = {b: _logits(path, b) for b in ("numpy", "torch")}
    q8 = {b: _logits(path, b, kv_bits=8, kv_group_size=32) for b in ("numpy", "torch")}
    drift = {b: float(np.abs(q8[b] - ref[b]).max()) for b in ref}
    assert 0 < drift["numpy"] <= 1.5 * drift["torch"], drift
    assert np.abs(ref["numpy"] - ref["torch"]).max() <= 1e-4 * float(np.abs(ref["torch"]).max())
    # same rows, same rounding: the two 8-bit runs differ by float error only (measured: 2e-4 of the drift)
    assert np.abs(q8["numpy"] - q8["torch"]).max() <= 0.01 * drift["torch"], drift
