"""Property test: random valid configs of every family go through convert (f32 and q4), optimize and
validate, and the runtime's greedy tokens equal HF transformers' (f32) and onnxruntime's (q4).

The configs vary what the exporter, the passes and the runtime must get right: layers; hidden size;
kv heads 1-4 with group sizes 1-8 (a single kv head included); head_dim different from hidden/heads
(qwen3, llama, mistral: HF reads it from the config; qwen2 derives it); tied or untied embeddings;
biases (qwen2's q/k/v, attention_bias, llama's mlp_bias); rope default / linear / llama3 / yarn with
their parameters; mistral's sliding window. Partial rotary is not generated: HF's apply_rotary_pos_emb
for these four families rotates the whole head_dim, so such a config does not run in transformers.

Budget: two fixed examples (the riskiest corners) plus FUSELM_HYPOTHESIS_EXAMPLES generated ones
(default 8; e.g. FUSELM_HYPOTHESIS_EXAMPLES=200 for a long run). The seed is FUSELM_FUZZ_SEED
(default 0), so CI repeats the same examples.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, example, given, seed, settings
from hypothesis import strategies as st
from reliability_helpers import FUZZ_SEED, HYPOTHESIS_EXAMPLES

import fuselm
from fuselm.errors import CheckFailed
from fuselm.synth import make_checkpoint

TOKENS = 4
_case = itertools.count()


@st.composite
def rope(draw) -> dict:
    kind = draw(st.sampled_from(["default", "linear", "llama3", "yarn"]))
    p = {"rope_type": kind, "rope_theta": draw(st.sampled_from([10000.0, 500000.0, 1000000.0]))}
    if kind == "linear":
        p["factor"] = draw(st.sampled_from([1.5, 2.0, 8.0]))
    elif kind == "llama3":
        p.update(factor=draw(st.sampled_from([2.0, 8.0])), low_freq_factor=1.0,
                 high_freq_factor=draw(st.sampled_from([2.0, 4.0])),
                 original_max_position_embeddings=draw(st.sampled_from([8, 16, 32])))
    elif kind == "yarn":
        p.update(factor=draw(st.sampled_from([2.0, 4.0, 8.0])),
                 original_max_position_embeddings=draw(st.sampled_from([16, 32])))
        if draw(st.booleans()):
            p.update(beta_fast=draw(st.sampled_from([16.0, 32.0])), beta_slow=draw(st.sampled_from([1.0, 2.0])))
        if draw(st.booleans()):
            p["attention_factor"] = draw(st.sampled_from([0.9, 1.2]))
    return p


@st.composite
def configs(draw) -> tuple[str, dict]:
    family = draw(st.sampled_from(["qwen3", "qwen2", "llama", "mistral"]))
    kv = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.integers(1, 8))
    heads = kv * group
    c = {"num_hidden_layers": draw(st.integers(1, 3)), "num_attention_heads": heads, "num_key_value_heads": kv,
         "intermediate_size": draw(st.sampled_from([24, 64, 96])),
         "tie_word_embeddings": draw(st.booleans()), "rope_parameters": draw(rope())}
    c["hidden_size"] = heads * draw(st.sampled_from([2, 4, 8]))  # transformers requires a multiple of heads
    if family != "qwen2":  # head_dim from the config, usually not hidden / heads (qwen2 derives it)
        c["head_dim"] = draw(st.sampled_from([4, 8, 16, 32]))
    if family in ("qwen3", "llama"):
        c["attention_bias"] = draw(st.booleans())
    if family == "llama":
        c["mlp_bias"] = draw(st.booleans())
    if family == "mistral":
        c["sliding_window"] = draw(st.sampled_from([None, 5, 9]))
    r = c["rope_parameters"]
    if r["rope_type"] == "yarn":  # keep HF from warning about an implicit factor that differs
        c["max_position_embeddings"] = int(r["factor"] * r["original_max_position_embeddings"])
    return family, c


SINGLE_KV_YARN = ("llama", {"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 1,
                            "hidden_size": 32, "head_dim": 8, "intermediate_size": 64, "tie_word_embeddings": False,
                            "attention_bias": True, "mlp_bias": True, "max_position_embeddings": 64,
                            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                "original_max_position_embeddings": 16}})
QWEN3_HEAD_DIM_LLAMA3 = ("qwen3", {"num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
                                   "hidden_size": 48, "head_dim": 16, "intermediate_size": 96,
                                   "tie_word_embeddings": True, "attention_bias": True,
                                   "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 8}})


@given(case=configs())
@seed(FUZZ_SEED)
@example(case=SINGLE_KV_YARN)
@example(case=QWEN3_HEAD_DIM_LLAMA3)
@settings(max_examples=HYPOTHESIS_EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_random_valid_configs_validate_against_hf(case, tmp_path, tally):
    family, overrides = case
    work = tmp_path / f"case{next(_case)}"  # tmp_path is shared by the examples
    hf = make_checkpoint(work / "hf", family, **overrides)
    problems = []
    for quant in ("f32", "q4"):
        exported = fuselm.convert(hf, work / f"exported-{quant}", quant=quant, quiet=True)
        optimized = fuselm.optimize(exported, work / f"optimized-{quant}", quiet=True)
        try:
            r = fuselm.validate(optimized, hf, tokens=TOKENS, quiet=True)
        except CheckFailed as e:
            problems.append(f"{quant}: {e}")
            continue
        if quant == "f32" and not (r["tokens"] == r["hf"] and max(r["max_logit_diff_hf"]) < 1e-3):
            problems.append(f"f32: tokens {r['tokens']} vs HF {r['hf']}, max |dlogit| {max(r['max_logit_diff_hf']):.2g}")
        # q4: the torch CPU backend's int16-activation GEMV differs from onnxruntime's MatMulNBits by up to
        # ~1e-3 on logits of ~50 (relative ~2e-5; MLX: 1e-5); tokens must agree exactly. With int8 activations
        # (the CPU default, r["int8"]) validate itself holds the drift within onnxruntime level 4's
        if quant == "q4" and "int8" not in r and not (r["tokens"] == r["onnxruntime"] and max(r["max_logit_diff_ort"]) < 1e-2):
            problems.append(f"q4: tokens {r['tokens']} vs onnxruntime {r['onnxruntime']}, max |dlogit| "
                            f"{max(r['max_logit_diff_ort']):.2g}")
    label = f"{family}, rope {overrides['rope_parameters']['rope_type']}"
    assert tally.record("valid", label, not problems), (family, overrides, problems)
