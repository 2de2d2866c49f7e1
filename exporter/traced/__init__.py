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
Steps 1-2 depend on config.json only: cache.py keeps what they found on disk, so a later convert of
the same architecture goes straight to step 3.
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

from fuselm.errors import FuselmError, Unsupported

from ..families import IGNORED_SUFFIXES
from ..graph import Export
from ..quant import Plan
from ..weights import Checkpoint
from . import converters, moe

__all__ = ["build"]
# The last few traced architectures (cache key -> cache.Traced): converting one checkpoint at several
# precisions in one process traces it once (on disk too: cache.py). Stamping never modifies them.
_TRACED: dict[str, object] = {}
_CACHED = 8


def build(hf_dir: Path, config: dict, precisions) -> Export:
    """The traced graph for `hf_dir` (transformers' modeling code for its model_type), weights declared."""
    from . import cache
    from .stamp import Stamper

    key = cache.key(config)
    traced = _TRACED.get(key) or cache.load(key)
    ckpt = Checkpoint(hf_dir) if traced is not None else None
    if traced is None or not set(ckpt.tensors) <= set(traced.names):  # a name the entry has not seen: trace
        traced, ckpt = _traced(hf_dir, config)
        cache.store(key, traced)
    else:
        ckpt.rename(traced.names.__getitem__)
        ckpt.convert(traced.views)
        ckpt = converters.concatenated(moe.cached_stacks(ckpt, traced.stacks), traced.concats)
        ckpt.validate(traced.expected, lambda n: n.endswith(IGNORED_SUFFIXES) or n in traced.tied)
    while len(_TRACED) >= _CACHED and key not in _TRACED:
        _TRACED.pop(next(iter(_TRACED)))
    _TRACED[key] = traced
    plan = Plan(*precisions, traced.expected)
    stamper = Stamper(plan, traced.aliases, traced.layers_name, traced.embed_name, traced.head_name)
    with _unsupported(traced.model_type):
        builder = stamper.build(traced.outer, [traced.templates[k] for k in traced.kinds], traced.masks,
                                {"sliding": traced.window, "chunked": traced.chunk}, traced.sources, traced.carried)
    return Export(builder, ckpt, copy.deepcopy(traced.meta), traced.model_type)  # the cached one stays as traced


def _traced(hf_dir: Path, config: dict):
    """Skeleton, probe, checkpoint check, then one trace per layer kind and one of the model around them."""
    from .cache import Traced, kv_shape
    from .skeleton import Skeleton
    from .trace import drop_unread_last_input, layer_kinds, trace_layer, trace_outer

    model_type = config.get("model_type")
    with _unsupported(model_type):
        skel = Skeleton(hf_dir, config)
        plans = skel.probe()  # the architecture's refusals come before the checkpoint's
    with _unsupported(model_type, refusals=False):
        ckpt = Checkpoint(hf_dir)
        names = {stored: skel.model_name(stored) for stored in ckpt.tensors}
        ckpt.rename(names.__getitem__)
        views, unapplied = skel.conversions(ckpt.tensors)
        ckpt.convert(views)  # tensors transformers converts as it loads them (transposed, split)
        ckpt = moe.stack_experts(ckpt, skel, skel.moe_blocks, skel.dense_experts)  # per-expert tensors -> stacks
        concats = converters.concatenations(ckpt, skel.model)  # stored parts -> one parameter (OLMo-Hybrid's convs)
        ckpt = converters.concatenated(ckpt, concats)
        expected = {**skel.expected_tensors(), **moe.stacked_shapes(ckpt)}  # relaid-out experts: the op's shapes
        tied = skel.tied_names()
        try:
            ckpt.validate(expected, lambda n: n.endswith(IGNORED_SUFFIXES) or n in tied)
        except FuselmError:
            if unapplied:  # the names differ because transformers converts them
                raise Unsupported(f"model_type {model_type!r}: transformers converts checkpoint tensors as it loads "
                                  f"them in a way fuselm's checkpoint reader does not ({unapplied}); not supported by "
                                  "the traced exporter") from None
            raise
    with _unsupported(model_type):
        kinds = layer_kinds(skel, plans)
        first = {}
        for p in plans:
            first.setdefault(p.kind, p)
        for p in plans:  # a layer handed what an earlier layer returned: that layer's kind
            if p.carried:
                p.carried = (*p.carried[:2], plans[p.carried[1]].kind)
        # kinds in order of first use: a layer that stores shared keys/values (or returns what a later one is handed)
        # comes first
        shared_rows, carried = {}, {}
        templates = [trace_layer(skel, first[kind], shared_rows, carried) for kind in range(len(kinds))]
        unread = {kind for kind, t in enumerate(templates) if first[kind].carried and drop_unread_last_input(t)}
        for p in plans:  # handed what it never reads (GLM-DSA's full layers get the previous layer's top-k too), or None
            if p.carried and (p.kind in unread or first[p.kind].carried is None):
                p.carried = None
        for p in plans:  # what the kind's trace found: a layer that skips rope records none; its cache mode
            p.rope, p.cache, p.share, p.attends, p.layer_type, p.index_dim = (
                getattr(first[p.kind], f) for f in ("rope", "cache", "share", "attends", "layer_type", "index_dim"))
        _kv_sources(plans, skel.model_type)
        outer = trace_outer(skel, plans)
    traced = Traced(templates, outer, [p.kind for p in plans], [p.mask for p in plans],
                    getattr(skel.config, "sliding_window", None), getattr(skel.config, "attention_chunk_size", None),
                    skel.model_type, skel.layers_name, skel.embed_name(), skel.head_name(), expected, sorted(tied),
                    skel.aliases(), names, {}, getattr(ckpt, "stacks", {}), [p.kv_source for p in plans], views,
                    concats, [p.carried[1] if p.carried else None for p in plans])
    meta = skel.metadata(plans, len(kinds), [kv_shape(templates[p.kind]) for p in plans])
    if skel.moe_blocks:
        meta["moe"] = moe.metadata(skel.moe_blocks)
    traced.meta = json.loads(json.dumps(meta))  # as the cache keeps it
    return traced, ckpt


def _kv_sources(plans, model_type: str) -> None:
    """A layer that reuses shared keys/values reads those of the last layer before it that stored them."""
    stored: dict = {}
    for p in plans:
        role, key = p.share or (None, None)
        if role == "store":
            stored[key] = p.index
        elif role == "reuse":
            if key not in stored:
                raise FuselmError(f"model_type {model_type!r}: decoder layer {p.index} reads the keys/values of "
                                  f"{key!r} before any layer stored them; not supported by the traced exporter")
            p.kv_source = stored[key]


class TraceFailed(Unsupported):
    """transformers' modeling code failed on what the traced exporter fed it, in a way no refusal foresaw: a
    clean error for the user (exit 2), told apart by scripts/traced_sweep.py as one to look into."""


@contextlib.contextmanager
def _unsupported(model_type: str | None = None, refusals: bool = True):
    """A refusal while reading the architecture is an Unsupported (convert --exporter auto adds the
    builder's families to its message; `refusals` False: checkpoint errors stay what they are); any
    other exception is a TraceFailed that names it."""
    try:
        yield
    except Unsupported:
        raise
    except FuselmError as e:
        if not refusals:
            raise
        raise Unsupported(str(e)) from None
    except (MemoryError, RecursionError):
        raise
    except Exception as e:  # noqa: BLE001 - the modeling code's own errors: no traceback for the user
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise TraceFailed(f"model_type {model_type!r}: the traced exporter failed while reading transformers' model "
                          f"({type(e).__name__}: {first}); this model_type is not supported by the traced "
                          "exporter") from None
