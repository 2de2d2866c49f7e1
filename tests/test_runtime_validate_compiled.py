"""`fuselm validate` of torch.compile'd decode on CPU (its own file: inductor's builds are the slowest
tests, one xdist worker's share; the eager paths: tests/test_runtime_validate.py)."""

import pytest
from fuselm.runtime_metal.backends import torch_quant
from test_runtime_validate import TOKENS, _check_quantized

import fuselm


@pytest.mark.parametrize("family,stage,quant", [("qwen3", "optimized", "q4"), ("llama", "exported", "f32")])
def test_validate_torch_compiled(family, stage, quant, make_ckpt, exported, optimized):
    """torch.compile'd static decode (inductor around the AVX2 quantized kernels) on CPU."""
    model = (exported if stage == "exported" else optimized)(family, quant)
    r = fuselm.validate(model, make_ckpt(family), tokens=TOKENS, backend="torch", compile=True, quiet=True)
    assert r["compiled"], r["compile_failed"]
    if quant == "q4":
        assert r["quantized_kernel"] in (torch_quant.CPU_KINDS if torch_quant.cpu_kernels() else ("dequant",))
        _check_quantized(r)
    else:
        assert r["tokens"] == r["hf"] and max(r["max_logit_diff_hf"]) < 1e-3
