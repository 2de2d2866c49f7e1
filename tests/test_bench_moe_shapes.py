"""bench/convert.py's MoE shapes: the streamed checkpoint is the one transformers reads (every tensor, no other),
the shape table follows the real configs, and bench/mlx_peer.py takes the shape names."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

BENCH = Path(__file__).parent.parent / "bench"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("shape", ["tiny-moe", "olmoe-1b-7b"])
def test_streamed_moe_checkpoint_loads_in_transformers(shape, tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    cb = _module("convert")
    small = {**cb.SHAPES[shape], "num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 48, "moe_intermediate_size": 32,
             "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 512}
    monkeypatch.setitem(cb.SHAPES, "small", small)
    if shape == "olmoe-1b-7b":  # several shards, written side by side
        monkeypatch.setattr(cb, "SHARD_BYTES", 40_000)
    ckpt = cb.write_checkpoint(tmp_path / "hf", "small")
    assert (len(list(ckpt.glob("*.safetensors"))) > 1) == (shape != "tiny-moe")
    model, info = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert model.config.model_type == small["model_type"]
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["num_experts"] == 4 and cfg["rope_theta"] == small["rope_theta"]  # the names mlx-lm reads
    assert {p.shape[0] for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")} == {4}


def test_moe_shape_table_and_arguments():
    cb, peer = _module("convert"), _module("mlx_peer")
    olmoe, qwen = cb.SHAPES["olmoe-1b-7b"], cb.SHAPES["qwen3-30b-a3b-8l"]
    assert (olmoe["num_hidden_layers"], olmoe["num_experts"], olmoe["num_experts_per_tok"], olmoe["vocab_size"]) == (
        16, 64, 8, 50304)
    assert (qwen["num_hidden_layers"], qwen["num_experts"], qwen["moe_intermediate_size"], qwen["vocab_size"]) == (
        8, 128, 768, 151936)
    assert cb.SHAPES["olmoe-1b-7b-4l"]["num_hidden_layers"] == 4
    n = sum(math.prod(s) for s in cb.tensor_shapes(olmoe).values())
    assert 6.8e9 < n < 7.0e9  # OLMoE-1B-7B: 6.92B parameters
    assert peer.stem("olmoe-1b-7b") == "olmoe-1b-7b" and peer.stem("0.6b") == "qwen3-0.6b"
    args = peer.parse_args(["--shapes", "tiny-moe", "olmoe-1b-7b-4l", "--groups", "64"])
    assert args.shapes == ["tiny-moe", "olmoe-1b-7b-4l"] and args.groups == [64]
    with pytest.raises(SystemExit):
        peer.parse_args(["--shapes", "olmoe-9b"])
