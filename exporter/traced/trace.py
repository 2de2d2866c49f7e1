"""Trace one decoder layer per layer kind, and the model around the layers, to ONNX templates.

A layer kind is what makes two layers' graphs differ: the module classes and their settings
(e.g. SmolLM3's `use_rope`), parameter shapes, the rotary frequencies and the mask kind. Each
kind is traced once with `torch.onnx.export(dynamo=True, opset_version=23, optimize=False)` (its
ONNX registry built once per process) on
placeholder weights of the real shapes (uninitialized memory: the trace never reads them):

    layer(hidden [B,S,hidden], mask [B,1,S,T], position_ids [B,S], past_key, past_value, past_conv,
          past_recurrent, *inputs) -> (hidden, present_key, present_value, present_conv, present_recurrent)

with only the pasts and presents the layer uses: the KV cache where it attends, a conv and a recurrent state
where it runs a recurrent-state op (state_ops.py), the mask only where the model gives it one.

The model around the layers (embedding and its scale, final norm, lm_head, logit scaling or
soft-capping) is traced once with every layer replaced by a `fuselm_trace::layer` marker node;
exporter/traced/stamp.py puts the stamped layers in their place.
"""

from __future__ import annotations

import inspect
import logging
import math
import warnings
from collections import UserDict
from dataclasses import dataclass

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import nn

from fuselm import contract
from fuselm.errors import FuselmError

from . import attention_op, block_indexer, moe, rope_op, state_ops
from .skeleton import PROBE_LEN, LayerPlan, Skeleton, StandIn, _layer_output, _named, placeholders, restore

# Every named input and output a layer template may have; a template has those its layer uses (a recurrent layer
# has no mask and no KV cache, a stateless one no past at all), then its other inputs input_0, input_1, ...
LAYER_INPUTS = ["hidden_states", "attention_mask", "position_ids", "past_key", "past_value", "past_index", "past_conv",
                "past_recurrent"]
LAYER_OUTPUTS = ["hidden_out", "present_key", "present_value", "present_index", "present_conv", "present_recurrent",
                 "carried_out"]  # carried_out: what the layer returns beside its hidden state, for a later layer
SLOTS = (*contract.CACHE_KINDS_ALL, *contract.STATE_KINDS)  # past_{slot} -> present_{slot}
GROWING = contract.CACHE_KINDS_ALL  # slots [B, heads, past, dim] that grow by the step's rows
# a layer that reads another layer's keys and values (LayerPlan.share "reuse") also takes that layer's new rows;
# its past_key / past_value are that layer's past
SHARED_INPUTS = ["shared_key", "shared_value"]
# How a layer uses its cache, from its dry run: "kv" (attention appends the new keys/values to the past: cache None
# while traced), "length" (as kv, and the layer reads the cache's length or keeps indexer keys in it: LengthCache),
# "latent" (the layer stores something else and expands it after the cache: multi-head latent attention;
# TraceCache and Attention over whole K/V)
CACHE_MODES = ("kv", "length", "latent")
_SKIPPED_ATTRS = {"layer_idx", "training", "layer_id", "idx"}


@torch.library.custom_op("fuselm_trace::layer", mutates_args=())
def layer_marker(x: torch.Tensor, inputs: list[torch.Tensor], index: int) -> torch.Tensor:
    """Where decoder layer `index` goes in the outer graph, with the other tensors the model hands it (never run)."""
    return x.clone()


@layer_marker.register_fake
def _(x, inputs, index):
    return torch.empty_like(x)


def _marker_translation():
    from onnx.defs import OpSchema
    from onnxscript import values

    def marker(inputs: list):
        schema = OpSchema("Layer", "fuselm_trace", 1, inputs=inputs, outputs=[OpSchema.FormalParameter("Y", "T")],
                          type_constraints=[("T", ["tensor(float)"], "")],
                          attributes=[OpSchema.Attribute("index", OpSchema.AttrType.INT, "")])
        return values.Op(values.Opset("fuselm_trace", 1), "Layer", schema)

    plain = marker([OpSchema.FormalParameter("X", "T")])
    # X and the layer's other inputs as one variadic list (onnxscript binds a leading X twice beside one)
    variadic = marker([OpSchema.FormalParameter("inputs", "T", param_option=OpSchema.FormalParameterOption.Variadic)])

    def to_onnx(x, inputs, index):
        return variadic(x, *inputs, index=int(index)) if inputs else plain(x, index=int(index))

    return {torch.ops.fuselm_trace.layer.default: to_onnx}


@dataclass
class Template:
    """A traced graph: nodes, initializers (parameters have no data), inputs and outputs by name."""

    graph: onnx.GraphProto
    params: dict[str, str]  # initializer name -> parameter name relative to the traced module
    constants: dict[str, onnx.TensorProto]  # non-parameter initializers, with their values


def layer_kinds(skel: Skeleton, plans: list[LayerPlan]) -> dict[tuple, int]:
    """Assign `plan.kind`: layers with the same structure, settings, rotary and mask share one trace."""
    kinds: dict[tuple, int] = {}
    for plan in plans:
        layer = skel.layers[plan.index]
        key = (_structure(layer), plan.rope.key() if plan.rope else None, plan.mask, tuple(sorted(plan.kwargs.items())),
               plan.hidden, tuple(plan.inputs.items()), plan.shares, plan.side, plan.mask_form, plan.mask_arg,
               plan.carried[0] if plan.carried else None, plan.gives)
        plan.kind = kinds.setdefault(key, len(kinds))
    return kinds


def _structure(layer: nn.Module) -> tuple:
    parts = []
    for name, m in layer.named_modules():
        attrs = tuple(sorted((k, v) for k, v in vars(m).items() if not k.startswith("_") and k not in _SKIPPED_ATTRS
                             and isinstance(v, (bool, int, float, str, type(None)))))
        params = tuple((n, tuple(p.shape)) for n, p in m.named_parameters(recurse=False))
        parts.append((name, type(m).__name__, attrs, params))
    return tuple(parts)


class _LayerWrapper(nn.Module):
    """layer(hidden, mask, position_ids, past_key, past_value, past_index, past_conv, past_recurrent, *inputs) ->
    (hidden, present_*), called with the arguments the model gave it in the probe (LayerPlan.kwargs), its other tensor inputs
    (LayerPlan.inputs, LayerPlan.side, then a reuse layer's SHARED_INPUTS), and the cache its mode asks for
    (`cache`: None, a LengthCache, a TraceCache, or in the dry run a ProbeCache). The recurrent-state ops take their
    pasts from state_ops.STATE. `found` (after each run): the slots (SLOTS) it used, the state ops and the states'
    shapes."""

    def __init__(self, layer: nn.Module, rope: rope_op.Installed, plan: LayerPlan, inline_attention: bool,
                 shared_rows=None):
        super().__init__()
        self.layer, self.rope, self.plan, self.inline = layer, rope, plan, inline_attention
        self.cache = None
        self.latent: tuple | None = None  # (Linear, heads, nope, v) of a latent layer's expansion (LatentAttention)
        self.shared_rows = shared_rows or {}  # share key -> (k, v) rows a reuse layer reads in its dry run
        self.shared: _Shared | None = None
        self.found: tuple = ((), {}, {})
        self.given = None  # what the layer returned beside its hidden state in its last run (LayerPlan.gives)

    def forward(self, hidden_states, attention_mask, position_ids, past_key, past_value, past_index, past_conv,
                past_recurrent, *inputs):
        ctx = attention_op.CONTEXT
        dry = isinstance(past_key, str)
        ctx.past = past_key if dry else (past_key, past_value) if past_key is not None else None
        ctx.index_past, ctx.index_present = past_key if dry else past_index, None
        state_ops.STATE.reset({} if dry else {k: v for k, v in zip(contract.STATE_KINDS, (past_conv, past_recurrent),
                                                                      strict=True) if v is not None})
        if self.plan.mask_form == "masked" and attention_mask is not None:  # the layer's own form of the graph's mask
            attention_mask = attention_mask != 0
        ctx.present, ctx.calls, ctx.mask, ctx.read, ctx.positions = None, 0, attention_mask, None, position_ids
        ctx.derived = None
        ctx.latent = (self.latent[0].weight, *self.latent[1:]) if self.latent and self.plan.cache == "latent" else None
        self.rope.positions = position_ids
        cache = attention_op.TraceCache() if self.inline else self.cache
        given = [*self.plan.inputs, *self.plan.side]
        kwargs = {**self.plan.kwargs, self.plan.cache_arg: cache, **dict(zip(given, inputs, strict=False))}
        if self.plan.carried:  # what an earlier layer returned beside its hidden state: the last input
            kwargs[self.plan.carried[0]], inputs = inputs[-1], inputs[:-1]
        if self.plan.shares:
            rows = tuple(inputs[len(given):])
            self.shared = kwargs[self.plan.shares] = _Shared(lambda key: rows or self.shared_rows.get(key))
        # the rope op's marker for cos/sin where the model hands the layer a rotary, else nothing (non-rotary layers)
        pe = position_ids if self.plan.rope is not None and self.plan.rope.complex else (position_ids, position_ids)
        masks = {"attention_mask": None, self.plan.mask_arg: attention_mask}
        out = self.layer(hidden_states, **{**kwargs, **masks}, position_ids=position_ids,
                         position_embeddings=pe if self.plan.rotary else None)
        gives = (out[1] if isinstance(out, tuple) and len(out) > 1 else None,) if self.plan.gives else ()
        out = out[0] if isinstance(out, tuple) else out
        states = state_ops.STATE.presents
        if ctx.present is None and self.plan.masked and not states:  # (a recurrent block handed the mask ignores it)
            raise _NoAttention(f"{type(self.layer).__name__}: the layer neither called its attention function nor "
                               "updated its cache; not supported by the traced exporter")
        kinds = [k for k in contract.STATE_KINDS if k in states]
        index = () if ctx.index_present is None else (ctx.index_present,)
        self.found = ((*(contract.KINDS if ctx.present is not None else ()), *(("index",) if index else ()), *kinds),
                      dict(state_ops.STATE.ops), dict(state_ops.STATE.shapes))
        self.given = gives[0] if gives else None
        return out, *(ctx.present or ()), *index, *(states[k] for k in kinds), *gives


class _Shared(UserDict):
    """The shared keys/values mapping a layer gets while traced (Gemma 3n / 4's `shared_kv_states`): records the key a
    layer stores its rows under, or reads another layer's from (`rows(key)`: the traced layer's inputs)."""

    def __init__(self, rows):
        super().__init__()
        self.rows, self.stored, self.read = rows, None, None

    def __setitem__(self, key, value):
        self.stored = key
        self.data[key] = value

    def __getitem__(self, key):
        if key in self.data:
            return self.data[key]
        self.read = key
        found = self.rows(key)
        if found is None:
            raise FuselmError(f"a decoder layer reads the shared keys/values {key!r} before any layer stored them; "
                              "not supported by the traced exporter")
        return found

    def __contains__(self, key):
        return key in self.data or self.rows(key) is not None


class _NoAttention(FuselmError):
    pass


class _MarkedLayer(StandIn):
    def __init__(self, original: nn.Module, index: int, returns_tuple: int, signature, inputs: list[str]):
        super().__init__(original)
        self.index, self.returns_tuple, self.signature, self.inputs = index, returns_tuple, signature, inputs

    def forward(self, hidden_states, *args, **kwargs):
        named = _named(self.signature, hidden_states, args, kwargs) if self.inputs else {}
        y = torch.ops.fuselm_trace.layer(hidden_states, [named[n] for n in self.inputs], self.index)
        return _layer_output(y, self.returns_tuple)


class _Outer(nn.Module):
    """The causal LM on the graph's inputs: input_ids, and where the model needs them before its layers
    (position tables, ALiBi biases), the graph's attention_mask and position_ids."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        given = {"attention_mask": attention_mask, "position_ids": position_ids}
        return self.lm(input_ids=input_ids, **{k: v for k, v in given.items() if v is not None}, use_cache=False).logits


def _dry_run(skel: Skeleton, wrapper: _LayerWrapper, args: tuple) -> dict[str, tuple]:
    """Run the layer once without past: which pasts it uses (SLOTS) and their shapes past the batch: the cache as
    the layer makes it (kv heads, key and value widths), whatever the config claims (GPT-NeoX ignores
    num_key_value_heads), the recurrent states as their ops ask; and how it uses its cache (`plan.cache`,
    CACHE_MODES; a ProbeCache records it). A layer whose attention is not one Attention op (it computes attention
    itself, calls it twice, has sinks or its own mask) switches to eager attention with its cache update traced
    (`wrapper.inline`). A recurrent-state or feed-forward block (no mask) runs as it is."""
    with torch.no_grad():
        if not wrapper.plan.masked:
            return _shapes(wrapper, wrapper(*args)[1:])
        try:
            if not wrapper.inline:
                mode = _cache_mode(wrapper, args)
                wrapper.plan.cache = mode
                wrapper.latent = _latent_check(wrapper, args) if mode == "latent" else None
                caches = {"kv": lambda: None, "length": attention_op.LengthCache, "latent": attention_op.TraceCache}
                wrapper.cache = caches[mode]()
            return _shapes(wrapper, wrapper(*args)[1:])
        except (_NoAttention, attention_op.NotOneAttention):
            if wrapper.inline:
                raise
        wrapper.inline = skel.inline_attention = True
        wrapper.plan.cache, wrapper.cache = "kv", None
        skel.config._attn_implementation = "eager"  # the modules share the config: all of them go eager
        return _shapes(wrapper, wrapper(*args)[1:])


def _shapes(wrapper: _LayerWrapper, presents) -> dict[str, tuple]:
    """slot -> its present's shape past the batch, for the slots the wrapper's last run used."""
    presents = presents[:len(presents) - wrapper.plan.gives]  # (what it returns for a later layer is no cache)
    return {slot: tuple(int(d) for d in p.shape[1:]) for slot, p in zip(wrapper.found[0], presents, strict=True)}


def _layer_type(plan: LayerPlan, wrapper: _LayerWrapper) -> str:
    """What fuselm.json's `layer_types` says of a layer: its state op and its attention kind, `+`-joined
    (Falcon-H1's parallel Mamba-2 and attention: "mamba2+full_attention"); "feed_forward" for neither."""
    names = {contract.CONV_OP: "short_conv", contract.GDN_OP: "gated_delta_net", contract.MAMBA2_OP: "mamba2",
             contract.MAMBA_OP: "mamba"}
    slots, ops, _ = wrapper.found
    parts = [names[op] for op in names if op in set(ops.values())]
    if len(parts) > 1:
        parts.remove("short_conv")  # the conv in front of a scan is part of that layer kind
    if "index" in slots:  # transformers' name for DeepSeek sparse attention's layers
        parts.append("indexed_attention")
    elif "key" in slots:
        parts.append({"sliding": "sliding_attention", "chunked": "chunked_attention"}.get(plan.mask, "full_attention"))
    return "+".join(parts) or "feed_forward"


def _cache_mode(wrapper: _LayerWrapper, args: tuple) -> str:
    """CACHE_MODES: what the layer did with a ProbeCache. The keys/values it gave attention are the ones it
    stored: kv (length, where it asked for the cache's length); others made from them: latent."""
    probe = wrapper.cache = attention_op.ProbeCache()
    try:
        wrapper(*args)
    except (AttributeError, TypeError):  # a layer that wants more of a cache than these give: as before, no cache
        return "kv"
    finally:
        wrapper.cache = None
    read = attention_op.CONTEXT.read
    if probe.updated is not None and read is not None and (read[0] is not probe.updated[0] or read[1] is not probe.updated[1]):
        return "latent"
    return "length" if probe.asked_length or probe.indexed else "kv"


def _latent_check(wrapper: _LayerWrapper, args: tuple):
    """(Linear, heads, nope, v) when the layer expands its latent cache as fuselm::LatentAttention does: seen in a run
    with random latent rows (LatentProbe) and a random weight for the one Linear that reads them; None otherwise."""
    probe = attention_op.LatentProbe()
    wrapper.cache = probe
    linears = [m for m in wrapper.layer.modules() if isinstance(m, nn.Linear)]

    def watch(module, inputs):
        rows = probe.rows
        x = inputs[0] if inputs else None
        if rows is not None and isinstance(x, torch.Tensor) and x.numel() == rows[0].numel() and \
                x.data_ptr() == rows[0].data_ptr():
            module._fuselm_read_latent = True
            module.weight.normal_()  # a placeholder: known values for the check

    hooks = [m.register_forward_pre_hook(watch) for m in linears]
    try:
        wrapper(*args)
        read = attention_op.CONTEXT.read
        return None if read is None or probe.rows is None else \
            attention_op.latent_expansion(wrapper.layer, *read, *probe.rows)
    except (RuntimeError, AttributeError, TypeError):
        return None
    finally:
        wrapper.cache = None
        for h in hooks:
            h.remove()
        for m in linears:
            m.__dict__.pop("_fuselm_read_latent", None)


def trace_layer(skel: Skeleton, plan: LayerPlan, shared_rows: dict, carried: dict) -> Template:
    """The ONNX template of decoder layer `plan.index` (its kind's representative). `shared_rows`: share key ->
    the (k, v) rows a layer stored there (filled by the layers that store, read by the ones that reuse); `carried`:
    layer kind -> what it returns beside its hidden state, for one token and for the trace's step (filled by the layers
    that give it, read by the ones handed it: LayerPlan.carried)."""
    layer = skel.layers[plan.index]
    cfg = skel.config
    batch, seq, past = 2, 3, 4
    shape = plan.hidden or (1, PROBE_LEN, cfg.hidden_size)  # [..., B, S, ..., hidden]: AltUp's streams lead, HC's follow
    lead = next(i for i in range(len(shape) - 1) if shape[i:i + 2] == (1, PROBE_LEN))  # the batch axis
    hidden = torch.randn(*shape[:lead], batch, seq, *shape[lead + 2:])
    positions = torch.arange(past, past + seq)[None].repeat(batch, 1)
    inputs = [torch.randn(batch, seq, *s[2:]) for s in plan.inputs.values()]
    small = [skel.side_inputs(batch, 1)[plan.index][k] for k in plan.side] if plan.side else []  # the dry run's
    b, s, p, t = (torch.export.Dim(n, min=1) for n in ("batch", "seq", "past", "total"))
    dynamic = {"hidden_states": {lead: b, lead + 1: s}, "attention_mask": {0: b, 2: s, 3: t},
               "position_ids": {0: b, 1: s}, "past_key": {0: b, 2: p}, "past_value": {0: b, 2: p}, "past_index": {0: b, 2: p},
               "past_conv": {0: b}, "past_recurrent": {0: b}, "inputs": [{0: b, 1: s} for _ in inputs]}
    installed = rope_op.Installed(skel.modeling, lambda: installed.positions)
    installed.spec = plan.rope
    handed = carried.get(plan.carried[2]) if plan.carried else None  # (one token's, the step's)
    if plan.carried and handed is None:  # the layer it reads returns nothing beside its hidden state (None)
        plan.carried = None
    undo = placeholders(layer)
    try:
        with installed, moe.installed(layer, getattr(skel, "moe_blocks", [])), state_ops.Installed(skel.modeling), \
                moe.grouped_installed(layer, getattr(skel, "grouped", [])), block_indexer.installed(layer):
            wrapper = _LayerWrapper(layer, installed, plan, skel.inline_attention, shared_rows).eval()
            one = (hidden.narrow(lead + 1, 0, 1), torch.zeros(batch, 1, 1, 1) if plan.masked else None, positions[:, :1], "empty",
                   None, None, None, None, *(x[:, :1] for x in inputs), *small, *(handed[:1] if handed else ()))
            try:
                slots = _dry_run(skel, wrapper, one)
            except RuntimeError as e:  # e.g. a rotary_dim wider than the heads
                raise FuselmError(f"model_type {skel.model_type!r}: decoder layer {plan.index} fails on a one-token input "
                                  f"({str(e).strip().splitlines()[0][:160]}); check config.json's sizes") from None
            plan.index_dim = slots["index"][2] if "index" in slots else 0
            given_one = wrapper.given
            plan.gives = plan.gives and isinstance(given_one, torch.Tensor)  # (a None beside the hidden state: nothing)
            read = attention_op.CONTEXT.read  # the keys attention reads: a latent layer's expanded ones
            plan.attends = (int(read[0].shape[1]), int(read[0].shape[-1])) if read is not None else None
            shared = wrapper.shared
            if shared is not None and shared.stored is not None:
                plan.share = ("store", shared.stored)
                rows = shared.data[shared.stored]
                shared_rows[shared.stored] = tuple(torch.randn(batch, r.shape[1], seq, r.shape[3]) for r in rows)
            elif shared is not None and shared.read is not None:
                plan.share = ("reuse", shared.read)
                rows = shared_rows[shared.read]
                inputs += list(rows)
                dynamic["inputs"] += [{0: b, 2: s}, {0: b, 2: s}]
            shared_rows_in = inputs[len(plan.inputs):]  # a reuse layer's rows come after the side inputs
            inputs, shared_dims = inputs[:len(plan.inputs)], dynamic["inputs"][len(plan.inputs):]
            dynamic["inputs"] = dynamic["inputs"][:len(plan.inputs)]
            given = {"hidden_states": hidden, "attention_mask": torch.zeros(batch, 1, seq, past + seq) if plan.masked else None,
                     "position_ids": positions,
                     **{f"past_{slot}": torch.randn(batch, *((d[0], past, d[2]) if slot in GROWING else d))
                        for slot, d in slots.items()}}
            args = tuple(given.get(n) for n in LAYER_INPUTS)
            fixed = {n: d if given.get(n) is not None else None for n, d in dynamic.items() if n != "inputs"}
            outputs = ["hidden_out", *(f"present_{slot}" for slot in slots), *(["carried_out"] if plan.gives else [])]
            # (its dims free: a layer that ignores it must not take its batch and step sizes from it)
            handed_in, handed_dims = ([handed[1]], ({d: torch.export.Dim.AUTO for d in range(handed[1].dim())},)) \
                if handed else ([], ())
            # a side input's length is the cache's (ALiBi over the keys) or, if that fails, the step's (a query scaling)
            for length, dim in ((past + seq, t), (seq, s))[:2 if plan.side else 1]:
                side, side_dims = _side_examples(skel, plan, batch, length, b, dim)
                extra = [*inputs, *side, *shared_rows_in, *handed_in]
                # (torch.export names the *inputs argument only when it gets some)
                dims = fixed | ({"inputs": (*dynamic["inputs"][:len(plan.inputs)], *side_dims, *shared_dims,
                                            *handed_dims)} if extra else {})
                installed.calls = 0
                names = [n for n in LAYER_INPUTS if given.get(n) is not None] + [f"input_{i}" for i in range(len(extra))]
                try:
                    program = _export(wrapper, (*args, *extra), dims, names, outputs, skel.model_type)
                    break
                except FuselmError:
                    if length == seq or not plan.side:
                        raise
            if plan.gives:  # what a later layer is handed: its example at one token and at the trace's step
                with torch.no_grad():
                    wrapper(*args, *extra)
                carried[plan.kind] = (given_one, wrapper.given)
    finally:
        restore(undo)
    if plan.rope is not None and installed.calls == 0:
        plan.rope = None  # the layer skips rope (SmolLM3's no-rope layers): nothing to carry
    elif plan.rope is not None:
        plan.rope.use(installed.used)
    plan.layer_type = _layer_type(plan, wrapper)
    return _template(program, "layer.")


def drop_unread_last_input(t: Template) -> bool:
    """Remove the template's last input where no node reads it (a layer handed what it ignores); whether it did."""
    last = t.graph.input[-1].name
    if any(last in n.input for n in t.graph.node) or any(o.name == last for o in t.graph.output):
        return False
    del t.graph.input[-1]
    return True


def _side_examples(skel: Skeleton, plan: LayerPlan, batch: int, total: int, b, t) -> tuple[list, tuple]:
    """The layer's side inputs as the model computes them for `total` tokens of `batch` rows (ALiBi's
    [B*H, 1, T]), and their dynamic dims, told apart by computing them again at other sizes: a multiple of the
    batch, the length `t` plus a constant, or fixed."""
    if not plan.side:
        return [], ()
    here = skel.side_inputs(batch, total)[plan.index]
    there = skel.side_inputs(batch + 1, total + 3)[plan.index]
    shapes = []
    for k in plan.side:
        dims = {}
        for d, (n, m) in enumerate(zip(here[k].shape, there[k].shape, strict=True)):
            if n == m:
                continue
            if n % batch == 0 and m == n // batch * (batch + 1):
                dims[d] = b if n == batch else n // batch * b
            elif m - n == 3:
                dims[d] = t if n == total else t + (n - total)
            else:
                dims[d] = torch.export.Dim.AUTO
        shapes.append(dims)
    return [here[k] for k in plan.side], tuple(shapes)


def trace_outer(skel: Skeleton, plans: list[LayerPlan]) -> Template:
    """The model around the layers, layers replaced by `fuselm_trace::Layer` marker nodes (which take the other
    tensors the model computes for each layer). The graph's attention_mask and position_ids go in where the layers
    need what the model computes from them (side inputs; positions outside rotary layers)."""
    originals = list(skel.layers)
    for i in range(len(originals)):
        skel.layers[i] = _MarkedLayer(originals[i], i, skel.returns_tuple, inspect.signature(type(originals[i]).forward),
                                      [*plans[i].inputs, *plans[i].side])
    undo = placeholders(skel.model)
    attention_op.register(masks=False)  # the markers take no mask: do not trace the model's mask code
    implementation = skel.config._attn_implementation
    skel.config._attn_implementation = attention_op.NAME  # (an eager model's too: its mask code is not traced either)
    batch, seq, total = torch.export.Dim("batch", min=1), torch.export.Dim("seq", min=1), torch.export.Dim("total", min=1)
    inputs = {contract.INPUT_IDS: (torch.zeros(2, 3, dtype=torch.long), {0: batch, 1: seq}),
              contract.ATTENTION_MASK: (None, None), contract.POSITION_IDS: (None, None)}
    if any(p.side for p in plans):  # the side inputs cover the whole cache: the model reads the graph's mask
        inputs[contract.ATTENTION_MASK] = (torch.ones(2, 7, dtype=torch.long), {0: batch, 1: total})
    if any(p.rope is None for p in plans):  # positions enter before the layers (tables) or in them
        inputs[contract.POSITION_IDS] = (torch.arange(4, 7)[None].repeat(2, 1), {0: batch, 1: seq})
    try:
        program = _export(_Outer(skel.model).eval(), tuple(x for x, _ in inputs.values()),
                          {k: d for k, (_, d) in inputs.items()}, [k for k, (x, _) in inputs.items() if x is not None],
                          [contract.LOGITS], skel.model_type)
    finally:
        skel.config._attn_implementation = implementation
        attention_op.register()
        restore(undo)
        for i, layer in enumerate(originals):
            skel.layers[i] = layer
    return _template(program, "lm.")


def _erfinv_translation():
    """erfinv in standard ops (ONNX has Erf, not its inverse): Winitzki's closed form (2e-3), then three Newton steps
    on Erf (float32 exact). Gemma 3n's activation sparsity takes the normal quantile of a constant through it."""
    from onnxscript import opset23 as op

    def erfinv(y):
        def c(v):
            return op.CastLike(v, y)

        a = 0.147
        ln = op.Log(op.Sub(c(1.0), op.Mul(y, y)))
        t = op.Add(c(2.0 / (math.pi * a)), op.Mul(ln, c(0.5)))
        x = op.Mul(op.Sign(y), op.Sqrt(op.Sub(op.Sqrt(op.Sub(op.Mul(t, t), op.Div(ln, c(a)))), t)))
        for _ in range(3):
            slope = op.Mul(c(2.0 / math.sqrt(math.pi)), op.Exp(op.Neg(op.Mul(x, x))))
            x = op.Sub(x, op.Div(op.Sub(op.Erf(x), y), slope))
        return x

    return {torch.ops.prims.erf_inv.default: erfinv, torch.ops.aten.erfinv.default: erfinv}


def _export(module, args, dynamic, input_names, output_names, model_type):
    table = {**rope_op.translation(), **attention_op.translation(), **moe.translation(), **state_ops.translation(),
             **_marker_translation(), **_erfinv_translation()}
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            return _onnx_export(module, args, dynamic, input_names, output_names, table)
    except FuselmError:
        raise
    except Exception as e:  # torch.export / translation failures: the modeling code does something we cannot trace
        cause = e
        while cause.__cause__ is not None and not isinstance(cause, FuselmError):
            cause = cause.__cause__
        if isinstance(cause, FuselmError):
            raise cause from None
        raise FuselmError(f"model_type {model_type!r}: tracing transformers' modeling code failed "
                          f"({type(cause).__name__}: {str(cause).strip().splitlines()[0][:200] if str(cause).strip() else ''}); "
                          "this model_type is not supported by the traced exporter") from None


_REGISTRIES: dict[frozenset, object] = {}  # custom ops -> torch.onnx's registry with their translations


def _onnx_export(module, args, dynamic, input_names, output_names, table):
    """`torch.onnx.export(dynamo=True, optimize=False, custom_translation_table=table)`, its ONNX
    registry built once per process: building it from torchlib is about a quarter of each export.
    The same calls as torch.onnx's `export_compat` (torch is pinned); where they moved, torch.onnx.export."""
    try:
        from torch.onnx._internal.exporter import _core, _dynamic_shapes, _registration
    except ImportError:
        _core = None
    if _core is None or not hasattr(_registration.ONNXRegistry, "from_torchlib"):
        return torch.onnx.export(module, args, dynamo=True, opset_version=contract.OPSET, optimize=False, verbose=False,
                                 dynamic_shapes=dynamic, input_names=input_names, output_names=output_names,
                                 custom_translation_table=table, report=False)
    registry = _REGISTRIES.get(frozenset(table))
    if registry is None:
        # (it logs a warning per torchvision op when torchvision is missing: none of them is ours to trace)
        quiet = logging.getLogger(_registration.__name__)
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # (setLevel, not .level: it also clears the logger's cached isEnabledFor)
        try:
            registry = _registration.ONNXRegistry.from_torchlib(opset_version=contract.OPSET)
        finally:
            quiet.setLevel(level)
        for op, function in table.items():
            registry.register_op(op, function, is_complex=False)
        registry = _REGISTRIES.setdefault(frozenset(table), registry)
    shapes, rename_axes = _dynamic_shapes.convert_str_to_export_dim(dynamic)
    program = _core.export(module, args, None, registry=registry, dynamic_shapes=shapes, input_names=input_names,
                           output_names=output_names, report=False, verbose=False, optimize=False,
                           opset_version=contract.OPSET)
    if rename_axes:  # the dims named as the Dim objects are
        program._rename_dynamic_axes(dynamic)
    return program


def _template(program, prefix: str) -> Template:
    """onnx_ir model -> GraphProto without parameter bytes; parameters by their module-relative names."""
    import onnx_ir as ir

    graph = program.model.graph
    params, constants = {}, {}
    state = set(program.exported_program.state_dict) if program.exported_program is not None else set()
    shapes = {name: list(value.shape) for name, value in graph.initializers.items() if value.shape is not None}
    for name, value in list(graph.initializers.items()):
        if name in state and isinstance(program.exported_program.state_dict[name], nn.Parameter):
            params[name] = name.removeprefix(prefix)  # the bytes come from the checkpoint, never from here
        else:
            constants[name] = ir.serde.serialize_tensor(value.const_value)
        graph.initializers.pop(name)
    proto = ir.serde.serialize_graph(graph)
    _simplify(proto, shapes)
    return Template(proto, params, constants)


def _simplify(graph: onnx.GraphProto, shapes: dict[str, list] | None = None) -> None:
    """Cancel Transpose pairs that compose to the identity (HF's [B,H,S,D] transpose meeting the
    rope op's [B,S,H,D] one), turn `chunk` (SplitToSequence + SequenceAt) into Split, then drop
    nodes no output depends on. `shapes`: those of the initializers the template no longer holds (parameters)."""
    _sequence_to_split(graph, shapes or {})
    producer = {o: n for n in graph.node for o in n.output}
    replace: dict[str, str] = {}
    for n in graph.node:
        src = producer.get(n.input[0]) if n.op_type == "Transpose" and n.input else None
        if src is not None and src.op_type == "Transpose":
            p1, p2 = _attr(src, "perm", None), _attr(n, "perm", None)
            if p1 and p2 and len(p1) == len(p2) and [p1[i] for i in p2] == list(range(len(p1))):
                replace[n.output[0]] = replace.get(src.input[0], src.input[0])
    graph_outputs = {o.name for o in graph.output}
    for n in graph.node:
        for k, inp in enumerate(n.input):
            if inp in replace:
                n.input[k] = replace[inp]
    live, keep = {o.name for o in graph.output}, []
    for n in reversed(graph.node):
        if any(o in live for o in n.output) and not all(o in replace and o not in graph_outputs for o in n.output):
            keep.append(n)
            live.update(i for i in n.input if i)
    del graph.node[:]
    graph.node.extend(reversed(keep))


def _sequence_to_split(graph: onnx.GraphProto, known: dict[str, list]) -> None:
    """SplitToSequence(x, chunk c, axis) read only by SequenceAt(const i) -> Split(x, [c]*n) with
    outputs i (torch's `chunk` at optimize=False; needs x's axis length static in the trace), and
    SplitToSequence(x, sizes [n], axis) -> Split(x, sizes) (torch's `split` with sizes: MLA's nope / rope parts)."""
    consts = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in graph.node
              if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"}
    shapes = {**known, **{v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
                          for v in (*graph.input, *graph.value_info)}}
    users: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            users.setdefault(i, []).append(n)
    for n in list(graph.node):
        if n.op_type != "SplitToSequence" or len(n.input) != 2 or n.input[1] not in consts:
            continue
        axis = next((a.i for a in n.attribute if a.name == "axis"), 0)
        shape, chunk = shapes.get(n.input[0]), consts[n.input[1]]
        seq_users = users.get(n.output[0], [])
        if not all(u.op_type == "SequenceAt" and u.input[1] in consts for u in seq_users):
            continue
        if chunk.ndim == 1:
            split = chunk.astype(np.int64)
        elif chunk.ndim == 0 and shape is not None and shape[axis] and not shape[axis] % int(chunk):
            split = np.full(shape[axis] // int(chunk), int(chunk), np.int64)
        else:
            continue
        parts = len(split)
        outputs = [f"{n.output[0]}_split_{k}" for k in range(parts)]
        sizes = f"{n.output[0]}_split_sizes"
        at = list(graph.node).index(n)
        graph.node.insert(at, onnx.helper.make_node("Constant", [], [sizes], name=f"{n.name}_sizes",
                          value=numpy_helper.from_array(split)))
        graph.node.insert(at + 1, onnx.helper.make_node("Split", [n.input[0], sizes], outputs, name=f"{n.name}_split",
                                                        axis=axis))
        for u in seq_users:
            u.CopyFrom(onnx.helper.make_node("Identity", [outputs[int(consts[u.input[1]]) % parts]], [u.output[0]],
                                             name=u.name))


def _attr(node: onnx.NodeProto, name: str, default):
    a = next((a for a in node.attribute if a.name == name), None)
    return onnx.helper.get_attribute_value(a) if a is not None else default
