"""The traced exporter on the dense rotary decoders whose layers, head or rotary are not Llama's:
found by structure (the layer list, the head, the cache update), checked against HF transformers
(f32, prefill + a decode step with past, exporter/check.py) before and after `fuselm optimize`.

GPT-J: `transformer.h`, a sin/cos table instead of inv_freq, interleaved partial rotary on
[B,S,H,D], parallel attention + MLP. GPT-NeoX (Pythia): its head `embed_out` (transformers renames
it at load), partial rotary, parallel residual, num_key_value_heads in the config that the model
ignores. Falcon (new decoder architecture): attention computed in its own code (no attention
interface), GQA. NanoChat: a rotary that turns the other way. MiniCPM3: latent attention (MLA).
"""

from __future__ import annotations

import json

import onnx
import pytest
from fuselm.exporter.check import check
from safetensors import safe_open

import fuselm
from fuselm import synth

CASES = {
    "gptj": dict(rotary_dim=8),
    "gpt_neox": dict(rotary_pct=0.5, use_parallel_residual=True),
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=2, _drop=["head_dim"]),
    "nanochat": {},
    "minicpm3": dict(head_dim=8, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, kv_lora_rank=32,
                     q_lora_rank=48, num_key_value_heads=4),
}


@pytest.mark.parametrize("model_type", CASES)
def test_traced_family_matches_hf_before_and_after_optimize(model_type, tmp_path, monkeypatch):
    overrides = dict(CASES[model_type])
    drop = overrides.pop("_drop", [])
    monkeypatch.setattr(synth, "GENERIC_TINY", {k: v for k, v in synth.GENERIC_TINY.items() if k not in drop})
    hf = synth.make_checkpoint(tmp_path / "hf", model_type, generic=True, **overrides)
    out = fuselm.convert(hf, tmp_path / "out", exporter="torch", quiet=True)
    assert check(out, hf, quiet=True)["max_abs_logit_diff"] <= 1e-4
    opt = fuselm.optimize(out, tmp_path / "opt", quiet=True)
    assert check(opt, hf, quiet=True)["max_abs_logit_diff"] <= 1e-4
    meta = json.loads((out / "fuselm.json").read_text())
    graph = onnx.load(out / "model.onnx", load_external_data=False).graph
    ropes = [n for n in graph.node if n.op_type == "FusedRoPE"]
    assert len(ropes) == 2 * meta["dims"]["layers"]
    if model_type == "gptj":
        assert meta["rope"]["interleaved"] == 1 and meta["rope"]["rotary_dim"] == 8
    if model_type == "gpt_neox":  # the head is read from the checkpoint's embed_out.weight
        with safe_open(hf / "model.safetensors", "pt") as f:
            assert "embed_out.weight" in f.keys() and "lm_head.weight" not in f.keys()
        assert meta["rope"]["rotary_dim"] == meta["dims"]["head_dim"] // 2
    if model_type == "nanochat":
        inv = next(a for a in ropes[0].attribute if a.name == "inv_freq").floats
        assert all(v < 0 for v in inv)
