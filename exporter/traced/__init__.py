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

import contextlib
import json
from pathlib import Path

from fuselm.errors import FuselmError, Unsupported

from ..families import IGNORED_SUFFIXES
from ..graph import Export
from ..quant import Plan
from ..weights import Checkpoint
from . import moe

__all__ = ["build"]
# The last few traced architectures (config.json -> skeleton and templates): converting one
# checkpoint at several precisions in one process traces it once. Stamping never modifies them.
_TRACED: dict[str, tuple] = {}
_CACHED = 8


def build(hf_dir: Path, config: dict, precisions) -> Export:
    """The traced graph for `hf_dir` (transformers' modeling code for its model_type), weights declared."""
    from .skeleton import Skeleton
    from .stamp import Stamper

    key = json.dumps(config, sort_keys=True, default=str)
    if key in _TRACED:  # the same architecture again in this process (another --quant): no new trace
        skel, plans, kinds, templates, outer = _TRACED[key]
    else:
        with _unsupported():
            skel = Skeleton(hf_dir, config)
            plans = skel.probe()  # the architecture's refusals come before the checkpoint's
    ckpt = Checkpoint(hf_dir)
    ckpt.rename(skel.model_name)
    ckpt = moe.stack_experts(ckpt, skel, skel.moe_blocks)  # per-expert tensors -> the model's stacked parameters
    expected = skel.expected_tensors()
    tied = skel.tied_names()
    ckpt.validate(expected, lambda n: n.endswith(IGNORED_SUFFIXES) or n in tied)
    if key not in _TRACED:
        with _unsupported():
            kinds, templates, outer = _trace(skel, plans)
        while len(_TRACED) >= _CACHED:
            _TRACED.pop(next(iter(_TRACED)))
        _TRACED[key] = (skel, plans, kinds, templates, outer)
    inp = templates[0].graph.input
    kv_shape = tuple(inp[k].type.tensor_type.shape.dim[d].dim_value for k, d in ((3, 1), (3, 3), (4, 3)))
    plan = Plan(*precisions, expected)
    stamper = Stamper(plan, skel.aliases(), skel.layers_name, skel.embed_name(), skel.head_name(), kv_shape)
    with _unsupported():
        builder = stamper.build(outer, [templates[p.kind] for p in plans], [p.sliding for p in plans],
                                getattr(skel.config, "sliding_window", None))
    meta = skel.metadata(plans, len(kinds), kv_shape)
    if skel.moe_blocks:
        meta["moe"] = moe.metadata(skel.moe_blocks)
    return Export(builder, ckpt, meta, skel.model_type)


def _trace(skel, plans) -> tuple:
    from .trace import layer_kinds, trace_layer, trace_outer

    kinds = layer_kinds(skel, plans)
    first = {}
    for p in plans:
        first.setdefault(p.kind, p)
    templates = {kind: trace_layer(skel, p) for kind, p in first.items()}
    for p in plans:  # a layer that turned out to skip rope (traced without a FusedRoPE) records none
        p.rope = first[p.kind].rope
    return kinds, templates, trace_outer(skel)


@contextlib.contextmanager
def _unsupported():
    """A refusal while reading the architecture is an Unsupported (convert --exporter auto adds the
    builder's families to its message); checkpoint and config errors stay what they are."""
    try:
        yield
    except Unsupported:
        raise
    except FuselmError as e:
        raise Unsupported(str(e)) from None
