"""The traced exporter (`fuselm convert --exporter torch`): transformers' own modeling code, traced.

Order of work (exporter/convert.py writes the result exactly as it writes the builder's graph):
1. skeleton.py: config -> transformers' class for the model_type, parameters on meta; refusals;
   every checkpoint tensor checked against the model's parameters (missing, extra, mis-shaped);
   one probe forward: each layer's rotary frequencies and mask kind.
2. trace.py: one `torch.onnx.export(dynamo=True, opset_version=23)` per distinct layer kind, with
   rope -> `fuselm::FusedRoPE` (rope_op.py) and attention -> `Attention`-23 (attention_op.py);
   one of the model around the layers.
3. stamp.py: the layer templates stamped once per layer into one graph, weights declared through
   the builder's precision plan (streamed from safetensors afterwards, like the builder's).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..quant import Plan
from ..families import IGNORED_SUFFIXES
from ..weights import Checkpoint

__all__ = ["build"]
# The last few traced architectures (config.json -> skeleton and templates): converting one
# checkpoint at several precisions in one process traces it once. Stamping never modifies them.
_TRACED: dict[str, tuple] = {}
_CACHED = 8


def build(hf_dir: Path, config: dict, precisions) -> tuple:
    """(Builder with every weight declared, Checkpoint, fuselm.json fields, label) for `hf_dir`."""
    from .skeleton import Skeleton
    from .stamp import Stamper
    from .trace import layer_kinds, trace_layer, trace_outer

    key = json.dumps(config, sort_keys=True, default=str)
    if key in _TRACED:  # the same architecture again in this process (another --quant): no new trace
        skel, plans, kinds, templates, outer = _TRACED[key]
    else:
        skel = Skeleton(hf_dir, config)
    ckpt = Checkpoint(hf_dir)
    expected = skel.expected_tensors()
    tied = skel.tied_names()
    ckpt.validate(expected, lambda n: n.endswith(IGNORED_SUFFIXES) or n in tied)
    if key not in _TRACED:
        plans = skel.probe()
        kinds = layer_kinds(skel, plans)
        first = {}
        for p in plans:
            first.setdefault(p.kind, p)
        templates = {kind: trace_layer(skel, p) for kind, p in first.items()}
        for p in plans:  # a layer that turned out to skip rope (traced without a FusedRoPE) records none
            p.rope = first[p.kind].rope
        outer = trace_outer(skel)
        while len(_TRACED) >= _CACHED:
            _TRACED.pop(next(iter(_TRACED)))
        _TRACED[key] = (skel, plans, kinds, templates, outer)
    inp = templates[0].graph.input
    kv_shape = tuple(inp[k].type.tensor_type.shape.dim[d].dim_value for k, d in ((3, 1), (3, 3), (4, 3)))
    plan = Plan(*precisions, expected)
    stamper = Stamper(plan, skel.aliases(), skel.layers_name, skel.embed_name(), kv_shape)
    builder = stamper.build(outer, [templates[p.kind] for p in plans], [p.sliding for p in plans],
                            getattr(skel.config, "sliding_window", None))
    return builder, ckpt, skel.metadata(plans, len(kinds), kv_shape), skel.model_type
