"""The graph contract (DESIGN.md "Graph contract (v1)"): the one home of what every part agrees on.

The model directory's file names, the graph's input and output names, the KV cache names and their
parsing, the default-domain opset, the `fuselm` domain and its ops `FusedRoPE` and `SwiGLU` (name,
attributes, schema, node, model-local function body per form), and the feeds one step of a contract
graph takes. The
exporter writes the contract, the passes keep it, the runtime and the reference runs read it; no
other module spells these names.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field

import numpy as np

from .errors import FuselmError


class _Lazy:
    """A module (or one of its attributes) imported on first use: the names and cache parsing below are all
    a run on onnxruntime's prepared copy reads, and importing onnx costs a fresh process a large share of its
    first-token time (bench/first_token.py)."""

    def __init__(self, module: str, attr: str | None = None):
        self._where = (module, attr)

    def __getattr__(self, name: str):
        module, attr = self._where
        target = importlib.import_module(module)
        return getattr(getattr(target, attr) if attr else target, name)


onnx = _Lazy("onnx")
oh = _Lazy("onnx.helper")
TensorProto = _Lazy("onnx", "TensorProto")

# --- the model directory -----------------------------------------------------------------------
MODEL_NAME = "model.onnx"
DATA_NAME = "model.onnx.data"
META_NAME = "fuselm.json"
SPLIT_NAME = "split.json"  # `fuselm split`'s output: its stages and how they connect

# --- versions ------------------------------------------------------------------------------------
OPSET = 23  # default domain, every graph fuselm writes
DOMAIN = "fuselm"
DOMAIN_VERSION = 1
# `--target onnxruntime`: MatMulNBits' default accuracy_level, as onnxruntime-genai's builder writes CPU int4
# (4: int8 activations); also in the key of the copy `--backend auto` lowers (runtime_metal/engines/ort_prepared.py)
ORT_ACCURACY_LEVEL = 4

# --- inputs and outputs --------------------------------------------------------------------------
INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
STEP_INPUTS = (INPUT_IDS, ATTENTION_MASK, POSITION_IDS)  # int64 [batch, seq] (the mask: [batch, past + seq])
LOGITS = "logits"
LOGITS_TO_KEEP = "logits_to_keep"  # optional int64 [1]: logits of the last N positions only (passes/last_logits.py)
PAST = "past_key_values"  # past_key_values.{i}.key / .value  float [batch, kv_heads, past, head_dim]
PRESENT = "present"  # present.{i}.key / .value        float [batch, kv_heads, past + seq, head_dim]
KINDS = ("key", "value")
# a sparse-attention layer's third cache tensor: its indexer's keys, past_key_values.{i}.index [batch, 1, past, index_dim]
INDEX = "index"
CACHE_KINDS_ALL = (*KINDS, INDEX)
# pipeline stages (`fuselm split`): stage k > 0 takes the residual stream instead of input_ids, and
# every stage but the last returns it instead of logits; float [batch, seq, hidden]
HIDDEN = "hidden_states"
NEXT_HIDDEN = "hidden_states_out"
NAMES_TEXT = (f"inputs {', '.join(STEP_INPUTS)}, {PAST}.{{i}}.key/.value and outputs {LOGITS}, "
              f"{PRESENT}.{{i}}.key/.value")

_CACHE = re.compile(rf"^({PAST}|{PRESENT})\.(\d+)\.({'|'.join(CACHE_KINDS_ALL)})$")


@dataclass(frozen=True)
class CarriedName:
    """One parsed name of a tensor carried from step to step: role 'past' or 'present', its layer and kind (a cache's
    'key' / 'value', a state's 'conv' / 'recurrent'); `prefixes` the (past, present) names of its family."""

    role: str
    layer: int
    kind: str
    prefixes: tuple[str, str]

    @property
    def past(self) -> str:
        return f"{self.prefixes[0]}.{self.layer}.{self.kind}"

    @property
    def present(self) -> str:
        return f"{self.prefixes[1]}.{self.layer}.{self.kind}"


def past_name(layer: int, kind: str) -> str:
    return f"{PAST}.{layer}.{kind}"


def present_name(layer: int, kind: str) -> str:
    return f"{PRESENT}.{layer}.{kind}"


def cache_names(layers: int, role: str = PAST) -> list[str]:
    """[k0, v0, k1, v1, ...] names of `layers` layers' past (or present) tensors."""
    name = past_name if role == PAST else present_name
    return [name(i, kind) for i in range(layers) for kind in KINDS]


def parse_cache(name: str | None) -> CarriedName | None:
    """The parts of a `past_key_values.{i}.{key,value,index}` or `present.{i}.{...}` name; None otherwise."""
    m = _CACHE.match(name or "")
    if not m:
        return None
    return CarriedName("past" if m.group(1) == PAST else "present", int(m.group(2)), m.group(3), (PAST, PRESENT))


def is_past(name: str | None) -> bool:
    c = parse_cache(name)
    return c is not None and c.role == "past"


def is_present(name: str | None) -> bool:
    c = parse_cache(name)
    return c is not None and c.role == "present"


def present_of(past: str) -> str:
    """The output a past input comes back as (past_key_values.3.key -> present.3.key)."""
    c = parse_cache(past)
    if c is None or c.role != "past":
        raise ValueError(f"{past!r} is not a {PAST}.{{i}}.{{key,value,index}} name")
    return c.present


def cache_order(name: str) -> tuple:
    """Sort key: caches by layer then key, value, index; other names first."""
    c = parse_cache(name)
    return (c.layer, CACHE_KINDS_ALL.index(c.kind)) if c else (-1, name)


# --- attention variants, per layer ---------------------------------------------------------------
ATTENTION_META = "fuselm.attention"  # the graph's metadata_props key of fuselm.json's `attention` block (JSON)
MASK_KINDS = ("causal", "sliding", "chunked", "none")
CACHE_KINDS = ("kv", "latent", "shared", "none")  # none (and mask none): a layer that does not attend


def attention_meta(layers: list[dict], sliding_window: int | None = None, chunk_size: int | None = None) -> dict:
    """fuselm.json's `attention` block, also the graph's metadata_props[ATTENTION_META] as JSON: per layer its mask
    (MASK_KINDS: causal; sliding: the last `sliding_window` cache indices; chunked: causal within its block of
    `chunk_size` indices), its cache (CACHE_KINDS: kv, its keys and values; latent, multi-head latent attention's
    compressed latent as `.key` and rotary key as `.value`; shared, it reads layer `kv_source`'s and has none) and
    that cache's kv_heads, key_dim and value_dim; mask and cache `none` for a layer that does not attend (a
    recurrent-state or feed-forward block). A sparse-attention layer also has `index_dim` (its indexer's keys,
    the third cache tensor `.index`) and `index_topk` (the keys each query may attend to at most); a layer handed a
    tensor layer j computes (a sparse-attention layer reusing layer j's top-k selection) has `reads_layer` j."""
    for layer in layers:
        if layer["mask"] not in MASK_KINDS or layer["cache"] not in CACHE_KINDS:
            raise FuselmError(f"attention layer {layer}: mask must be one of {MASK_KINDS}, cache one of {CACHE_KINDS}")
    return {"layers": layers, "sliding_window": sliding_window, "chunk_size": chunk_size}


def kv_sources(metadata_props: dict[str, str], key: str = "kv_source") -> dict[int, int]:
    """Layer -> the layer whose keys and values it reads (KV sharing), from a graph's metadata_props; {} without.
    `key` "reads_layer": the layer whose tensor it is handed (attention_meta)."""
    import json

    try:
        layers = json.loads(metadata_props.get(ATTENTION_META, "{}")).get("layers") or []
        return {i: int(x[key]) for i, x in enumerate(layers) if x.get(key) is not None}
    except (ValueError, TypeError, AttributeError, KeyError):
        raise FuselmError(f"the graph's metadata {ATTENTION_META} is not fuselm's attention block; re-export with "
                          "`fuselm convert`") from None


# --- recurrent state (linear attention, state-space and short-convolution layers) -----------------
# A layer whose memory is a fixed-size state carries it as past_state.{i}.{kind} -> present_state.{i}.{kind}
# (i: the decoder layer), beside the KV cache: float, no axis that grows, replaced whole at every step.
# "conv": the last K-1 inputs of a causal depthwise convolution, [batch, K-1, channels] (channels last: a step
# appends rows); "recurrent": the scan's state as the layer's op defines it (GatedDeltaNet [batch, v_heads, v_dim,
# k_dim], Mamba2 [batch, heads, head_dim, state], Mamba [batch, channels, state]: mlx-lm's layouts). Named apart
# from past_key_values, so tools that read every past_key_values.* input as a growing KV cache (optimum,
# onnxruntime-genai) never take a state for one.
STATE_PAST = "past_state"
STATE_PRESENT = "present_state"
STATE_KINDS = ("conv", "recurrent")
_STATE = re.compile(rf"^({STATE_PAST}|{STATE_PRESENT})\.(\d+)\.(conv|recurrent)$")


def state_name(layer: int, kind: str, role: str = STATE_PAST) -> str:
    return f"{role}.{layer}.{kind}"


def parse_state(name: str | None) -> CarriedName | None:
    """The parts of a `past_state.{i}.{conv,recurrent}` or `present_state.{i}.{...}` name; None otherwise."""
    m = _STATE.match(name or "")
    if not m:
        return None
    return CarriedName("past" if m.group(1) == STATE_PAST else "present", int(m.group(2)), m.group(3),
                       (STATE_PAST, STATE_PRESENT))


def is_state_past(name: str | None) -> bool:
    s = parse_state(name)
    return s is not None and s.role == "past"


def is_state_present(name: str | None) -> bool:
    s = parse_state(name)
    return s is not None and s.role == "present"


def is_step_past(name: str | None) -> bool:
    """A graph input a step feeds back from the previous step's outputs: a KV cache or a recurrent state."""
    return is_past(name) or is_state_past(name)


def is_step_present(name: str | None) -> bool:
    """A graph output the next step feeds back: a KV cache's or a recurrent state's present."""
    return is_present(name) or is_state_present(name)


def step_present_of(past: str) -> str:
    """The output a KV cache or state input comes back as (past_state.2.conv -> present_state.2.conv)."""
    s = parse_state(past)
    return s.present if s is not None and s.role == "past" else present_of(past)


def step_order(name: str) -> tuple:
    """Sort key of the step's fed-back inputs: by layer, KV (key, value) before state (conv, recurrent)."""
    c, s = parse_cache(name), parse_state(name)
    if c is not None:
        return (c.layer, 0, CACHE_KINDS_ALL.index(c.kind))
    return (s.layer, 1, s.kind) if s is not None else (-1, 0, name)


def layer_of(name: str | None) -> int | None:
    """The decoder layer a KV cache or state name belongs to (None for any other name)."""
    c = parse_cache(name) or parse_state(name)
    return c.layer if c is not None else None


# --- fuselm::FusedRoPE ---------------------------------------------------------------------------
ROPE_OP = "FusedRoPE"
RMS_EPSILON = 1e-5  # FusedRoPE's `epsilon` default: RMSNormalization's


@dataclass(frozen=True)
class RopeForm:
    """Which FusedRoPE body a graph needs: its rotary layout, whether any node takes x as
    [B, S, H·D] (`num_heads` > 0), and whether its nodes normalize each head first (a third input)."""

    interleaved: bool = False
    heads: bool = False
    normed: bool = False


def fused_rope_node(x: str, position_ids: str, y: str, name: str, inv_freq, attention_scaling: float = 1.0,
                    interleaved: int = 0, num_heads: int = 0, norm_weight: str | None = None,
                    epsilon: float = RMS_EPSILON) -> onnx.NodeProto:
    """One `fuselm::FusedRoPE` node: x [B,S,H,D] (or [B,S,H·D] with num_heads=H), position_ids [B,S] -> y
    shaped as x; with `norm_weight` [D], each head is RMS-normalized (epsilon) and scaled first."""
    attrs = {"inv_freq": [float(v) for v in inv_freq], "attention_scaling": float(attention_scaling),
             "interleaved": int(interleaved)}
    if num_heads:
        attrs["num_heads"] = int(num_heads)
    if norm_weight is not None:
        attrs["epsilon"] = float(epsilon)
    return oh.make_node(ROPE_OP, [x, position_ids, *([norm_weight] if norm_weight is not None else [])], [y],
                        name=name, domain=DOMAIN, **attrs)


def rope_schema(extended: bool = True):
    """FusedRoPE's OpSchema (onnxscript needs one to emit a node of a custom domain). extended=False: the
    plain form alone (x [B,S,H,D], no norm weight), for an emitter such as onnxscript that writes every
    attribute the schema declares onto the node with its default."""
    from onnx.defs import OpSchema

    inputs = [OpSchema.FormalParameter("X", "T"), OpSchema.FormalParameter("position_ids", "tensor(int64)")]
    attributes = [OpSchema.Attribute("inv_freq", OpSchema.AttrType.FLOATS, ""),
                  OpSchema.Attribute("attention_scaling", oh.make_attribute("attention_scaling", 1.0), ""),
                  OpSchema.Attribute("interleaved", oh.make_attribute("interleaved", 0), "")]
    if extended:
        inputs.append(OpSchema.FormalParameter("norm_weight", "T", param_option=OpSchema.FormalParameterOption.Optional))
        attributes += [OpSchema.Attribute("num_heads", oh.make_attribute("num_heads", 0), ""),
                       OpSchema.Attribute("epsilon", oh.make_attribute("epsilon", RMS_EPSILON), "")]
    return OpSchema(ROPE_OP, DOMAIN, DOMAIN_VERSION, inputs=inputs, outputs=[OpSchema.FormalParameter("Y", "T")],
                    type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "")],
                    attributes=attributes)


def _function(op: str, inputs, outputs: list[str], nodes: list, documented, attributes=(), attribute_protos=()):
    """The FunctionProto of fuselm::`op` (opset-23 ops), its doc string `documented`'s docstring."""
    return oh.make_function(DOMAIN, op, list(inputs), outputs, nodes, opset_imports=[oh.make_opsetid("", OPSET)],
                            attributes=list(attributes), attribute_protos=list(attribute_protos),
                            doc_string=documented.__doc__)


def _c64(name, values) -> onnx.NodeProto:
    return oh.make_node("Constant", [], [name], value=oh.make_tensor(name, TensorProto.INT64, [len(values)], values))


def fused_rope_function(interleaved: bool = False, heads: bool = False, normed: bool = False) -> onnx.FunctionProto:
    """The FunctionProto of fuselm::FusedRoPE (domain fuselm, v1) for one form (RopeForm), opset-23 ops only.

    heads (some node takes x [B,S,H·D] with num_heads=H, as onnxruntime's RotaryEmbedding does):
        x4 = Reshape(x, [0, 0, num_heads, -1]) (num_heads=0 copies H of a 4-D x); y = Reshape(y4, Shape(x))
    normed (the nodes take a third input, norm_weight [D]): x4 = RMSNormalization(x4, norm_weight,
        axis=-1, epsilon, stash_type=1) first (Qwen3's q/k norm over head_dim)
    freqs = position_ids[..., None] * inv_freq                      [B,S,R/2]
    rotate_half (interleaved=0): emb = concat(freqs, freqs); rot = concat(-x2, x1)
    interleaved=1:               emb = repeat each freq twice; rot = (-x_odd, x_even) pairs
    cos/sin = cos/sin(emb) * attention_scaling, unsqueezed to [B,S,1,R]: they broadcast over
    heads (never [S,1,R,1]: the unsqueeze trap). Dims R..D of x pass through unrotated.
    The body is written for the form the model's nodes use (no `If` on an attribute), so
    `onnx.inliner` plus any converter gets plain ops.
    """
    x, y, pre, post = "X", "Y", [], []
    if heads:
        x, y = "x_heads", "y_heads"
        pre = [_attr_constant("nh", "value_int", "num_heads", onnx.AttributeProto.INT),
               _c64("zero_zero", [0, 0]), _c64("minus_one", [-1]), _c64("axis_0", [0]),
               oh.make_node("Unsqueeze", ["nh", "axis_0"], ["nh_1"]),
               oh.make_node("Concat", ["zero_zero", "nh_1", "minus_one"], ["shape_heads"], axis=0),
               oh.make_node("Reshape", ["X", "shape_heads"], [x])]
        post = [oh.make_node("Shape", ["X"], ["shape_x"]), oh.make_node("Reshape", [y, "shape_x"], ["Y"])]
    if normed:
        norm = oh.make_node("RMSNormalization", [x, "norm_weight"], ["x_normed"], axis=-1, stash_type=1)
        norm.attribute.append(oh.make_attribute_ref("epsilon", onnx.AttributeProto.FLOAT))
        pre.append(norm)
        x = "x_normed"
    nodes = [
        *pre,
        _attr_constant("inv", "value_floats", "inv_freq", onnx.AttributeProto.FLOATS),
        _attr_constant("scale", "value_float", "attention_scaling", onnx.AttributeProto.FLOAT),
        _c64("axis_last", [-1]), _c64("axis_2", [2]), _c64("zero", [0]), _c64("one", [1]), _c64("two", [2]),
        _c64("big", [2**62]),
        oh.make_node("Shape", ["inv"], ["half"]),
        oh.make_node("Mul", ["half", "two"], ["rdim"]),
        oh.make_node("Cast", ["position_ids"], ["pos_f"], to=TensorProto.FLOAT),
        oh.make_node("Unsqueeze", ["pos_f", "axis_last"], ["pos_u"]),
        oh.make_node("Mul", ["pos_u", "inv"], ["freqs"]),  # [B,S,R/2]
        oh.make_node("Slice", [x, "zero", "rdim", "axis_last"], ["x_rot"]),
        oh.make_node("Slice", [x, "rdim", "big", "axis_last"], ["x_pass"]),
        *(_interleaved_body() if interleaved else _half_body()),
        oh.make_node("Cos", ["emb"], ["cos_raw"]),
        oh.make_node("Sin", ["emb"], ["sin_raw"]),
        oh.make_node("Mul", ["cos_raw", "scale"], ["cos3"]),
        oh.make_node("Mul", ["sin_raw", "scale"], ["sin3"]),
        oh.make_node("Unsqueeze", ["cos3", "axis_2"], ["cos"]),  # [B,S,1,R]
        oh.make_node("Unsqueeze", ["sin3", "axis_2"], ["sin"]),
        oh.make_node("Mul", ["x_rot", "cos"], ["x_cos"]),
        oh.make_node("Mul", ["rot", "sin"], ["rot_sin"]),
        oh.make_node("Add", ["x_cos", "rot_sin"], ["y_rot"]),
        oh.make_node("Concat", ["y_rot", "x_pass"], [y], axis=-1),
        *post,
    ]
    attributes = [oh.make_attribute("attention_scaling", 1.0), oh.make_attribute("interleaved", 0)]
    if heads:
        attributes.append(oh.make_attribute("num_heads", 0))
    if normed:
        attributes.append(oh.make_attribute("epsilon", RMS_EPSILON))
    return _function(ROPE_OP, ["X", "position_ids", *(["norm_weight"] if normed else [])], ["Y"], nodes,
                     fused_rope_function, ["inv_freq"], attributes)


def rope_in_standard_ops(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """A 4-D FusedRoPE node written as its function body (onnx.inliner), its values named under the node's name: for
    a graph whose other FusedRoPE nodes use the other layout (a function has one body per graph)."""
    f32 = TensorProto.FLOAT
    graph = oh.make_graph([node], "rope", [oh.make_tensor_value_info(node.input[0], f32, None),
                                           oh.make_tensor_value_info(node.input[1], TensorProto.INT64, None)],
                          [oh.make_tensor_value_info(node.output[0], f32, None)])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", OPSET), oh.make_opsetid(DOMAIN, DOMAIN_VERSION)],
                          functions=[fused_rope_function(bool(_int_attr(node, "interleaved")))])
    nodes = list(importlib.import_module("onnx.inliner").inline_local_functions(model).graph.node)
    keep = {*node.input, node.output[0]}
    for k, n in enumerate(nodes):
        n.name = f"{node.name}/{n.op_type}_{k}"
        n.input[:] = [x if x in keep or not x else f"{node.name}/{x}" for x in n.input]
        n.output[:] = [x if x in keep else f"{node.name}/{x}" for x in n.output]
    return nodes


def _int_attr(n, name: str) -> int:
    """An INT attribute of a NodeProto or an onnx_ir node (0 when absent)."""
    if isinstance(n, onnx.NodeProto):
        return next((a.i for a in n.attribute if a.name == name), 0)
    a = n.attributes.get(name)
    return a.as_int() if a is not None else 0


def _n_inputs(n) -> int:
    """Inputs given to a NodeProto or an onnx_ir node (a trailing omitted optional input does not count)."""
    given = [bool(i) for i in n.input] if isinstance(n, onnx.NodeProto) else [i is not None for i in n.inputs]
    while given and not given[-1]:
        given.pop()
    return len(given)


def rope_form(nodes) -> RopeForm | None:
    """The one form the FusedRoPE nodes of a graph use (None: no FusedRoPE node).

    A model-local function has one body per op, so a graph mixing the rotary layouts, or normed and plain
    nodes, is refused; 4-D and [B,S,H·D] nodes share the `heads` body."""
    layouts, normed, heads = set(), set(), False
    for n in nodes:
        if n.domain == DOMAIN and n.op_type == ROPE_OP:
            layouts.add(bool(_int_attr(n, "interleaved")))
            normed.add(_n_inputs(n) > 2)
            heads = heads or _int_attr(n, "num_heads") > 0
    if len(layouts) > 1:
        raise FuselmError("the graph mixes interleaved and rotate-half FusedRoPE nodes; fuselm::FusedRoPE has one "
                          "function body per model, so one rotary layout per graph is supported")
    if len(normed) > 1:
        raise FuselmError("the graph mixes FusedRoPE nodes with and without a norm weight; fuselm::FusedRoPE has one "
                          "function body per model: fold the q/k norms into every FusedRoPE or into none")
    return RopeForm(layouts.pop(), heads, normed.pop()) if layouts else None


def _attr_constant(output: str, const_attr: str, function_attr: str, kind: int) -> onnx.NodeProto:
    """A Constant whose value is the function attribute `function_attr` (an attribute reference)."""
    node = oh.make_node("Constant", [], [output])
    node.attribute.append(oh.make_attribute_ref(const_attr, kind, ref_attr_name=function_attr))
    return node


def _half_body() -> list[onnx.NodeProto]:
    """rotate_half: emb = [freqs, freqs], rot = [-x2, x1] (HF's Llama/Qwen layout)."""
    return [
        oh.make_node("Concat", ["freqs", "freqs"], ["emb"], axis=-1),
        oh.make_node("Slice", ["x_rot", "zero", "half", "axis_last"], ["h_x1"]),
        oh.make_node("Slice", ["x_rot", "half", "rdim", "axis_last"], ["h_x2"]),
        oh.make_node("Neg", ["h_x2"], ["h_neg"]),
        oh.make_node("Concat", ["h_neg", "h_x1"], ["rot"], axis=-1),
    ]


def _interleaved_body() -> list[onnx.NodeProto]:
    """interleaved (GPT-J layout): pairs (x[2i], x[2i+1]) rotate by freqs[i]."""
    return [
        _c64("shape_pairs", [0, 0, 0, -1, 2]), _c64("shape_flat3", [0, 0, -1]), _c64("shape_flat4", [0, 0, 0, -1]),
        oh.make_node("Unsqueeze", ["freqs", "axis_last"], ["i_f"]),
        oh.make_node("Concat", ["i_f", "i_f"], ["i_ff"], axis=-1),
        oh.make_node("Reshape", ["i_ff", "shape_flat3"], ["emb"]),
        oh.make_node("Reshape", ["x_rot", "shape_pairs"], ["i_pairs"]),
        oh.make_node("Slice", ["i_pairs", "zero", "one", "axis_last"], ["i_even"]),
        oh.make_node("Slice", ["i_pairs", "one", "two", "axis_last"], ["i_odd"]),
        oh.make_node("Neg", ["i_odd"], ["i_neg"]),
        oh.make_node("Concat", ["i_neg", "i_even"], ["i_rot5"], axis=-1),
        oh.make_node("Reshape", ["i_rot5", "shape_flat4"], ["rot"]),
    ]


# --- fuselm::SwiGLU ------------------------------------------------------------------------------
SWIGLU_OP = "SwiGLU"


def swiglu_function() -> onnx.FunctionProto:
    """The FunctionProto of fuselm::SwiGLU (domain fuselm, v1): the gated SiLU of a fused gate/up projection.

    gate, up = X[..., :I], X[..., I:] (Split into two halves over the last axis)
    Y = gate · Sigmoid(gate) · up                                    [..., I]
    """
    nodes = [oh.make_node("Split", ["X"], ["gate", "up"], axis=-1, num_outputs=2),
             oh.make_node("Sigmoid", ["gate"], ["sig"]),
             oh.make_node("Mul", ["gate", "sig"], ["silu"]),
             oh.make_node("Mul", ["silu", "up"], ["Y"])]
    return _function(SWIGLU_OP, ["X"], ["Y"], nodes, swiglu_function)


# --- fuselm::LatentAttention ---------------------------------------------------------------------
LATENT_OP = "LatentAttention"
LATENT_ATTRS = ("num_heads", "qk_nope_head_dim", "v_head_dim")


def latent_attention_node(q: str, latent: str, k_rot: str, weight: str, mask: str, y: str, name: str, num_heads: int,
                          qk_nope_head_dim: int, v_head_dim: int, scale: float) -> onnx.NodeProto:
    """One `fuselm::LatentAttention` node (multi-head latent attention over its cache; see its function)."""
    return oh.make_node(LATENT_OP, [q, latent, k_rot, weight, mask], [y], name=name, domain=DOMAIN,
                        num_heads=int(num_heads), qk_nope_head_dim=int(qk_nope_head_dim), v_head_dim=int(v_head_dim),
                        scale=float(scale))


def latent_attention_schema():
    """LatentAttention's OpSchema (onnxscript needs one to emit a node of a custom domain)."""
    from onnx.defs import OpSchema

    return OpSchema(
        LATENT_OP, DOMAIN, DOMAIN_VERSION,
        inputs=[OpSchema.FormalParameter(n, "T") for n in ("Q", "latent", "k_rot", "weight", "mask")],
        outputs=[OpSchema.FormalParameter("Y", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "")],
        attributes=[*(OpSchema.Attribute(a, OpSchema.AttrType.INT, "") for a in LATENT_ATTRS),
                    OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, "")])


def latent_attention_function() -> onnx.FunctionProto:
    """The FunctionProto of fuselm::LatentAttention (domain fuselm, v1): multi-head latent attention (DeepSeek-V2/V3,
    GLM-4-MoE-lite, MiniCPM3) reading its cache, the compressed latent, in the expanded form (opset-23 ops only).

    Q [B,H,S,n+R] (n = qk_nope_head_dim, the rotary part R last), latent [B,1,T,r] and k_rot [B,1,T,R] (the layer's
    present: past_key_values.{i}.key / .value and this step's rows), weight [r, H·(n+v)] (kv_b_proj as [in, out],
    per head n key columns then v = v_head_dim value columns), mask [B,1,S,T] (additive or bool):
    kv = latent @ weight -> [B,H,T,n+v]; k_nope, V = split(kv, [n, v]); K = concat(k_nope, k_rot over the heads)
    Y = Attention(Q, K, V, mask, scale)                                   [B,H,S,v]
    A runtime may compute it absorbed instead (the weight's key columns folded into Q, its value columns applied
    after attention: attention over the latent itself, one kv head), where that costs fewer multiply-adds (decode).
    """
    def attr_1d(out, attr):
        return [_attr_constant(f"{out}_0", "value_int", attr, onnx.AttributeProto.INT),
                oh.make_node("Reshape", [f"{out}_0", "one_d"], [out])]

    nodes = [
        _c64("one_d", [1]), _c64("zero_minus1", [0, -1]), _c64("ones_1", [1]),
        *attr_1d("heads", "num_heads"), *attr_1d("nope", "qk_nope_head_dim"), *attr_1d("vdim", "v_head_dim"),
        oh.make_node("Add", ["nope", "vdim"], ["head_kv"]),
        oh.make_node("Squeeze", ["latent", "one_d"], ["latent3"]),  # [B,T,r]
        oh.make_node("MatMul", ["latent3", "weight"], ["kv"]),  # [B,T,H(n+v)]
        oh.make_node("Concat", ["zero_minus1", "heads", "head_kv"], ["kv_shape"], axis=0),
        oh.make_node("Reshape", ["kv", "kv_shape"], ["kv4"]),  # [B,T,H,n+v]
        oh.make_node("Transpose", ["kv4"], ["kv_heads"], perm=[0, 2, 1, 3]),  # [B,H,T,n+v]
        oh.make_node("Concat", ["nope", "vdim"], ["sizes"], axis=0),
        oh.make_node("Split", ["kv_heads", "sizes"], ["k_nope", "V"], axis=-1),
        oh.make_node("Concat", ["ones_1", "heads", "ones_1", "ones_1"], ["rot_shape"], axis=0),
        oh.make_node("Expand", ["k_rot", "rot_shape"], ["k_rot_heads"]),  # [B,H,T,R]
        oh.make_node("Concat", ["k_nope", "k_rot_heads"], ["K"], axis=-1),
    ]
    attention = oh.make_node("Attention", ["Q", "K", "V", "mask"], ["Y"])
    attention.attribute.append(oh.make_attribute_ref("scale", onnx.AttributeProto.FLOAT))
    nodes.append(attention)
    return _function(LATENT_OP, ["Q", "latent", "k_rot", "weight", "mask"], ["Y"], nodes, latent_attention_function,
                     [*LATENT_ATTRS, "scale"])


# --- recurrent-state ops: fuselm::CausalConv1D, fuselm::GatedDeltaNet, fuselm::Mamba2, fuselm::Mamba -----
# Each takes its layer's past state as its last input and returns the present state as its second output; the
# bodies run a Scan over the sequence (a step per token: the reference semantics; a runtime that knows the op
# prefills in chunks). Their states are float32 (DESIGN.md: states stay float whatever the KV cache's format).
CONV_OP = "CausalConv1D"
GDN_OP = "GatedDeltaNet"
MAMBA2_OP = "Mamba2"
MAMBA_OP = "Mamba"  # Mamba-1's selective scan
CONV_INPUTS = ("X", "past_state", "weight")
GDN_INPUTS = ("query", "key", "value", "decay", "beta", "past_state")
MAMBA2_INPUTS = ("X", "dt", "A_log", "B", "C", "D", "dt_bias", "past_state")
STATE_OPS = {CONV_OP: CONV_INPUTS, GDN_OP: GDN_INPUTS, MAMBA2_OP: MAMBA2_INPUTS, MAMBA_OP: MAMBA2_INPUTS}


def state_op_schema(op: str):
    """The OpSchema of a recurrent-state op (onnxscript needs one to emit a node of a custom domain)."""
    from onnx.defs import OpSchema

    attributes = [OpSchema.Attribute("dt_min", oh.make_attribute("dt_min", 0.0), ""),
                  OpSchema.Attribute("dt_max", oh.make_attribute("dt_max", float("inf")), "")] if op == MAMBA2_OP else []
    return OpSchema(op, DOMAIN, DOMAIN_VERSION, inputs=[OpSchema.FormalParameter(n, "T") for n in STATE_OPS[op]],
                    outputs=[OpSchema.FormalParameter("Y", "T"), OpSchema.FormalParameter("present_state", "T")],
                    type_constraints=[("T", ["tensor(float)"], "")], attributes=attributes)


def state_op_node(op: str, inputs: list[str], outputs: list[str], name: str, **attrs) -> onnx.NodeProto:
    """One recurrent-state op node (inputs in STATE_OPS[op]'s order; outputs Y, present_state)."""
    return oh.make_node(op, inputs, outputs, name=name, domain=DOMAIN, **attrs)


def _scan_graph(name: str, inputs: dict[str, int], outputs: dict[str, int], nodes: list) -> onnx.GraphProto:
    """A Scan body over float32 values of the given ranks (name -> rank), their dims free."""
    def info(values):
        return [oh.make_tensor_value_info(n, TensorProto.FLOAT, [f"{n}_{d}" for d in range(rank)])
                for n, rank in values.items()]
    return oh.make_graph(nodes, name, info(inputs), info(outputs))


def _heads_of(x: str, heads_shape: str, out: str) -> list[onnx.NodeProto]:
    """x [B,S,G,D] -> [B,S,H,D], each of the G groups repeated H/G times in place (torch's repeat_interleave over
    dim 2); `heads_shape` is the Shape of a [B,S,H,...] tensor."""
    return [oh.make_node("Shape", [x], [f"{out}_shape"]),
            oh.make_node("Slice", [f"{out}_shape", "zero_1", "three_1"], [f"{out}_lead"]),
            oh.make_node("Slice", [f"{out}_shape", "two_1", "three_1"], [f"{out}_groups"]),
            oh.make_node("Slice", [f"{out}_shape", "three_1", "four_1"], [f"{out}_dim"]),
            oh.make_node("Slice", [heads_shape, "two_1", "three_1"], [f"{out}_heads"]),
            oh.make_node("Div", [f"{out}_heads", f"{out}_groups"], [f"{out}_rep"]),
            oh.make_node("Concat", [f"{out}_lead", f"{out}_rep", f"{out}_dim"], [f"{out}_wide"], axis=0),
            oh.make_node("Concat", ["zero_zero", "minus_one", f"{out}_dim"], [f"{out}_flat"], axis=0),
            oh.make_node("Unsqueeze", [x, "three_1"], [f"{out}_5d"]),
            oh.make_node("Expand", [f"{out}_5d", f"{out}_wide"], [f"{out}_x"]),
            oh.make_node("Reshape", [f"{out}_x", f"{out}_flat"], [out])]


_INDEX_CONSTANTS = (("zero_1", [0]), ("one_1", [1]), ("two_1", [2]), ("three_1", [3]), ("four_1", [4]),
                    ("zero_zero", [0, 0]), ("minus_one", [-1]), ("axes_23", [2, 3]), ("big", [2**62]))


def causal_conv1d_function() -> onnx.FunctionProto:
    """The FunctionProto of fuselm::CausalConv1D (domain fuselm, v1): a causal depthwise convolution that keeps
    its last inputs as state (short convolutions: Mamba, GatedDeltaNet, LFM2).

    X [B,S,C], past_state [B,K-1,C] (the K-1 inputs before X; zeros before the first), weight [C,1,K] (ONNX
    Conv's depthwise layout) -> Y [B,S,C], present_state [B,K-1,C]
    full = concat(past_state, X) over time [B,K-1+S,C]; Y[:, s] = sum_k full[:, s+k] * weight[:, 0, k]
    present_state = the last K-1 rows of full. No bias or activation: the graph adds them after the op.
    """
    nodes = [*(_c64(n, v) for n, v in _INDEX_CONSTANTS),
             oh.make_node("Constant", [], ["zero_i"], value_int=0), oh.make_node("Constant", [], ["one_i"], value_int=1),
             oh.make_node("Concat", ["past_state", "X"], ["full"], axis=1),
             oh.make_node("Shape", ["X"], ["x_shape"]),
             oh.make_node("Slice", ["x_shape", "one_1", "two_1"], ["seq_1"]),
             oh.make_node("Squeeze", ["seq_1", "zero_1"], ["seq"]),
             oh.make_node("Shape", ["weight"], ["w_shape"]),
             oh.make_node("Slice", ["w_shape", "two_1", "three_1"], ["taps_1"]),
             oh.make_node("Squeeze", ["taps_1", "zero_1"], ["taps"]),
             oh.make_node("Range", ["zero_i", "seq", "one_i"], ["rows"]),
             oh.make_node("Range", ["zero_i", "taps", "one_i"], ["cols"]),
             oh.make_node("Unsqueeze", ["rows", "one_1"], ["rows_2d"]),
             oh.make_node("Unsqueeze", ["cols", "zero_1"], ["cols_2d"]),
             oh.make_node("Add", ["rows_2d", "cols_2d"], ["window_index"]),  # [S, K]
             oh.make_node("Gather", ["full", "window_index"], ["windows"], axis=1),  # [B, S, K, C]
             oh.make_node("Squeeze", ["weight", "one_1"], ["w_ck"]),
             oh.make_node("Transpose", ["w_ck"], ["w_kc"], perm=[1, 0]),
             oh.make_node("Mul", ["windows", "w_kc"], ["taps_x"]),
             oh.make_node("ReduceSum", ["taps_x", "two_1"], ["Y"], keepdims=0),
             oh.make_node("Slice", ["full", "seq_1", "big", "one_1"], ["present_state"])]
    return _function(CONV_OP, CONV_INPUTS, ["Y", "present_state"], nodes, causal_conv1d_function)


def gated_delta_function() -> onnx.FunctionProto:
    """The FunctionProto of fuselm::GatedDeltaNet (domain fuselm, v1): the gated delta rule (Qwen3-Next,
    Qwen3.5, OLMo-Hybrid linear attention; Kimi delta attention with its per-channel decay).

    query, key [B,S,Hk,Dk] (already normalized and scaled as the layer does), value [B,S,Hv,Dv], decay (the log of
    the state's decay, <= 0: [B,S,Hv], or [B,S,Hv,Dk] per key channel: Kimi delta attention) and beta [B,S,Hv],
    past_state [B,Hv,Dv,Dk] -> Y [B,S,Hv,Dv], present_state. Each key head serves Hv/Hk consecutive value heads.
    Per token t, per value head (S: [Dv, Dk]; the decay scales S's columns, all of them when it is one number):
    S = S · exp(decay_t); S = S + (beta_t · (v_t - S k_t)) ⊗ k_t; y_t = S q_t.
    (The state's layout is mlx-lm's and onnxruntime's GatedDeltaNet's: value rows, key columns.)
    """
    step = [oh.make_node("Constant", [], ["ax2"], value_ints=[2]), oh.make_node("Constant", [], ["ax3"], value_ints=[3]),
            oh.make_node("Exp", ["g_t"], ["decay_t"]),  # [B,Hv,1] or [B,Hv,Dk]
            oh.make_node("Unsqueeze", ["decay_t", "ax2"], ["decay_4d"]),
            oh.make_node("Mul", ["s_in", "decay_4d"], ["s_decayed"]),
            oh.make_node("Unsqueeze", ["k_t", "ax2"], ["k_row"]),  # [B,Hv,1,Dk]
            oh.make_node("Mul", ["s_decayed", "k_row"], ["s_k"]),
            oh.make_node("ReduceSum", ["s_k", "ax3"], ["recalled"], keepdims=0),  # [B,Hv,Dv]
            oh.make_node("Sub", ["v_t", "recalled"], ["error"]),
            oh.make_node("Unsqueeze", ["b_t", "ax2"], ["b_col"]),
            oh.make_node("Mul", ["error", "b_col"], ["delta"]),
            oh.make_node("Unsqueeze", ["delta", "ax3"], ["delta_col"]),  # [B,Hv,Dv,1]
            oh.make_node("Mul", ["delta_col", "k_row"], ["update"]),
            oh.make_node("Add", ["s_decayed", "update"], ["s_out"]),
            oh.make_node("Unsqueeze", ["q_t", "ax2"], ["q_row"]),
            oh.make_node("Mul", ["s_out", "q_row"], ["s_q"]),
            oh.make_node("ReduceSum", ["s_q", "ax3"], ["y_t"], keepdims=0)]
    body = _scan_graph("gated_delta_step", {"s_in": 4, "q_t": 3, "k_t": 3, "v_t": 3, "g_t": 3, "b_t": 2},
                       {"s_out": 4, "y_t": 3}, step)
    nodes = [*(_c64(n, v) for n, v in _INDEX_CONSTANTS), _c64("per_channel", [0, 0, 0, -1]),
             oh.make_node("Shape", ["value"], ["v_shape"]),
             *_heads_of("query", "v_shape", "q_heads"),
             *_heads_of("key", "v_shape", "k_heads"),
             oh.make_node("Reshape", ["decay", "per_channel"], ["decay_heads"]),  # [B,S,Hv,1] or [B,S,Hv,Dk]
             oh.make_node("Scan", ["past_state", "q_heads", "k_heads", "value", "decay_heads", "beta"], ["present_state", "Y"],
                          body=body, num_scan_inputs=5, scan_input_axes=[1] * 5, scan_output_axes=[1])]
    return _function(GDN_OP, GDN_INPUTS, ["Y", "present_state"], nodes, gated_delta_function)


def mamba2_function() -> onnx.FunctionProto:
    """The FunctionProto of fuselm::Mamba2 (domain fuselm, v1): Mamba-2's selective state-space scan (SSD) with its
    D skip (Mamba2, Bamba, Granite-4 hybrids, Nemotron-H, Falcon-H1, Zamba2).

    X [B,S,H,P], dt [B,S,H] (before its bias), A_log [H], B and C [B,S,G,N] (each group serves H/G consecutive
    heads), D [H], dt_bias [H], past_state [B,H,P,N] -> Y [B,S,H,P], present_state; attributes dt_min, dt_max.
    dt = clip(softplus(dt + dt_bias), dt_min, dt_max); per token t and head h:
    S = S · exp(-exp(A_log) · dt_t) + (dt_t · x_t) ⊗ B_t; y_t = S · C_t + D · x_t.
    """
    step = [oh.make_node("Constant", [], ["ax2"], value_ints=[2]), oh.make_node("Constant", [], ["ax3"], value_ints=[3]),
            oh.make_node("Constant", [], ["ax23"], value_ints=[2, 3]),
            oh.make_node("Unsqueeze", ["a_t", "ax23"], ["a_4d"]),
            oh.make_node("Mul", ["s_in", "a_4d"], ["s_decayed"]),
            oh.make_node("Unsqueeze", ["x_t", "ax3"], ["x_col"]),  # [B,H,P,1]
            oh.make_node("Unsqueeze", ["b_t", "ax2"], ["b_row"]),  # [B,H,1,N]
            oh.make_node("Mul", ["x_col", "b_row"], ["update"]),
            oh.make_node("Add", ["s_decayed", "update"], ["s_out"]),
            oh.make_node("Unsqueeze", ["c_t", "ax2"], ["c_row"]),
            oh.make_node("Mul", ["s_out", "c_row"], ["s_c"]),
            oh.make_node("ReduceSum", ["s_c", "ax3"], ["y_t"], keepdims=0)]
    body = _scan_graph("mamba2_step", {"s_in": 4, "a_t": 2, "x_t": 3, "b_t": 3, "c_t": 3}, {"s_out": 4, "y_t": 3}, step)
    nodes = [*(_c64(n, v) for n, v in _INDEX_CONSTANTS),
             _attr_constant("dt_lo", "value_float", "dt_min", onnx.AttributeProto.FLOAT),
             _attr_constant("dt_hi", "value_float", "dt_max", onnx.AttributeProto.FLOAT),
             oh.make_node("Add", ["dt", "dt_bias"], ["dt_biased"]),
             oh.make_node("Softplus", ["dt_biased"], ["dt_soft"]),
             oh.make_node("Clip", ["dt_soft", "dt_lo", "dt_hi"], ["dt_step"]),  # [B,S,H]
             oh.make_node("Exp", ["A_log"], ["a_exp"]),
             oh.make_node("Neg", ["a_exp"], ["a"]),
             oh.make_node("Mul", ["dt_step", "a"], ["dt_a"]),
             oh.make_node("Exp", ["dt_a"], ["decay"]),  # [B,S,H]
             oh.make_node("Unsqueeze", ["dt_step", "minus_one"], ["dt_col"]),
             oh.make_node("Mul", ["X", "dt_col"], ["x_dt"]),  # [B,S,H,P]
             oh.make_node("Shape", ["X"], ["x_shape"]),
             *_heads_of("B", "x_shape", "b_heads"),
             *_heads_of("C", "x_shape", "c_heads"),
             oh.make_node("Scan", ["past_state", "decay", "x_dt", "b_heads", "c_heads"], ["present_state", "y_scan"],
                          body=body, num_scan_inputs=4, scan_input_axes=[1] * 4, scan_output_axes=[1]),
             oh.make_node("Unsqueeze", ["D", "minus_one"], ["d_col"]),  # [H, 1]
             oh.make_node("Mul", ["X", "d_col"], ["skip"]),
             oh.make_node("Add", ["y_scan", "skip"], ["Y"])]
    return _function(MAMBA2_OP, MAMBA2_INPUTS, ["Y", "present_state"], nodes, mamba2_function, [],
                     [oh.make_attribute("dt_min", 0.0), oh.make_attribute("dt_max", float("inf"))])


def mamba_function() -> onnx.FunctionProto:
    """The FunctionProto of fuselm::Mamba (domain fuselm, v1): Mamba-1's selective scan with its D skip (Mamba,
    Falcon-Mamba, Jamba); the gate after it is the graph's.

    X [B,S,D], dt [B,S,D] (before its bias), A_log [D,N], B and C [B,S,N], D [D], dt_bias [D], past_state [B,D,N]
    -> Y [B,S,D], present_state. dt = softplus(dt + dt_bias); per token t and channel d:
    S = S · exp(-exp(A_log) · dt_t) + dt_t · x_t · B_t; y_t = S · C_t + D · x_t.
    """
    step = [oh.make_node("Constant", [], ["ax1"], value_ints=[1]), oh.make_node("Constant", [], ["ax2"], value_ints=[2]),
            oh.make_node("Mul", ["s_in", "a_t"], ["s_decayed"]),
            oh.make_node("Unsqueeze", ["x_t", "ax2"], ["x_col"]),  # [B,D,1]
            oh.make_node("Unsqueeze", ["b_t", "ax1"], ["b_row"]),  # [B,1,N]
            oh.make_node("Mul", ["x_col", "b_row"], ["update"]),
            oh.make_node("Add", ["s_decayed", "update"], ["s_out"]),
            oh.make_node("Unsqueeze", ["c_t", "ax1"], ["c_row"]),
            oh.make_node("Mul", ["s_out", "c_row"], ["s_c"]),
            oh.make_node("ReduceSum", ["s_c", "ax2"], ["y_t"], keepdims=0)]
    body = _scan_graph("mamba_step", {"s_in": 3, "a_t": 3, "x_t": 2, "b_t": 2, "c_t": 2}, {"s_out": 3, "y_t": 2}, step)
    nodes = [_c64("minus_one", [-1]),
             oh.make_node("Add", ["dt", "dt_bias"], ["dt_biased"]),
             oh.make_node("Softplus", ["dt_biased"], ["dt_step"]),  # [B,S,D]
             oh.make_node("Exp", ["A_log"], ["a_exp"]),
             oh.make_node("Neg", ["a_exp"], ["a"]),  # [D,N]
             oh.make_node("Unsqueeze", ["dt_step", "minus_one"], ["dt_col"]),
             oh.make_node("Mul", ["dt_col", "a"], ["dt_a"]),
             oh.make_node("Exp", ["dt_a"], ["decay"]),  # [B,S,D,N]
             oh.make_node("Mul", ["X", "dt_step"], ["x_dt"]),
             oh.make_node("Scan", ["past_state", "decay", "x_dt", "B", "C"], ["present_state", "y_scan"],
                          body=body, num_scan_inputs=4, scan_input_axes=[1] * 4, scan_output_axes=[1]),
             oh.make_node("Mul", ["X", "D"], ["skip"]),
             oh.make_node("Add", ["y_scan", "skip"], ["Y"])]
    return _function(MAMBA_OP, MAMBA2_INPUTS, ["Y", "present_state"], nodes, mamba_function)


STATE_FUNCTIONS = {CONV_OP: causal_conv1d_function, GDN_OP: gated_delta_function, MAMBA2_OP: mamba2_function,
                   MAMBA_OP: mamba_function}


def functions_for(nodes) -> list[onnx.FunctionProto]:
    """The model-local functions a graph with these nodes must carry: FusedRoPE's in its form, SwiGLU's,
    MoE's in its form, LatentAttention's, and each recurrent-state op's."""
    nodes = list(nodes)
    form = rope_form(nodes)
    out = [] if form is None else [fused_rope_function(form.interleaved, form.heads, form.normed)]
    if any(n.domain == DOMAIN and n.op_type == SWIGLU_OP for n in nodes):
        out.append(swiglu_function())
    if any(n.domain == DOMAIN and n.op_type == LATENT_OP for n in nodes):
        out.append(latent_attention_function())
    moe = moe_form(nodes)
    if moe is not None:
        out.append(moe_function(moe.activation, moe.scoring, moe.biased, moe.selection_bias))
    used = {n.op_type for n in nodes if n.domain == DOMAIN}
    out += [make() for op, make in STATE_FUNCTIONS.items() if op in used]
    return out


# --- fuselm::MoE ---------------------------------------------------------------------------------
MOE_OP = "MoE"
# the expert MLP's gated activation: act(gate) * up; clamped_swiglu is gpt-oss's
# min(gate, limit) * sigmoid(alpha * min(gate, limit)) * (clip(up, -limit, limit) + 1)
MOE_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "clamped_swiglu")
# the router's probabilities: softmax over experts, each expert's sigmoid, or PhiMoE's sparsemixer (each slot a
# softmax over the experts within a relative distance 2·jitter_eps of that slot's logit)
MOE_SCORINGS = ("softmax", "sigmoid", "sparsemixer")
MOE_INPUTS = ("X", "router", "gate_up", "down", "bias", "router_bias", "gate_up_bias", "down_bias")
# fuselm::MoE's attributes with defaults (schema and function body)
MOE_DEFAULTS = {"normalize": 0, "activation": "silu", "scoring": "softmax", "scaling": 1.0, "alpha": 1.0,
                "limit": float("inf"), "jitter_eps": 0.01}
MOE_BIASES = MOE_INPUTS[5:]  # optional, all three or none: gpt-oss's router and expert biases


@dataclass(frozen=True)
class MoeForm:
    """What selects MoE's function body: the gate activation, the router scoring, whether the node
    carries the router and expert biases (inputs 5-7), and whether a softmax router chooses with a
    selection bias (input 4: Ernie-4.5-MoE; a sigmoid router's body always reads it)."""

    activation: str = "silu"
    scoring: str = "softmax"
    biased: bool = False
    selection_bias: bool = False


def moe_forms() -> list[MoeForm]:
    """Every form fuselm::MoE has a function body for."""
    return [MoeForm(a, s, b, sb) for a in MOE_ACTIVATIONS for s in MOE_SCORINGS for b in (False, True)
            for sb in ((False, True) if s == "softmax" else (False,))]


def moe_node(x: str, router: str, gate_up: str, down: str, y: str, name: str, top_k: int, normalize: int,
             activation: str = "silu", scoring: str = "softmax", scaling: float = 1.0,
             bias: str | None = None, biases: tuple[str, str, str] | None = None, alpha: float = 1.0,
             limit: float = float("inf"), jitter_eps: float = 0.01) -> onnx.NodeProto:
    """One `fuselm::MoE` node: x [..., H], router [E, H], gate_up [E, 2I, H], down [E, H, I](, bias [E])
    (, router_bias [E], gate_up_bias [E, 2I], down_bias [E, H]: `biases`) -> y [..., H]."""
    inputs = [x, router, gate_up, down] + ([bias or ""] if bias or biases else []) + list(biases or ())
    extra = dict(alpha=float(alpha), limit=float(limit)) if activation == "clamped_swiglu" else {}
    if scoring == "sparsemixer":
        extra["jitter_eps"] = float(jitter_eps)
    return oh.make_node(MOE_OP, inputs, [y], name=name, domain=DOMAIN, top_k=int(top_k), normalize=int(normalize),
                        activation=activation, scoring=scoring, scaling=float(scaling), **extra)


def moe_schema():
    """MoE's OpSchema (onnxscript needs one to emit a node of a custom domain)."""
    from onnx.defs import OpSchema

    optional = OpSchema.FormalParameterOption.Optional
    return OpSchema(
        MOE_OP, DOMAIN, DOMAIN_VERSION,
        inputs=[*(OpSchema.FormalParameter(n, "T") for n in MOE_INPUTS[:4]),
                *(OpSchema.FormalParameter(n, "T", param_option=optional) for n in MOE_INPUTS[4:])],
        outputs=[OpSchema.FormalParameter("Y", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "")],
        attributes=[OpSchema.Attribute("top_k", OpSchema.AttrType.INT, ""),
                    *(OpSchema.Attribute(n, oh.make_attribute(n, v), "") for n, v in MOE_DEFAULTS.items())])


def moe_function(activation: str = "silu", scoring: str = "softmax", biased: bool = False,
                 selection_bias: bool = False) -> onnx.FunctionProto:
    """The FunctionProto of fuselm::MoE (domain fuselm, v1) for one gate activation, router scoring and
    bias form (MoeForm), opset-23 ops only.

    The reference semantics, every expert computed densely (a runtime that knows the op runs only
    the top_k experts of each token):
    x2 = x flattened to [T, H]; logits = x2 @ router^T (+ router_bias) [T, E]
    scoring softmax: probs = softmax(logits); experts = TopK(probs, top_k)
    scoring sigmoid: probs = sigmoid(logits); experts = TopK(probs + bias, top_k) (bias [E] chooses only:
                     DeepSeek-V3's e_score_correction_bias; GLM-4.5, MiniMax-M2)
    softmax with a selection bias (MoeForm.selection_bias: Ernie-4.5-MoE): experts = TopK(probs + bias, top_k)
    scoring sparsemixer (PhiMoE): (v, experts) = TopK(logits, top_k), sorted; slot j's value is
                     softmax over the experts e not chosen before slot j with
                     (v_j - logits_e) / max(|logits_e|, v_j) <= 2 · jitter_eps, taken at experts_j
    values = probs at experts; values /= sum(values) where normalize = 1; values *= scaling
    weights = values scattered into zeros [T, E] (0 outside each token's top_k)
    gate, up = split(x2 @ gate_up^T (+ gate_up_bias)) per expert [E, T, I]; h = act(gate, up)
    (silu / gelu: act(gate) * up; clamped_swiglu: g = min(gate, limit), g * sigmoid(alpha * g) *
    (clip(up, -limit, limit) + 1))
    y = sum_e weights[:, e] * (h_e @ down_e^T (+ down_bias_e)), reshaped to x's shape.
    normalize = 1 with softmax equals softmax over the top_k logits (Granite-MoE's, gpt-oss's routing order).
    """
    if activation not in MOE_ACTIVATIONS or scoring not in MOE_SCORINGS or (selection_bias and scoring != "softmax"):
        raise FuselmError(f"fuselm::MoE activation {activation!r} / scoring {scoring!r} is not one of "
                          f"{', '.join(MOE_ACTIVATIONS)} / {', '.join(MOE_SCORINGS)} (a selection bias: softmax only)")

    if activation == "silu":
        act = [oh.make_node("Sigmoid", ["gate"], ["gate_sig"]), oh.make_node("Mul", ["gate", "gate_sig"], ["gate_act"]),
               oh.make_node("Mul", ["gate_act", "up"], ["h"])]
    elif activation == "clamped_swiglu":
        act = [_attr_constant("alpha", "value_float", "alpha", onnx.AttributeProto.FLOAT),
               _attr_constant("limit", "value_float", "limit", onnx.AttributeProto.FLOAT),
               oh.make_node("Neg", ["limit"], ["neg_limit"]),
               oh.make_node("Min", ["gate", "limit"], ["gate_c"]),
               oh.make_node("Clip", ["up", "neg_limit", "limit"], ["up_c"]),
               oh.make_node("Mul", ["gate_c", "alpha"], ["gate_a"]),
               oh.make_node("Sigmoid", ["gate_a"], ["gate_sig"]),
               oh.make_node("Mul", ["gate_c", "gate_sig"], ["gate_act"]),
               oh.make_node("Add", ["up_c", "one_f"], ["up_1"]),
               oh.make_node("Mul", ["gate_act", "up_1"], ["h"])]
    else:
        act = [oh.make_node("Gelu", ["gate"], ["gate_act"], approximate="tanh" if activation == "gelu_tanh" else "none"),
               oh.make_node("Mul", ["gate_act", "up"], ["h"])]
    if scoring == "softmax" and not selection_bias:
        route = [oh.make_node("Softmax", ["logits"], ["probs"], axis=-1),
                 oh.make_node("TopK", ["probs", "k"], ["top_v", "top_i"], axis=-1)]
    elif scoring == "softmax":
        route = [oh.make_node("Softmax", ["logits"], ["probs"], axis=-1),
                 oh.make_node("Add", ["probs", "bias"], ["choice"]),
                 oh.make_node("TopK", ["choice", "k"], ["_choice_v", "top_i"], axis=-1),
                 oh.make_node("GatherElements", ["probs", "top_i"], ["top_v"], axis=1)]
    elif scoring == "sparsemixer":
        route = _sparsemixer_body()
    else:
        route = [oh.make_node("Sigmoid", ["logits"], ["probs"]),
                 oh.make_node("Add", ["probs", "bias"], ["choice"]),
                 oh.make_node("TopK", ["choice", "k"], ["_choice_v", "top_i"], axis=-1),
                 oh.make_node("GatherElements", ["probs", "top_i"], ["top_v"], axis=1)]

    def biased_or_not(op, inputs, out, bias, unsqueeze=False):
        """`op(inputs) -> out`, plus the bias input where the form has biases ([E, N] as [E, 1, N])."""
        if not biased:
            return [oh.make_node(op, inputs, [out])]
        pre = [oh.make_node(op, inputs, [f"{out}_nobias"])]
        b = bias
        if unsqueeze:
            pre.append(oh.make_node("Unsqueeze", [bias, "axis1"], [f"{bias}_3d"]))
            b = f"{bias}_3d"
        return pre + [oh.make_node("Add", [f"{out}_nobias", b], [out])]

    nodes = [
        _attr_constant("k0", "value_int", "top_k", onnx.AttributeProto.INT),
        _attr_constant("norm_i", "value_int", "normalize", onnx.AttributeProto.INT),
        _attr_constant("scale", "value_float", "scaling", onnx.AttributeProto.FLOAT),
        oh.make_node("Constant", [], ["one_f"], value_float=1.0),
        oh.make_node("Constant", [], ["zero_f"], value_float=0.0),
        _c64("one_d", [1]), _c64("minus1", [-1]), _c64("axis0", [0]), *([_c64("axis1", [1])] if biased else []),
        oh.make_node("Reshape", ["k0", "one_d"], ["k"]),
        oh.make_node("Cast", ["norm_i"], ["norm_f"], to=TensorProto.FLOAT),
        oh.make_node("Shape", ["X"], ["x_shape"]),
        oh.make_node("Flatten", ["X"], ["x2"], axis=-1),  # [T, H]
        oh.make_node("Transpose", ["router"], ["router_t"], perm=[1, 0]),
        *biased_or_not("MatMul", ["x2", "router_t"], "logits", "router_bias"),  # [T, E]
        *route,
        oh.make_node("ReduceSum", ["top_v", "minus1"], ["top_sum"], keepdims=1),
        # denominator: the sum where normalize = 1, else 1 (no `If` on the attribute)
        oh.make_node("Mul", ["top_sum", "norm_f"], ["sum_part"]),
        oh.make_node("Sub", ["one_f", "norm_f"], ["keep_part"]),
        oh.make_node("Add", ["sum_part", "keep_part"], ["denom"]),
        oh.make_node("Div", ["top_v", "denom"], ["top_n"]),
        oh.make_node("Mul", ["top_n", "scale"], ["top_w"]),
        oh.make_node("Mul", ["probs", "zero_f"], ["zeros"]),
        oh.make_node("ScatterElements", ["zeros", "top_i", "top_w"], ["dense_w"], axis=1),  # [T, E]
        oh.make_node("Transpose", ["dense_w"], ["dense_wt"], perm=[1, 0]),
        oh.make_node("Unsqueeze", ["dense_wt", "minus1"], ["w3"]),  # [E, T, 1]
        oh.make_node("Transpose", ["gate_up"], ["gate_up_t"], perm=[0, 2, 1]),  # [E, H, 2I]
        *biased_or_not("MatMul", ["x2", "gate_up_t"], "gu", "gate_up_bias", unsqueeze=True),  # [E, T, 2I]
        oh.make_node("Split", ["gu"], ["gate", "up"], axis=-1, num_outputs=2),
        *act,
        oh.make_node("Transpose", ["down"], ["down_t"], perm=[0, 2, 1]),  # [E, I, H]
        *biased_or_not("MatMul", ["h", "down_t"], "per_expert", "down_bias", unsqueeze=True),  # [E, T, H]
        oh.make_node("Mul", ["per_expert", "w3"], ["weighted"]),
        oh.make_node("ReduceSum", ["weighted", "axis0"], ["y2"], keepdims=0),  # [T, H]
        oh.make_node("Reshape", ["y2", "x_shape"], ["Y"]),
    ]
    # the forms without biases or clamping keep the body they had before those existed (graphs written then still check)
    given = {**MOE_DEFAULTS, "activation": activation, "scoring": scoring}
    names = ["normalize", "activation", "scoring", "scaling"]
    names += ["alpha", "limit"] if activation == "clamped_swiglu" else []
    names += ["jitter_eps"] if scoring == "sparsemixer" else []
    return _function(MOE_OP, MOE_INPUTS if biased else MOE_INPUTS[:5], ["Y"], nodes, moe_function, ["top_k"],
                     [oh.make_attribute(n, given[n]) for n in names])


def _sparsemixer_body() -> list[onnx.NodeProto]:
    """PhiMoE's sparsemixer at inference (transformers' `sparsemixer`, top_k slots at once): logits [T, E] ->
    probs (the logits: only their shape is read after), top_v [T, k], top_i [T, k]. Slot j keeps expert e where
    (v_j - s_e) / max(|s_e|, v_j) <= 2·jitter_eps (NaN keeps, as torch's `>` mask does) and e's rank in the
    TopK order is not below j (the experts chosen before are masked, as sparsemixer's scatter of -inf)."""
    def c(name, **value):
        return oh.make_node("Constant", [], [name], **value)

    return [
        _attr_constant("eps", "value_float", "jitter_eps", onnx.AttributeProto.FLOAT),
        c("two_f", value_float=2.0), c("neg_inf", value_float=float("-inf")), c("zero_i", value_int=0),
        c("one_i", value_int=1), c("axis2", value_ints=[2]), c("axis_m1", value_ints=[-1]),
        oh.make_node("Identity", ["logits"], ["probs"]),
        oh.make_node("TopK", ["logits", "k"], ["top_l", "top_i"], axis=-1),  # sorted, largest first
        oh.make_node("Unsqueeze", ["top_l", "axis_m1"], ["v3"]),  # [T, k, 1]
        oh.make_node("Unsqueeze", ["logits", "one_d"], ["s3"]),  # [T, 1, E]
        oh.make_node("Abs", ["s3"], ["s3_abs"]),
        oh.make_node("Max", ["s3_abs", "v3"], ["factor"]),
        oh.make_node("Sub", ["v3", "s3"], ["gap"]),
        oh.make_node("Div", ["gap", "factor"], ["rel"]),  # [T, k, E]
        oh.make_node("Mul", ["eps", "two_f"], ["eps2"]),
        oh.make_node("Greater", ["rel", "eps2"], ["far"]),
        # each expert's rank in the TopK order (k for the unchosen), against the slot index j
        oh.make_node("Range", ["zero_i", "k0", "one_i"], ["slots"]),  # [k]
        oh.make_node("Shape", ["top_i"], ["top_shape"]),
        oh.make_node("Expand", ["slots", "top_shape"], ["slot_rows"]),  # [T, k]
        oh.make_node("Shape", ["logits"], ["logit_shape"]),
        oh.make_node("Expand", ["k0", "logit_shape"], ["unranked"]),  # [T, E] filled with k
        oh.make_node("ScatterElements", ["unranked", "top_i", "slot_rows"], ["rank"], axis=1),
        oh.make_node("Unsqueeze", ["rank", "one_d"], ["rank3"]),  # [T, 1, E]
        oh.make_node("Unsqueeze", ["slots", "one_d"], ["slots3"]),  # [k, 1]
        oh.make_node("Less", ["rank3", "slots3"], ["before"]),  # [T, k, E]
        oh.make_node("Or", ["far", "before"], ["dropped"]),
        oh.make_node("Where", ["dropped", "neg_inf", "s3"], ["gates"]),
        oh.make_node("Softmax", ["gates"], ["gates_p"], axis=-1),
        oh.make_node("Unsqueeze", ["top_i", "axis_m1"], ["top_i3"]),
        oh.make_node("GatherElements", ["gates_p", "top_i3"], ["top_v3"], axis=2),
        oh.make_node("Squeeze", ["top_v3", "axis2"], ["top_v"]),
    ]


def _input_names(n) -> list[str]:
    """A NodeProto's or onnx_ir node's input names ("" for an omitted one)."""
    return list(n.input) if isinstance(n, onnx.NodeProto) else [v.name if v is not None else "" for v in n.inputs]


def moe_biased(n) -> bool:
    """Whether a MoE node (NodeProto or onnx_ir node) carries the router and expert biases (inputs 5-7);
    some of them without the others is refused."""
    given = [bool(x) for x in _input_names(n)[5:8]]
    if any(given) and not all(given):
        raise FuselmError(f"MoE node {n.name}: it has some of {', '.join(MOE_BIASES)} but not all; fuselm::MoE takes "
                          "the three together or none")
    return all(given) and len(given) == 3


def moe_form(nodes) -> MoeForm | None:
    """The one form (activation, scoring, biases) the MoE nodes of a graph use (None: no MoE node); one
    function body per model, as FusedRoPE has one per rotary form."""
    forms = set()
    for n in nodes:
        if n.domain == DOMAIN and n.op_type == MOE_OP:
            activation, scoring = (_str_attr(n, name, default) for name, default in (("activation", "silu"),
                                                                                      ("scoring", "softmax")))
            inputs = _input_names(n)
            chooses = scoring == "softmax" and len(inputs) > 4 and bool(inputs[4])
            forms.add(MoeForm(activation, scoring, moe_biased(n), chooses))
    if len(forms) > 1:
        shown_forms = ", ".join(f"{f.activation}/{f.scoring}{'/biased' if f.biased else ''}"
                                f"{'/selection bias' if f.selection_bias else ''}"
                                for f in sorted(forms, key=str))
        raise FuselmError(f"the graph's MoE nodes use several forms ({shown_forms}); fuselm::MoE has one function body "
                          "per model, so one expert activation, router scoring and bias form per graph is supported")
    return forms.pop() if forms else None


def _str_attr(n, name: str, default: str) -> str:
    if isinstance(n, onnx.NodeProto):
        return next((a.s.decode() for a in n.attribute if a.name == name), default)
    a = n.attributes.get(name)  # an onnx_ir node
    return a.as_string() if a is not None else default


# --- feeds of one step ---------------------------------------------------------------------------
def dims(value_info: onnx.ValueInfoProto) -> list:
    """Declared dims: ints, symbolic names, or None."""
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in value_info.type.tensor_type.shape.dim]


def step_feeds(inputs, seq: int, past: int, vocab: int, seed: int = 0, past_values: dict | None = None,
               head_dim: int | None = None, ids=None) -> dict[str, np.ndarray]:
    """Inputs of one step of a contract graph (`inputs`: its graph.input ValueInfoProtos), batch 1:
    `ids` (else seeded random ids below `vocab`), a mask of ones over past + seq, consecutive positions,
    and the caches and states from `past_values` (past name -> array; else seeded random, states zero at
    past 0). `head_dim` stands in for a symbolic last dim of the cache inputs."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for inp in inputs:
        name, shape = inp.name, dims(inp)
        if name == INPUT_IDS:
            out[name] = np.asarray(ids, np.int64).reshape(1, -1) if ids is not None else \
                rng.integers(0, vocab, size=(1, seq), dtype=np.int64)
        elif name == ATTENTION_MASK:
            out[name] = np.ones((1, past + seq), dtype=np.int64)
        elif name == POSITION_IDS:
            out[name] = np.arange(past, past + seq, dtype=np.int64)[None]
        elif is_past(name):
            if past_values is not None:
                out[name] = past_values[name]
                continue
            if len(shape) == 4 and not isinstance(shape[3], int) and head_dim is not None:
                shape[3] = head_dim
            if len(shape) != 4 or not isinstance(shape[1], int) or not isinstance(shape[3], int):
                raise FuselmError(f"input {name} has shape {shape}; expected [batch, kv_heads, past, head_dim] "
                                  "with static kv_heads and head_dim (graph contract v1)")
            out[name] = rng.standard_normal((1, shape[1], past, shape[3])).astype(np.float32)
        elif is_state_past(name):
            if past_values is not None:
                out[name] = past_values[name]
            elif past == 0:
                out[name] = zero_state(shape)
            else:
                out[name] = (0.5 * rng.standard_normal(zero_state(shape).shape)).astype(np.float32)
        else:
            raise FuselmError(f"cannot make an input for graph input {name!r}: the graph contract's inputs are "
                              f"{', '.join(STEP_INPUTS)}, {PAST}.{{i}}.key/.value and {STATE_PAST}.{{i}}.conv/.recurrent")
    return out


def zero_state(shape, batch: int = 1, dtype=np.float32) -> np.ndarray:
    """A recurrent state before the first token: zeros of its declared shape (batch first, the rest fixed)."""
    if not shape or not all(isinstance(d, int) and d > 0 for d in shape[1:]):
        raise FuselmError(f"a {STATE_PAST} input has shape {shape}; the contract needs [batch, ...] with every other "
                          "dim fixed; re-export with `fuselm convert`")
    return np.zeros((batch, *shape[1:]), dtype)


def empty_dims(inputs) -> str | None:
    """A step input (ids, mask, positions) declared with a dimension of 0: no step can ever feed it (a
    batch or a sequence of nothing). Returns the problem, or None."""
    for inp in inputs:
        if inp.name in STEP_INPUTS and 0 in dims(inp):
            return f"graph input {inp.name} is declared with shape {dims(inp)}: a dimension of 0 can never be fed"
    return None


def empty_past(inputs, batch: int = 1) -> dict[str, np.ndarray]:
    """Zero-length caches for every past input (its element type: float16 or float32) and zero states."""
    out = {}
    for inp in inputs:
        shape = dims(inp)
        elem = inp.type.tensor_type.elem_type
        if is_past(inp.name):
            out[inp.name] = np.zeros((batch, shape[1], 0, shape[3]),
                                     np.float16 if elem == TensorProto.FLOAT16 else np.float32)
        elif is_state_past(inp.name):
            out[inp.name] = zero_state(shape, batch)
    return out


def vocab_size(model: onnx.ModelProto) -> int:
    """The vocabulary size: logits' last dim, else the rows of the table `input_ids` indexes."""
    for out in model.graph.output:
        if out.name == LOGITS:
            d = dims(out)
            if d and isinstance(d[-1], int) and d[-1] > 0:
                return d[-1]
    inits = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] == INPUT_IDS and node.input[0] in inits:
            return int(inits[node.input[0]].dims[0])
    return 64


# --- what the runtime feeds one step -------------------------------------------------------------
@dataclass
class CacheSpec:
    """One past input of a contract graph as the runtime holds it."""

    name: str  # graph input
    present: str  # graph output
    heads: int
    head_dim: int
    dtype: int


@dataclass
class StateSpec:
    """One recurrent-state input of a contract graph: its name, the output it comes back as, its shape past
    the batch and its element type."""

    name: str
    present: str
    shape: tuple[int, ...]
    dtype: int


@dataclass
class StepIO:
    """The names one step of a graph takes and returns: input_ids or a pipeline stage's hidden state,
    logits or the next stage's hidden state, the caches in layer order and the recurrent states."""

    first: str
    output: str
    caches: list[CacheSpec]
    states: list[StateSpec] = field(default_factory=list)


def check_step_io(ins: dict[str, tuple[int, list]], outs, path) -> StepIO:
    """Check a graph's inputs (name -> (element type, dims)) and output names against the contract,
    as the runtime will feed them; every problem is a FuselmError naming the fix."""
    outs = set(outs)
    first = HIDDEN if HIDDEN in ins else INPUT_IDS  # a pipeline stage (`fuselm split`) takes / returns the
    output = NEXT_HIDDEN if NEXT_HIDDEN in outs else LOGITS  # hidden state in place of input_ids / logits
    step_inputs = (first, ATTENTION_MASK, POSITION_IDS)
    missing = [n for n in step_inputs if n not in ins] + [n for n in (output,) if n not in outs]
    specs = []
    for name, (elem, shape) in sorted(ins.items(), key=lambda kv: cache_order(kv[0])):
        if not is_past(name):
            continue
        if present_of(name) not in outs:
            missing.append(present_of(name))
        if len(shape) != 4 or not isinstance(shape[1], int) or not isinstance(shape[3], int):
            raise FuselmError(f"graph input {name} has shape {shape}; the contract needs [batch, kv_heads, past, "
                              "head_dim] with fixed kv_heads and head_dim")
        specs.append(CacheSpec(name, present_of(name), shape[1], shape[3], elem))
    states = []
    for name, (elem, shape) in sorted(ins.items(), key=lambda kv: step_order(kv[0])):
        if not is_state_past(name):
            continue
        if step_present_of(name) not in outs:
            missing.append(step_present_of(name))
        states.append(StateSpec(name, step_present_of(name), tuple(zero_state(shape).shape[1:]), elem))
    if not specs and not states:
        missing.append(past_name("{i}", "key/.value"))
    unknown = [n for n in ins if n not in step_inputs and not is_step_past(n)]
    if missing or unknown:
        what = (f"missing {', '.join(missing)}" if missing else "") + \
               ("; " if missing and unknown else "") + (f"unexpected inputs {unknown}" if unknown else "")
        raise FuselmError(f"{path} does not follow the fuselm graph contract ({what}); it needs {NAMES_TEXT} "
                          "(DESIGN.md); re-export with `fuselm convert`")
    _check_declared({n: t for n, t in ins.items() if n != HIDDEN and not is_state_past(n)})
    bad = next((st for st in states if st.dtype != TensorProto.FLOAT), None)
    if bad is not None:
        raise FuselmError(f"graph input {bad.name} is not float32; the contract's recurrent states are float32 "
                          "[batch, ...] (DESIGN.md); re-export with `fuselm convert`")
    return StepIO(first, output, specs, states)


def _check_declared(ins: dict) -> None:
    """The inputs' declared types and static dims must admit what the runtime feeds: int64 ids [1, n],
    float caches [1, kv_heads, past, head_dim] (dims without a size, `[]`, admit anything)."""
    for name, (elem, shape) in ins.items():
        ids = not is_past(name)
        growing = (1,) if ids else (2,)  # seq / past length: different at every step
        if (elem != TensorProto.INT64) if ids else elem not in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16):
            problem = f"element type {TensorProto.DataType.Name(elem) if elem in TensorProto.DataType.values() else elem}"
        elif shape and (len(shape) != (2 if ids else 4) or shape[0] not in (1, None) and isinstance(shape[0], int)
                        or any(isinstance(shape[i], int) for i in growing)):
            problem = f"shape {shape}"
        else:
            continue
        raise FuselmError(f"graph input {name} is declared with {problem}, which the runtime cannot feed: the "
                          f"contract is {' / '.join(STEP_INPUTS)} int64 [batch, sequence] and "
                          f"{PAST} float [batch, kv_heads, past, head_dim], batch 1 or free, sequence and "
                          "past free (DESIGN.md); re-export with `fuselm convert`")
