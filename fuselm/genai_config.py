"""genai_config.json: what onnxruntime-genai needs to run a fuselm model directory as it is.

`onnxruntime_genai.Model(DIR)` reads it beside model.onnx. A fuselm graph runs there as a plain
`"decoder"` with the graph contract's names; three settings matter (checked by hand, then by
tests/test_genai_config.py): `"type": "decoder"` (a family type such as "qwen3" makes genai expect
its own builder's graph), `position_ids` listed among the inputs (genai feeds it only when named),
and `past_present_share_buffer: false` (with true, genai passes a max-length past and Attention-23
rejects the mask length). A graph lowered by `fuselm optimize --target onnxruntime`, whose past
inputs only GroupQueryAttention reads, gets `past_present_share_buffer: true`: GQA takes the
valid length from attention_mask, so past and present can be one max_length buffer (GQA's cos/sin
caches cover the same max_length, the context length). A lowered graph (com.microsoft ops) also runs
with onnxruntime's graph optimizations off (`LOWERED_GRAPH_OPTIMIZATION`): the passes already lowered it,
and onnxruntime's optimizer only folds the tied embedding's Reshape into a second copy of the table
(runtime_metal/engines/ort_prepared.py says what that costs).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from . import contract

NAME = "genai_config.json"
LOWERED_GRAPH_OPTIMIZATION = "ORT_DISABLE_ALL"  # a lowered graph's session option (see above)
# The graph contract (DESIGN.md) in genai's %d form.
_INPUTS = {**{n: n for n in contract.STEP_INPUTS},
           "past_key_names": contract.past_name("%d", "key"), "past_value_names": contract.past_name("%d", "value")}
_OUTPUTS = {contract.LOGITS: contract.LOGITS, "present_key_names": contract.present_name("%d", "key"),
            "present_value_names": contract.present_name("%d", "value")}
_NEEDED = ("layers", "heads", "kv_heads", "head_dim")


def genai_config(meta: dict, graph_inputs: list[str], share_buffer: bool = False, lowered: bool = False) -> dict | None:
    """The config for a model directory's fuselm.json contents and graph input names; None when
    the graph is not a decoder of the contract or the dims genai needs are unknown. `share_buffer`:
    the graph's cache is GroupQueryAttention's (see `shares_buffer`); `lowered`: the graph holds
    onnxruntime contrib ops (`fuselm optimize --target onnxruntime`)."""
    dims = meta.get("dims") or {}
    if any(not dims.get(k) for k in _NEEDED) or contract.INPUT_IDS not in graph_inputs \
            or contract.past_name(0, "key") not in graph_inputs or not _uniform(meta):
        return None
    if any(contract.is_state_past(n) for n in graph_inputs):
        return None  # recurrent states: onnxruntime-genai 0.18's decoder feeds none
    if any(getattr(contract.parse_cache(n), "kind", None) == contract.INDEX for n in graph_inputs):
        return None  # a sparse-attention layer's index cache: genai's decoder feeds keys and values only
    tokens = meta.get("special_tokens") or {}
    eos = tokens.get("eos_token_id")
    eos = eos if eos is not None else tokens.get("pad_token_id")
    first_eos = eos[0] if isinstance(eos, list) and eos else eos
    pad = tokens.get("pad_token_id")
    # A plain .onnx input says nothing of it: genai then stops generating at 4096 tokens.
    context = meta.get("max_position_embeddings") or 4096
    inputs = {k: v for k, v in _INPUTS.items() if k in ("past_key_names", "past_value_names") or v in graph_inputs}
    model = {
        "type": "decoder",
        "context_length": context,
        "vocab_size": dims.get("vocab"),
        "bos_token_id": tokens.get("bos_token_id") if tokens.get("bos_token_id") is not None else first_eos,
        "eos_token_id": eos,
        "pad_token_id": pad if pad is not None else first_eos,
        "decoder": {
            "filename": "model.onnx",
            "session_options": {"log_id": "onnxruntime-genai", "provider_options": [],
                                **({"graph_optimization_level": LOWERED_GRAPH_OPTIMIZATION} if lowered else {})},
            "head_size": dims["head_dim"],
            "hidden_size": dims.get("hidden") or dims["heads"] * dims["head_dim"],
            "num_attention_heads": dims["heads"],
            "num_key_value_heads": dims["kv_heads"],
            "num_hidden_layers": dims["layers"],
            "inputs": inputs,
            "outputs": dict(_OUTPUTS),
        },
    }
    model = {k: v for k, v in model.items() if v is not None}
    search = {"do_sample": False, "num_beams": 1, "num_return_sequences": 1, "max_length": context,
              "min_length": 0, "past_present_share_buffer": share_buffer, "repetition_penalty": 1.0,
              "temperature": 1.0, "top_k": 1, "top_p": 1.0, "length_penalty": 1.0, "early_stopping": True,
              "no_repeat_ngram_size": 0, "diversity_penalty": 0.0}
    return {"model": model, "search": search}


def _uniform(meta: dict) -> bool:
    """Every layer caches its own keys and values, all of one shape: genai's decoder takes one head size and kv head
    count for `past_key_values.%d.*` over every layer (no latent cache, no layer reading another's, one head_dim)."""
    layers = (meta.get("attention") or {}).get("layers") or []
    shapes = {(x.get("cache"), x.get("kv_heads"), x.get("key_dim"), x.get("value_dim")) for x in layers}
    return len(shapes) <= 1 and all(x.get("cache") == "kv" and x.get("key_dim") == x.get("value_dim") for x in layers)


def write_genai_config(model_dir: str | os.PathLike, meta: dict) -> Path | None:
    """Write genai_config.json beside the directory's model.onnx (graph read without weights)."""
    path = Path(model_dir) / contract.MODEL_NAME
    if not path.is_file():
        return None
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    lowered = any(n.domain == "com.microsoft" for n in graph.node)
    config = genai_config(meta, [i.name for i in graph.input], shares_buffer(graph), lowered)
    if config is None:
        return None
    out = Path(model_dir) / NAME
    out.write_text(json.dumps(config, indent=4) + "\n")
    return out


def shares_buffer(graph) -> bool:
    """Whether past and present can share one max_length buffer: every past input is read only by
    com.microsoft GroupQueryAttention (which reads the valid length from seqlens_k, not the past's)."""
    past = {i.name for i in graph.input if contract.is_past(i.name)}
    readers = [n for n in graph.node if past.intersection(n.input)]
    return bool(past) and bool(readers) and all(n.domain == "com.microsoft" and n.op_type == "GroupQueryAttention"
                                                for n in readers)


def meta_from_genai_config(src_dir: str | os.PathLike) -> dict:
    """fuselm.json fields an onnxruntime-genai directory's own genai_config.json gives (context
    length, special tokens, hidden size), for a directory without fuselm.json; {} when none."""
    try:
        model = json.loads((Path(src_dir) / NAME).read_text())["model"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    if not isinstance(model, dict):
        return {}
    out: dict = {}
    if isinstance(model.get("context_length"), int) and model["context_length"] > 0:
        out["max_position_embeddings"] = model["context_length"]
    tokens = {k: model[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
              if isinstance(model.get(k), int | list)}
    if tokens:
        out["special_tokens"] = tokens
    hidden = (model.get("decoder") or {}).get("hidden_size") if isinstance(model.get("decoder"), dict) else None
    if isinstance(hidden, int) and hidden > 0:
        out["dims"] = {"hidden": hidden}
    return out
