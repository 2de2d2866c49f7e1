"""Which of transformers' decoders the traced exporter converts: tiny random checkpoint -> convert -> check vs HF.

    python scripts/traced_sweep.py                      # every decoder model_type (see survey())
    python scripts/traced_sweep.py llama gemma2 phi     # these model_types
    python scripts/traced_sweep.py --jobs 2             # two children at a time
    python scripts/traced_sweep.py --list               # the candidates, and what is left out and why
    python scripts/traced_sweep.py --markdown           # the model table from the last results

The candidates come from the installed transformers at run time (survey()): every model_type that
AutoModelForCausalLM maps, less what is not a decoder (encoder-decoders, encoders run as decoders,
the decoder half of an encoder-decoder, draft models that read another model's states), with a
multimodal family swept as the text model_type its config nests (gemma3 -> gemma3_text) where
AutoModelForCausalLM maps that one too. A new transformers release extends the list by itself.

Each model_type runs in its own child (a crash or hang costs only that one): a 2-layer checkpoint
from fuselm.synth (GENERIC_TINY sizes with the tiny overrides below), HF transformers running it
(a prefill), `fuselm.convert(..., exporter="torch")` at f32, then exporter/check.py
(onnxruntime vs HF transformers, prefill + a decode step with past), then `fuselm optimize` and the
same check on the optimized graph. Result per model_type: ok (both max abs logit diffs <= 1e-4),
wrong (converts, differs), refused (the FuselmError, i.e. what the user sees), unforeseen (a clean error
too, but for a failure of transformers' code no refusal foresaw: to look into), failed (anything else, a
Python traceback: a bug to fix), no tiny config (transformers cannot build or run the tiny checkpoint: a bug of this
script's overrides). Writes bench/results/traced_sweep.json; scripts/bench_docs.py makes the README's model
table from it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

RESULT = Path(__file__).resolve().parent.parent / "bench" / "results" / "traced_sweep.json"

# Model types whose conversion other work covers (recurrent-state layers; attention variants): swept and
# counted like the others, their owner shown in the table.
OWNERS = {
    "recurrent state": ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "granitemoehybrid", "nemotron_h", "bamba",
                        "falcon_h1", "zamba", "zamba2", "olmo_hybrid", "lfm2", "lfm2_moe", "mamba", "mamba2",
                        "falcon_mamba", "jamba", "kimi_linear", "minimax", "recurrent_gemma", "xlstm", "rwkv",
                        "bailing_hybrid"),
    "attention variants": ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa", "sarvam_mla",
                           "longcat_flash", "llama4_text", "gemma4_text", "gemma4_unified_text", "gemma3n_text"),
}
# Causal-LM classes that are no standalone decoder for a reason no config field states
NOT_STANDALONE = {
    "gemma4_assistant": "a draft model for assisted generation: its forward takes the target model's input "
                        "embeddings and key/value states (shared_kv_states), not token ids",
    "gemma4_unified_assistant": "a draft model for assisted generation: its forward takes the target model's input "
                                "embeddings and key/value states (shared_kv_states), not token ids",
    "xlnet": "a permutation language model (two-stream attention over a memory, bidirectional: attn_type 'bi'), "
             "not a causal decoder",
}

# Mixtures of experts at the tiny size: 4 experts, top-2, narrow experts (the defaults hold 60-256 experts),
# under each config's own names for them (only the names its config class has are set)
_MOE = {"num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2,
        "moe_topk": 2, "moe_k": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1, "n_shared_experts": 1}
# Multi-head latent attention at the tiny size: the latent ranks and head widths (kv heads == heads; head_dim is
# the rotary part)
_MLA = {"kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
        "num_key_value_heads": 4, "head_dim": 8}
# DeepSeek sparse attention at the tiny size: each query attends to its indexer's top 4 keys, fewer than the check's
# 16-token prompt holds (the selection is checked); 8 index heads, so that no two keys score exactly 0 at the cut
_DSA = {"index_topk": 4, "index_n_heads": 8, "index_head_dim": 16}
# Config fields the generic tiny sizes do not set and the model_type's defaults get wrong at that size
# ("_drop": generic sizes the config class does not take).
OVERRIDES = {
    "gptj": {"rotary_dim": 8}, "codegen": {"rotary_dim": 8},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "num_layers": 2},
    "qwen3_moe": {"norm_topk_prob": True},
    # MLA: a dense layer, then a MoE one, its own rope layout (rope_interleave) kept
    **{mt: {"first_k_dense_replace": 1} for mt in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "sarvam_mla",
                                                  "deepseek_v32", "glm_moe_dsa", "longcat_flash")},
    # a chunked rope layer and a NoPE layer, chunks and temperature changing inside the check's 16 tokens
    "llama4_text": {"no_rope_layers": [1, 0], "attention_chunk_size": 4, "floor_scale": 4, "intermediate_size_mlp": 128,
                    "moe_layers": [1]},
    # a sliding and two global layers (wider heads, k = v), the last reading the second's keys and values
    **{mt: {"num_hidden_layers": 3, "layer_types": ["sliding_attention", "full_attention", "full_attention"],
            "num_kv_shared_layers": 1, "global_head_dim": 32, "num_global_key_value_heads": 1,
            "attention_k_eq_v": True, "sliding_window": 4, "tie_word_embeddings": False,
            **({"hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 384} if mt == "gemma4_text" else {})}
       for mt in ("gemma4_text", "gemma4_unified_text")},
    # AltUp, Laurel, per-layer inputs, KV sharing and activation sparsity on one layer
    "gemma3n_text": {"num_hidden_layers": 4, "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 8,
                     "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                     "vocab_size_per_layer_input": 384, "sliding_window": 4, "laurel_rank": 8,
                     "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0]},
    # per-layer-type rope
    "cohere_compass_text": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4,
                            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                "full_attention": {"rope_type": "default", "rope_theta": 50000.0}}},
    "dots3_note_text": {"num_key_value_heads": 4},  # its config wants kv heads == heads
    "kolibri1_1": {"index_num_heads": 2},  # at most the query heads of one kv head
    # its _init_weights zeroes the embedding's padding row even after loading: no padding row, as a random
    # checkpoint's row 0 is not zero (a trained one's is)
    "youtu": {"pad_token_id": None},
    "zaya": {"num_experts_per_tok": 1},  # its only top-k
    # a sliding and a global layer (their own head sizes), the window and the relative-position reach shorter than the
    # check's 16 tokens; logits at their width (the default divides them by 24: below the check's 1e-4 resolution)
    "inkling_text": {"layer_types": ["hybrid_sliding", "hybrid"], "sliding_window_size": 8, "rel_extent": 12,
                     "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 16,
                     "logits_mup_width_multiplier": 1.0},
    # a recurrent and an attention block (two layers hold only recurrent ones by default), a window the check outgrows
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "attention_window_size": 8},
    "bailing_hybrid": {"layer_group_size": 2},  # a linear-attention layer, then attention (transformers' cache wants one)
    # a linear-attention layer, then its indexed attention: its block indexer at the tiny size (2 blocks of 2 keys and
    # the query's own block, fewer than the check's 16 tokens; 8 index heads, so that no two blocks tie at the cut)
    "qwen4_exp_text": {"full_attention_interval": 2, "indexer_n_heads": 8, "indexer_kv_heads": 1, "indexer_head_dim": 16,
                       "indexer_budget": 4, "indexer_compress_ratio": 2, "linear_key_head_dim": 16,
                       "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4},
    # BLT: patcher, local encoder / decoder and global transformer each sized; the hashed n-gram tables small
    "blt": {"encoder_hash_byte_group_vocab": 64,
            **{f"{part}_config": {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1, "intermediate_size": 128,
                                  **({"vocab_size": 384} if part != "global" else {}),
                                  **({"hidden_size_global": 64} if part in ("encoder", "decoder") else {})}
               for part in ("patcher", "encoder", "decoder", "global")}},
    # DBRX: its own size names (hidden_size maps to d_model only after the FFN config copied it); the attention
    # module reads rope_theta from attn_config and clamps by clip_qkv unconditionally
    "dbrx": {"d_model": 64, "n_heads": 4, "n_layers": 2, "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}},
}


def _config_defaults(config_class):
    try:
        return config_class()
    except Exception:  # noqa: BLE001 - a config class whose defaults do not validate (checked by name instead)
        return None


def _text_config(config):
    try:
        return config.get_text_config()
    except (AttributeError, ValueError):  # no config, or several text configs (an encoder's and a decoder's)
        return None


def survey(model_types=None) -> dict:
    """{"candidates": [model_type], "covered": {model_type: the text model_type swept for it},
    "excluded": {model_type: why it is no decoder}} over AutoModelForCausalLM's model types (or those
    of `model_types` it maps)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES as MASKED

    candidates, covered, excluded = [], {}, {}
    for mt in sorted(CAUSAL if model_types is None else set(model_types) & set(CAUSAL)):
        config = _config_defaults(CONFIG_MAPPING[mt])
        if mt in NOT_STANDALONE:
            excluded[mt] = NOT_STANDALONE[mt]
        elif getattr(config, "is_encoder_decoder", False):
            excluded[mt] = (f"an encoder-decoder (is_encoder_decoder): {CAUSAL[mt]} is its decoder half, which "
                            "cross-attends to an encoder's output")
        elif mt in MASKED:
            excluded[mt] = (f"an encoder ({MASKED[mt]}: bidirectional attention); {CAUSAL[mt]} runs it causally "
                            "only when its config makes it a decoder")
        elif getattr(config, "is_decoder", None) is False and any(
                hasattr(config, k) for k in ("add_cross_attention", "cross_attention_hidden_size")):
            excluded[mt] = (f"the decoder half of an encoder-decoder (is_decoder off by default): {CAUSAL[mt]} "
                            "cross-attends to an encoder's output")
        elif CONFIG_MAPPING[mt].model_type != mt:  # another model_type's config class (gpt-sw3: GPT2Config)
            covered[mt] = CONFIG_MAPPING[mt].model_type
        elif (text := _text_config(config)) is not None and text is not config and text.model_type in CAUSAL:
            covered[mt] = text.model_type
        else:
            candidates.append(mt)
    return {"candidates": candidates, "covered": covered, "excluded": excluded}


def owner(model_type: str) -> str:
    return next((who for who, types in OWNERS.items() if model_type in types), "")


def tiny_overrides(model_type: str) -> dict:
    """The config fields this sweep sets for `model_type` beyond synth.GENERIC_TINY: the tiny MoE / MLA sizes
    under the names its config class has, a bos token where the class wants one, OVERRIDES. A model whose
    causal LM is built from the text config it nests (Emu3, Mllama: no model_type of its own in the mapping)
    gets the sizes there, and its checkpoint keeps the outer config ("_outer"), as the released ones do."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from fuselm import synth

    config_class = CONFIG_MAPPING[model_type]
    config = _config_defaults(config_class)
    out = _derived(config) if config is not None else {}
    text = _text_config(config)
    if text is not None and text is not config:
        out = {"text_config": {**synth.GENERIC_TINY, "vocab_size": 384, "max_position_embeddings": 256,
                               "pad_token_id": 0, "eos_token_id": 2, **_derived(text)}, "_outer": True}
    if isinstance(getattr(config_class, "head_dim", None), property):  # derived from hidden / heads (Falcon)
        out["_drop"] = ["head_dim"]
    return {**out, **OVERRIDES.get(model_type, {})}


def _derived(config) -> dict:
    fields = set(vars(config)) | set(getattr(config, "attribute_map", {}))  # (per-layer fields refuse getattr)
    out = {}
    if fields & {"num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"}:
        out.update({k: v for k, v in _MOE.items() if k in fields}, intermediate_size=64)
    if "kv_lora_rank" in fields:
        out.update({k: v for k, v in _MLA.items() if k in fields or k == "head_dim"})
    if "index_topk" in fields:
        out.update(_DSA)
    out["bos_token_id"] = 1 if isinstance(vars(config).get("bos_token_id"), int) else None
    # other vocabulary sizes (Inkling 2's unpadded head) at the tokenizer's
    out.update({k: 384 for k in fields if k.endswith("vocab_size") and k != "vocab_size"})
    return out


CHILD = r"""
import json, sys, time, tempfile, warnings
from pathlib import Path
warnings.simplefilter("ignore")
import fuselm
from fuselm.errors import FuselmError
from fuselm.exporter.check import check
from fuselm.exporter.traced import TraceFailed
from fuselm.reference import hf_model
import torch
import fuselm.synth as synth
model_type, work, overrides = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
drop, outer = overrides.pop("_drop", []), overrides.pop("_outer", False)
synth.GENERIC_TINY = {k: v for k, v in synth.GENERIC_TINY.items() if k not in drop}
out = {"model_type": model_type}
try:
    hf = synth.make_checkpoint(work / "hf", model_type, generic=True, **overrides)
    if outer:  # the checkpoint's config as released: the outer one, the text config nested
        synth.make_config(model_type, generic=True, **overrides).save_pretrained(hf)
    with torch.no_grad():  # transformers runs its own tiny model (a decode step is the check's: some keep no cache)
        hf_model(hf)(input_ids=torch.tensor([[5, 6, 7, 8]]), use_cache=False)
except Exception as e:
    print(json.dumps({**out, "status": "no tiny config", "detail": f"{type(e).__name__}: {str(e)[:200]}"})); sys.exit()
t = time.perf_counter()
try:
    fuselm.convert(hf, work / "out", exporter="torch", quiet=True)
except TraceFailed as e:
    print(json.dumps({**out, "status": "unforeseen", "detail": str(e)[:400]})); sys.exit()
except FuselmError as e:
    print(json.dumps({**out, "status": "refused", "detail": str(e)[:400]})); sys.exit()
except Exception as e:
    print(json.dumps({**out, "status": "failed", "detail": f"convert: {type(e).__name__}: {str(e)[:300]}"})); sys.exit()
out["convert_s"] = round(time.perf_counter() - t, 1)
try:
    r = check(work / "out", hf, quiet=True)
except Exception as e:
    print(json.dumps({**out, "status": "failed", "detail": f"check: {type(e).__name__}: {str(e)[:300]}"})); sys.exit()
try:
    fuselm.optimize(work / "out", work / "opt", quiet=True)
    opt = check(work / "opt", hf, quiet=True)
except Exception as e:
    print(json.dumps({**out, "status": "failed", "detail": f"optimize: {type(e).__name__}: {str(e)[:300]}"})); sys.exit()
meta = json.loads((work / "out" / "fuselm.json").read_text())
worst = max(r["max_abs_logit_diff"], opt["max_abs_logit_diff"])
print(json.dumps({**out, "status": "ok" if worst <= 1e-4 else "wrong",
                  "max_abs_logit_diff": r["max_abs_logit_diff"], "optimized_max_abs_logit_diff": opt["max_abs_logit_diff"],
                  "layer_kinds": meta["traced"]["layer_kinds"], "moe": meta.get("moe"),
                  "positions": meta.get("positions", "rotary"),
                  "interleaved": meta["rope"]["interleaved"], "rotary_dim": meta["rope"]["rotary_dim"],
                  "head_dim": meta["dims"].get("head_dim", 0), "layer_types": meta.get("layer_types")}))
"""


def run_one(model_type: str, timeout: int = 900) -> dict:
    """One model_type through the child; its result line."""
    try:
        overrides = tiny_overrides(model_type)
    except Exception as e:  # noqa: BLE001 - this script's own bug, reported as such
        return {"model_type": model_type, "status": "no tiny config", "detail": f"overrides: {type(e).__name__}: {e}"}
    with tempfile.TemporaryDirectory() as work:
        try:
            p = subprocess.run([sys.executable, "-c", CHILD, model_type, work, json.dumps(overrides)],
                               capture_output=True, text=True, timeout=timeout)
            line = next((x for x in reversed(p.stdout.splitlines()) if x.startswith("{")), None)
            return json.loads(line) if line else {"model_type": model_type, "status": "failed",
                                                  "detail": f"child exit {p.returncode}: {p.stderr[-300:]}"}
        except subprocess.TimeoutExpired:
            return {"model_type": model_type, "status": "failed", "detail": f"timed out after {timeout} s"}


def _timed(model_type: str) -> dict:
    t0 = time.perf_counter()
    r = run_one(model_type)
    r["wall_s"] = round(time.perf_counter() - t0, 1)
    return r


def _rope(r: dict) -> str:
    if r.get("positions", "rotary") != "rotary":
        return r["positions"]
    return ("interleaved" if r["interleaved"] else "rotate_half") + (
        f", partial {r['rotary_dim']}/{r['head_dim']}" if r["rotary_dim"] < r["head_dim"] else "")


def counts(results: dict, candidates: list[str]) -> dict:
    """Per owner (and in all), how many candidates convert with the check ("ok") of how many."""
    out = {}
    for who in ("", *OWNERS, "all"):
        mine = [mt for mt in candidates if who == "all" or owner(mt) == who]
        out[who or "this sweep's own"] = (sum(results.get(mt, {}).get("status") == "ok" for mt in mine), len(mine))
    return out


def markdown(data: dict | None = None) -> str:
    """The model table from the last sweep's JSON."""
    data = data or json.loads(RESULT.read_text())
    results, survey_ = data["results"], data["survey"]
    rows = ["| model_type | traced result | max abs logit diff vs HF: exported / optimized | layer kinds | positions | "
            "converted by |", "|---|---|---|---|---|---|"]
    for mt in survey_["candidates"]:
        r = results.get(mt, {"status": "not run", "detail": ""})
        if r["status"] == "ok":
            rows.append(f"| {mt} | converts | {r['max_abs_logit_diff']:.1e} / {r['optimized_max_abs_logit_diff']:.1e} "
                        f"| {r['layer_kinds']} | {_rope(r)} | {owner(mt)} |")
        else:
            detail = (r.get("detail") or "").splitlines()[0][:160] if r.get("detail") else ""
            rows.append(f"| {mt} | {r['status']}{': ' + detail if detail else ''} | | | | {owner(mt)} |")
    rows += ["", "Swept as their text model_type: " + ", ".join(f"{k} ({v})" for k, v in survey_["covered"].items()) + ".",
             "", "Not decoders:", ""]
    rows += [f"- {mt}: {why}" for mt, why in survey_["excluded"].items()]
    statuses = [results.get(mt, {}).get("status", "not run") for mt in survey_["candidates"]]
    tally = {s: statuses.count(s) for s in dict.fromkeys(statuses)}
    rows += ["", f"{len(statuses)} decoder model types: " + ", ".join(f"{n} {s}" for s, n in tally.items()) + "."]
    rows += [f"{who}: {ok} of {n} convert." for who, (ok, n) in counts(results, survey_["candidates"]).items()]
    return "\n".join(rows)


def main(argv=None) -> int:
    argv = argv if argv is not None else sys.argv[1:]
    if argv == ["--markdown"]:
        print(markdown())
        return 0
    jobs = 1
    if "--jobs" in argv:
        at = argv.index("--jobs")
        jobs, argv = int(argv[at + 1]), argv[:at] + argv[at + 2:]
    found = survey()
    if argv == ["--list"]:
        print(json.dumps(found, indent=1))
        return 0
    unknown = [mt for mt in argv if mt not in found["candidates"]]
    if unknown:
        why = {**{k: f"swept as {v}" for k, v in found["covered"].items()}, **found["excluded"]}
        print("\n".join(f"{mt}: not a candidate ({why.get(mt, 'AutoModelForCausalLM does not map it')})" for mt in unknown))
        return 2
    with ThreadPoolExecutor(jobs) as pool:
        for done in as_completed([pool.submit(_timed, mt) for mt in argv or found["candidates"]]):
            r = done.result()
            print(json.dumps(r), flush=True)
            old = json.loads(RESULT.read_text()) if RESULT.is_file() else {}  # another sweep may have written
            results = {k: v for k, v in old.get("results", {}).items() if k in found["candidates"]}
            results[r["model_type"]] = r
            RESULT.parent.mkdir(parents=True, exist_ok=True)
            RESULT.write_text(json.dumps({"survey": found, "results": dict(sorted(results.items()))}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
