"""`fuselm validate` for every family, exported and optimized, f32 and q4, on both backends.

The runtime runs its compiled paths here: static-shape decode (checked against dynamic decode on
the first step) and the backends' fused and quantized kernels. References: HF transformers
(f32 tokens and logits) and onnxruntime on the same graph (q4 tokens and logits).
"""

import pytest
from fuselm.runtime_metal.checks import INT8_KL_FACTOR

import fuselm
from fuselm.errors import CheckFailed

FAMILIES = ["qwen3", "qwen2", "llama", "mistral"]
TOKENS = 8


@pytest.mark.parametrize("backend", ["torch", "mlx"])
@pytest.mark.parametrize("quant", ["f32", "q4"])
@pytest.mark.parametrize("stage", ["exported", "optimized"])
@pytest.mark.parametrize("family", FAMILIES)
def test_validate(family, stage, quant, backend, make_ckpt, exported, optimized):
    model = (exported if stage == "exported" else optimized)(family, quant)
    r = fuselm.validate(model, make_ckpt(family), tokens=TOKENS, backend=backend, quiet=True)
    assert r["backend"] == backend
    assert r["static_decode"], "static-shape decode fell back to dynamic decode"
    if backend == "mlx":  # mx.compile'd decode step (torch CPU compiles on request: see below)
        assert r["compiled"], r["compile_failed"]
    if quant == "f32":
        assert r["tokens"] == r["hf"]
        assert max(r["max_logit_diff_hf"]) < 1e-3
    else:
        assert r["quantized"]
        _check_quantized(r)
        if backend == "mlx":
            assert r["quantized_kernel"] == "mlx"  # mx.quantized_matmul, not a dequantized copy


def _check_quantized(r):
    """f32 activations: onnxruntime level 1's tokens and logits; int8 activations (the CPU kernels' default): KL
    divergence on text from level 1 within INT8_KL_FACTOR x onnxruntime level 4's, and not zero (it was measured)."""
    if "int8" in r:
        assert 0 < r["int8"]["kl"] <= INT8_KL_FACTOR * r["int8"]["ort_level4_kl"] + 1e-6, r["int8"]
        assert r["int8"]["tokens"] > 100 and "KL divergence" in r["int8"]["criterion"]
    else:
        assert r["tokens"] == r["onnxruntime"]
        assert max(r["max_logit_diff_ort"]) < 1e-3


def test_validate_fails_on_the_wrong_reference(make_ckpt, exported):
    """A graph checked against another checkpoint (other weights) fails: exit 1, not a silent pass.

    qwen2 is untied, so its greedy tokens vary from step to step (tied tiny models repeat a token)."""
    other = make_ckpt("qwen2", seed=1)
    with pytest.raises(CheckFailed, match="differ from HF transformers at step 0"):
        fuselm.validate(exported("qwen2", "f32"), other, tokens=4, backend="torch", quiet=True)
