"""The builder exporter (`fuselm convert --exporter builder`): the graph written op by op.

`build(hf_dir, config, precisions)` is one of the two implementations of the exporter entry point
(the other is exporter/traced/): config.json -> family -> tensor check -> the whole graph with every
weight declared (not read). exporter/convert.py writes the result.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from fuselm import contract

from ..graph import Builder, Dims, Export, Layer, attention_mask, graph_inputs, rms_norm
from ..quant import Plan
from ..rope import Rope, rope_inputs
from ..weights import Checkpoint
from . import IGNORED_SUFFIXES, expected_tensors, family_for, hf_name


def build(hf_dir: Path, config: dict, precisions) -> Export:
    """The builder's graph for `hf_dir` (a family in exporter/families/), weights declared."""
    family_name, family = family_for(config)
    cfg = family.Config.from_dict(config)
    ckpt = Checkpoint(hf_dir)
    ckpt.check_bounds(cfg)  # nothing is sized by config.json before this
    rope = rope_inputs(config, cfg.head_dim)
    expected = expected_tensors(family, cfg)
    ckpt.validate(expected, lambda n: n.endswith(IGNORED_SUFFIXES) or (cfg.tie_word_embeddings and n == hf_name("lm_head")))
    builder = build_graph(family, cfg, rope, Plan(*precisions, expected))
    return Export(builder, ckpt, metadata(config, family_name, cfg, rope), family_name)


def build_graph(family, cfg, rope: Rope, plan: Plan) -> Builder:
    """The full graph (weights declared, not read): embedding, mask, N decoder layers, norm, head."""
    b = Builder()
    ids, mask_in, position_ids = graph_inputs(b)
    x = plan.embedding(b, hf_name("embed"), ids)
    mask = attention_mask(b, ids, mask_in, getattr(cfg, "sliding_window", None))
    dims = Dims(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps)
    for i in range(cfg.num_hidden_layers):
        layer = Layer(b, i, dims, plan, lambda c, i=i: hf_name(c, i), position_ids, mask, rope)
        x = family.decoder_layer(layer, x, cfg)
    x = rms_norm(b, x, plan.vector(b, hf_name("final_norm"), None), cfg.rms_norm_eps, "/model/norm")
    plan.logits(b, x, hf_name("embed"), None if cfg.tie_word_embeddings else hf_name("lm_head"))
    b.outputs.insert(0, onnx.helper.make_tensor_value_info(
        contract.LOGITS, onnx.TensorProto.FLOAT, ["batch_size", "sequence_length", cfg.vocab_size]))
    return b


def metadata(config: dict, family_name: str, cfg, rope: Rope) -> dict:
    """The builder's model fields of fuselm.json (schema in exporter/README.md)."""
    return {
        "family": family_name,
        "model_type": cfg.model_type,
        "architecture": (config.get("architectures") or [None])[0],
        "dims": {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads,
                 "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
                 "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size},
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "sliding_window": getattr(cfg, "sliding_window", None),
        "rope": {"theta": rope.theta, "type": rope.rope_type, "scaling": rope.parameters,
                 "rotary_dim": rope.rotary_dim, "inv_freq_len": len(rope.inv_freq),
                 "attention_scaling": rope.attention_scaling, "interleaved": 0},
    }
