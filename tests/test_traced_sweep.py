"""scripts/traced_sweep.py's bookkeeping: which of transformers' causal-LM model types it sweeps, which it
leaves out and why (read from the config classes), the tiny overrides it derives, and its table's counts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "traced_sweep.py"


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("traced_sweep", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SAMPLE = ["llama", "gpt2", "gpt-sw3", "bloom", "mpt", "falcon", "mixtral", "bart", "whisper", "bert", "roberta",
          "trocr", "bert-generation", "gemma3", "gemma3_text", "qwen3_5", "llama4", "gemma4_assistant", "gpt_neox",
          "not_a_model_type"]


@pytest.fixture(scope="module")
def found(sweep):
    return sweep.survey(SAMPLE)


def test_every_mapped_type_is_swept_covered_or_excluded_once(found):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kept = [*found["candidates"], *found["covered"], *found["excluded"]]
    assert sorted(kept) == sorted(set(SAMPLE) & set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
    assert len(kept) == len(set(kept))


def test_decoders_are_candidates(found):
    # learned positions, ALiBi, rotary, MoE; gpt_neox's config has an is_decoder field but no cross-attention
    assert {"llama", "gpt2", "bloom", "mpt", "falcon", "mixtral", "gemma3_text", "gpt_neox"} <= set(found["candidates"])


def test_exclusions_come_with_the_reason_the_config_gives(found):
    ex = found["excluded"]
    assert "encoder-decoder" in ex["bart"] and "encoder-decoder" in ex["whisper"]
    assert ex["bert"].startswith("an encoder (BertForMaskedLM") and ex["roberta"].startswith("an encoder")
    assert "decoder half" in ex["trocr"] and "decoder half" in ex["bert-generation"]
    assert "draft model" in ex["gemma4_assistant"]


def test_multimodal_families_are_swept_as_their_text_model_type(found):
    assert found["covered"] == {"gemma3": "gemma3_text", "qwen3_5": "qwen3_5_text", "llama4": "llama4_text",
                                "gpt-sw3": "gpt2"}


def test_tables_name_only_mapped_types(sweep):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    named = {*sweep.OVERRIDES, *sweep.NOT_STANDALONE, *(t for ts in sweep.OWNERS.values() for t in ts)}
    assert named <= set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def test_tiny_overrides_are_derived_from_the_config_class(sweep):
    assert sweep.tiny_overrides("falcon")["_drop"] == ["head_dim"]  # head_dim is a property of FalconConfig
    moe = sweep.tiny_overrides("mixtral")
    assert moe["num_local_experts"] == 4 and moe["num_experts_per_tok"] == 2 and "n_routed_experts" not in moe
    assert sweep.tiny_overrides("cwm")["bos_token_id"] == 1  # its config wants an int bos
    assert "num_local_experts" not in sweep.tiny_overrides("llama")


def test_markdown_counts_per_owner(sweep):
    owned = sweep.OWNERS["recurrent state"][0]
    data = {"survey": {"candidates": ["llama", "gpt2", owned], "covered": {"gemma3": "gemma3_text"},
                       "excluded": {"bart": "an encoder-decoder"}},
            "results": {"llama": {"status": "ok", "max_abs_logit_diff": 1e-6, "optimized_max_abs_logit_diff": 2e-6,
                                  "layer_kinds": 1, "positions": "rotary", "interleaved": 0, "rotary_dim": 16,
                                  "head_dim": 16},
                        "gpt2": {"status": "refused", "detail": "model_type 'gpt2': why"},
                        owned: {"status": "ok", "max_abs_logit_diff": 0.0, "optimized_max_abs_logit_diff": 0.0,
                                "layer_kinds": 2, "positions": "rotary", "interleaved": 0, "rotary_dim": 8,
                                "head_dim": 16}}}
    table = sweep.markdown(data)
    assert "| gpt2 | refused: model_type 'gpt2': why |" in table
    assert f"| {owned} | converts | 0.0e+00 / 0.0e+00 | 2 | rotate_half, partial 8/16 | recurrent state |" in table
    assert "- bart: an encoder-decoder" in table
    assert "3 decoder model types: 2 ok, 1 refused." in table
    assert "this sweep's own: 1 of 2 convert." in table and "all: 2 of 3 convert." in table
