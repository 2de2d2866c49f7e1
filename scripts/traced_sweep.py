"""Which model_types the traced exporter converts: tiny random checkpoint -> convert -> check vs HF.

    python scripts/traced_sweep.py                      # the rotary decoder candidates below
    python scripts/traced_sweep.py llama gemma2 phi     # these model_types
    python scripts/traced_sweep.py --markdown           # the README table from the last results

Each model_type runs in its own child (a crash or hang costs only that one): a 2-layer checkpoint
from fuselm.synth (GENERIC_TINY sizes unless TINY has the family), `fuselm.convert(...,
exporter="torch")` at f32, then exporter/check.py (onnxruntime vs HF transformers, prefill + a
decode step with past), then `fuselm optimize` and the same check on the optimized graph. Result per
model_type: ok (both max abs logit diffs <= 1e-4), refused (the FuselmError,
i.e. what the user sees), failed (anything else: a bug to fix or a refusal to add). Writes
bench/results/traced_sweep.json; scripts/bench_docs.py makes the README's model table from it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CANDIDATES = [
    "apertus", "arcee", "bitnet", "cohere", "cohere2", "cwm", "diffllama", "doge", "ernie4_5", "exaone4",
    "gemma", "gemma2", "gemma3_text", "glm", "glm4", "gpt_neox", "granite", "helium", "hunyuan_v1_dense",
    "jais2", "llama", "ministral", "mistral", "nanochat", "nemotron", "olmo", "olmo2", "olmo3", "persimmon",
    "phi", "phi3", "qwen2", "qwen3", "seed_oss", "smollm3", "stablelm", "starcoder2", "vaultgemma",
    "qwen3_moe", "minicpm3", "gpt2",
    "gptj", "falcon", "codegen", "gpt_neox_japanese", "bloom", "mpt", "gpt_neo", "gpt_bigcode",
    *(MOE_TYPES := ["mixtral", "olmoe", "qwen2_moe", "granitemoe", "granitemoeshared", "flex_olmo", "cohere2_moe",
                    "hunyuan_v1_moe", "glm4_moe", "minimax_m2", "exaone_moe", "solar_open", "gpt_oss", "phimoe",
                    "ernie4_5_moe", "jetmoe"]),
    # attention variants: latent (MLA), chunked (Llama 4), per-layer head_dim / KV sharing / per-layer inputs (Gemma)
    *(ATTENTION_TYPES := ["deepseek_v2", "deepseek_v3", "glm4_moe_lite", "sarvam_mla", "deepseek_v32", "glm_moe_dsa",
                          "longcat_flash", "llama4_text", "gemma4_text", "gemma4_unified_text", "gemma3n_text"]),
    # recurrent-state layers (exporter/traced/state_ops.py), at fuselm.synth.TINY's sizes; the last ones refused
    "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "kimi_linear", "granitemoehybrid", "bamba",
    "falcon_h1", "nemotron_h", "mamba2", "mamba", "falcon_mamba", "jamba", "lfm2", "lfm2_moe",
    "zamba", "zamba2", "bailing_hybrid", "minimax", "recurrent_gemma", "xlstm", "rwkv",
]
# Mixtures of experts at the tiny size: 4 experts, top-2, narrow experts (the defaults hold 60-128 experts),
# under each config's own names for them
_MOE = {"num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2,
        "moe_topk": 2, "moe_k": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "intermediate_size": 64, "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1}
# Config fields the generic tiny sizes do not set and the model_type's defaults get wrong at that size
# ("_drop": generic sizes the config class does not take).
OVERRIDES = {"gptj": {"rotary_dim": 8}, "cwm": {"bos_token_id": 1}, "codegen": {"rotary_dim": 8}, "falcon": {"_drop": ["head_dim"]},
             "gpt_neo": {"attention_types": [[["global", "local"], 1]], "num_layers": 2},
             # MLA: head_dim is the rotary part; the latent ranks and head widths at the tiny size
             "minicpm3": {"head_dim": 8, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
                          "kv_lora_rank": 32, "q_lora_rank": 48, "num_key_value_heads": 4},
             **{mt: _MOE for mt in MOE_TYPES},
             "qwen3_moe": {**_MOE, "norm_topk_prob": True},
             # MLA at the tiny size (a dense layer, then a MoE one), its own rope layout (rope_interleave) kept
             **{mt: {**_MOE, "head_dim": 8, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
                     "kv_lora_rank": 32, "q_lora_rank": 48, "num_key_value_heads": 4, "first_k_dense_replace": 1}
                for mt in ATTENTION_TYPES[:7]},
             # a chunked rope layer and a NoPE layer, chunks and temperature changing inside the check's 16 tokens
             "llama4_text": {**_MOE, "no_rope_layers": [1, 0], "attention_chunk_size": 4, "floor_scale": 4,
                             "intermediate_size_mlp": 128, "moe_layers": [1]},
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
                              "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0]}}
RESULT = Path(__file__).resolve().parent.parent / "bench" / "results" / "traced_sweep.json"

CHILD = r"""
import json, sys, time, tempfile
from pathlib import Path
import fuselm
from fuselm.errors import FuselmError
from fuselm.exporter.check import check
import fuselm.synth as synth
model_type, work, overrides = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
drop = overrides.pop("_drop", [])
synth.GENERIC_TINY = {k: v for k, v in synth.GENERIC_TINY.items() if k not in drop}
out = {"model_type": model_type}
try:
    hf = synth.make_checkpoint(work / "hf", model_type, generic=True, **overrides)
except Exception as e:
    print(json.dumps({**out, "status": "no tiny config", "detail": f"{type(e).__name__}: {str(e)[:200]}"})); sys.exit()
t = time.perf_counter()
try:
    fuselm.convert(hf, work / "out", exporter="torch", quiet=True)
except FuselmError as e:
    print(json.dumps({**out, "status": "refused", "detail": str(e)[:300]})); sys.exit()
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
                  "interleaved": meta["rope"]["interleaved"], "rotary_dim": meta["rope"]["rotary_dim"],
                  "head_dim": meta["dims"].get("head_dim", 0), "layer_types": meta.get("layer_types")}))
"""


def markdown() -> str:
    """The README table from the last sweep's JSON."""
    rows = ["| model_type | traced result | max abs logit diff vs HF: exported / optimized | layer kinds | rope |",
            "|---|---|---|---|---|"]
    results = json.loads(RESULT.read_text())["results"]
    for mt, r in results.items():
        if r["status"] == "ok":
            rope = ("interleaved" if r["interleaved"] else "rotate_half") + (
                f", partial {r['rotary_dim']}/{r['head_dim']}" if r["rotary_dim"] < r["head_dim"] else "")
            rows.append(f"| {mt} | converts | {r['max_abs_logit_diff']:.1e} / {r['optimized_max_abs_logit_diff']:.1e} "
                        f"| {r['layer_kinds']} | {rope} |")
        else:
            rows.append(f"| {mt} | {r['status']}: {r['detail'].splitlines()[0][:150]} | | | |")
    counts = {s: sum(r["status"] == s for r in results.values()) for s in dict.fromkeys(r["status"] for r in results.values())}
    rows.append("")
    rows.append(f"{len(results)} model types: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + ".")
    return "\n".join(rows)


def main(argv=None) -> int:
    model_types = (argv if argv is not None else sys.argv[1:]) or CANDIDATES
    if model_types == ["--markdown"]:
        print(markdown())
        return 0
    for mt in model_types:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as work:
            try:
                p = subprocess.run([sys.executable, "-c", CHILD, mt, work, json.dumps(OVERRIDES.get(mt, {}))], capture_output=True, text=True, timeout=600)
                line = next((x for x in reversed(p.stdout.splitlines()) if x.startswith("{")), None)
                r = json.loads(line) if line else {"model_type": mt, "status": "failed",
                                                   "detail": f"child exit {p.returncode}: {p.stderr[-300:]}"}
            except subprocess.TimeoutExpired:
                r = {"model_type": mt, "status": "failed", "detail": "timed out after 600 s"}
        r["wall_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(r), flush=True)
        results = json.loads(RESULT.read_text())["results"] if RESULT.is_file() else {}  # another sweep may have written
        results[mt] = r
        RESULT.parent.mkdir(parents=True, exist_ok=True)
        RESULT.write_text(json.dumps({"results": dict(sorted(results.items()))}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
