"""Checks on an ONNX file from anywhere, before anything reads its weights or runs it.

`optimize`, `diff`, `run` and `validate` call `check_graph_file` first. It refuses, with a message
naming the problem:
- tensors whose bytes do not match their shape and type (so no later step allocates a buffer sized
  by an absurd shape), external data that leaves the model's directory (absolute, `..`, or through
  a symlink), a missing or too short data file, offsets that are not byte counts, lengths that
  disagree with the shape, unknown external-data keys;
- a graph that is not a DAG: a node reading a value nothing produces, a value produced twice, a
  cycle; two nodes with one name;
- names and other strings that are not valid UTF-8;
- anything else `onnx.checker.check_model(full_check=True)` rejects (types, shapes, opsets); for a
  graph with onnxruntime contrib ops (onnxruntime-genai's builder, `fuselm optimize --target
  onnxruntime`), what onnxruntime itself rejects when it loads the graph (schemas, a CPU kernel); a
  `fuselm::FusedRoPE` whose attributes do not fit its input or whose function body is not fuselm's,
  Attention head counts that contradict its inputs, and blocked DequantizeLinear scales that do
  not match their weight.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator
from pathlib import Path

import onnx
from onnx import AttributeProto, TensorProto, helper

from . import contract
from .errors import FuselmError, shown

_FOUR_BIT = (TensorProto.UINT4, TensorProto.INT4, TensorProto.FLOAT4E2M1)
_FIX = "re-export the model (`fuselm convert`, torch.onnx) or restore the file"
# onnxruntime registers these contrib ops in the ONNX domain and onnxruntime-genai's builder writes
# them there; passes/from_genai.py maps them to RMSNormalization. onnx.checker knows no schema for them.
ORT_ONNX_DOMAIN_CONTRIB = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")
ORT_DOMAIN = "com.microsoft"
# The contrib ops fuselm reads (passes/from_genai.py) and writes (`--target onnxruntime`); a graph with
# only these is loaded by onnxruntime as a check. Another op is left for FromGenAI to name.
ORT_CONTRIB_OPS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "MatMulNBits",
                   "GatherBlockQuantized", "GroupQueryAttention", "RotaryEmbedding")


def check_graph_file(onnx_path: str | os.PathLike) -> onnx.ModelProto:
    """Check the .onnx file and its external data; returns the graph (weights not loaded)."""
    path = Path(onnx_path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError, onnx's own errors, I/O
        raise FuselmError(f"cannot read {path}: it is not a readable ONNX model ({type(e).__name__}: "
                          f"{shown(str(e), 200)}); {_FIX}") from None
    _check_text(model, path)
    files: dict[Path, int] = {}
    for tensor in _tensors(model):
        _check_tensor(tensor, path.parent, files)
    _check_dag(model.graph, path)
    problem = contract.empty_dims(model.graph.input)
    if problem:
        raise FuselmError(f"{path}: {problem} (DESIGN.md's graph contract: batch and sequence are free); {_FIX}")
    view = _contrib_view(model, path)
    try:  # what check_model(full_check=True) does, keeping the inferred shapes for _check_ops
        onnx.checker.check_model(str(path) if view is None else view)
        inferred = onnx.shape_inference.infer_shapes(model if view is None else view, check_type=True,
                                                     strict_mode=True)
    except Exception as e:  # ValidationError, InferenceError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FuselmError(f"{path} is not a valid ONNX model: onnx.checker says {shown(first, 300)}; {_FIX}") from None
    if view is not None and all(n.op_type in ORT_CONTRIB_OPS for n in model.graph.node if n.domain == ORT_DOMAIN):
        _check_in_onnxruntime(model, path)
    _check_functions(model, path)
    _check_ops(inferred, path)
    return model


def _contrib_view(model: onnx.ModelProto, path: Path) -> onnx.ModelProto | None:
    """For a graph with onnxruntime contrib ops (onnxruntime-genai's builder writes them): a copy
    onnx.checker can check, else None. An ONNX-domain node whose op is no ONNX op is refused here
    by name, unless it is one of the contrib ops onnxruntime registers in that domain."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    held = []
    for n in model.graph.node:
        if n.domain not in ("", "ai.onnx") or onnx.defs.has(n.op_type, opset, ""):
            continue
        if n.op_type not in ORT_ONNX_DOMAIN_CONTRIB:
            raise FuselmError(f"{path}: node {shown(n.name, 80)} uses op {shown(n.op_type, 60)}, which is not an "
                              f"ONNX op at default-domain opset {opset} (onnxruntime contrib ops fuselm maps: "
                              f"{', '.join(ORT_ONNX_DOMAIN_CONTRIB)} and the {ORT_DOMAIN} ops in "
                              "passes/from_genai.py); export the model with torch.onnx or `fuselm convert`")
        held.append(n.name)
    if not held and not any(n.domain == ORT_DOMAIN for n in model.graph.node):
        return None
    view = _weights_as_inputs(model)
    for n in view.graph.node:
        if n.domain in ("", "ai.onnx") and n.op_type in ORT_ONNX_DOMAIN_CONTRIB:
            n.domain = ORT_DOMAIN
    if ORT_DOMAIN not in {o.domain for o in view.opset_import}:
        view.opset_import.append(helper.make_opsetid(ORT_DOMAIN, 1))
    return view


def _weights_as_inputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose weights are typed inputs (the data file was checked above, and a proto's external
    paths would resolve against the working directory; small inline constants such as Reshape targets
    stay, so shapes infer), without the stored value_info (the builder's contradicts its own
    Constant nodes, rank 0 for [1]: inferred afresh)."""
    view = onnx.ModelProto()
    view.CopyFrom(model)
    del view.graph.value_info[:]
    names = {i.name for i in view.graph.input}
    small = [t for t in view.graph.initializer if t.data_location != TensorProto.EXTERNAL and math.prod(t.dims) <= 4096]
    kept = {t.name for t in small}
    view.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                            for t in view.graph.initializer if t.name not in names and t.name not in kept)
    del view.graph.initializer[:]
    view.graph.initializer.extend(small)
    return view


def _check_in_onnxruntime(model: onnx.ModelProto, path: Path) -> None:
    """onnx.checker knows no schema of onnxruntime's contrib ops: onnxruntime itself loads the graph
    (its schemas: attributes, input types, shape inference) and finds a CPU kernel for every node.
    The weights are typed inputs there, so nothing is read."""
    from .reference import ort_session

    try:
        ort_session(_weights_as_inputs(model))
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FuselmError(f"{path}: onnxruntime rejects the graph's contrib ops: {shown(first, 300)}; {_FIX}") from None


def _check_functions(model: onnx.ModelProto, path: Path) -> None:
    """A model-local function of the fuselm domain must be fuselm's own definition (fuselm/contract.py), in
    the form the graph's nodes use (FusedRoPE: rotary layout, [B,S,H·D] inputs, norm weight): the runtime
    runs its kernel for the op while onnxruntime and Netron read the body, so a different body would make
    them compute different things."""
    try:
        form = contract.rope_form(model.graph.node)
    except FuselmError as e:
        raise FuselmError(f"{path}: {e}") from None
    try:
        moe = contract.moe_form(model.graph.node)
    except FuselmError as e:
        raise FuselmError(f"{path}: {e}") from None
    forms = [form] if form is not None else \
        [contract.RopeForm(*f) for f in itertools.product((False, True), repeat=3)]
    canonical = {contract.ROPE_OP: [contract.fused_rope_function(f.interleaved, f.heads, f.normed) for f in forms],
                 contract.SWIGLU_OP: [contract.swiglu_function()],
                 contract.LATENT_OP: [contract.latent_attention_function()],
                 contract.MOE_OP: [contract.moe_function(f.activation, f.scoring, f.biased, f.selection_bias)
                                   for f in ([moe] if moe is not None else contract.moe_forms())],
                 **{op: [make()] for op, make in contract.STATE_FUNCTIONS.items()}}
    for protos in canonical.values():
        for proto in protos:
            proto.doc_string = ""
    for f in model.functions:
        if f.domain != contract.DOMAIN:
            continue
        given = onnx.FunctionProto()
        given.CopyFrom(f)
        given.doc_string = ""
        if all(given != proto for proto in canonical.get(f.name, [])):
            raise FuselmError(f"{path}: the model-local function {contract.DOMAIN}::{shown(f.name, 60)} is not "
                              f"fuselm's definition of that op (domain version {contract.DOMAIN_VERSION}) for the "
                              f"form this graph's nodes use; a runtime would compute something else than its body; "
                              f"{_FIX}")


def _check_ops(model: onnx.ModelProto, path: Path) -> None:
    """What onnx.checker does not check: fuselm::FusedRoPE's attributes (DESIGN.md: inv_freq finite,
    rotary_dim = 2·len(inv_freq) <= head_dim), and Attention's head counts against 4-D inputs."""
    shapes = {v.name: v.type.tensor_type.shape for v in [*model.graph.value_info, *model.graph.input]}
    weights = {t.name: list(t.dims) for t in model.graph.initializer}

    def static_dim(name: str, axis: int) -> int | None:
        dims = shapes[name].dim if name in shapes else []
        return dims[axis].dim_value if len(dims) == 4 and dims[axis].HasField("dim_value") else None

    for n in model.graph.node:
        if n.domain in ("", "ai.onnx") and n.op_type == "DequantizeLinear":
            _check_blocked(n, weights, path)
        if n.domain in ("", "ai.onnx") and n.op_type == "Attention":
            attrs = {a.name: a.i for a in n.attribute if a.name in ("q_num_heads", "kv_num_heads")}
            for attr, x in (("q_num_heads", 0), ("kv_num_heads", 1)):
                heads = static_dim(n.input[x], 1) if len(n.input) > x else None
                if attr in attrs and heads is not None and attrs[attr] != heads:
                    raise FuselmError(f"{path}: node {shown(n.name, 80)} (Attention): {attr} = {attrs[attr]}, but its "
                                      f"input has {heads} heads; {_FIX}")
        if n.domain != contract.DOMAIN or n.op_type != contract.ROPE_OP:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        inv = attrs.get("inv_freq")
        problem = None
        if not isinstance(inv, list) or not inv or not all(math.isfinite(f) for f in inv):
            problem = "inv_freq is missing, empty or not finite"
        elif attrs.get("interleaved", 0) not in (0, 1) or not math.isfinite(attrs.get("attention_scaling", 1.0)):
            problem = "interleaved is not 0/1 or attention_scaling is not finite"
        elif not isinstance(attrs.get("num_heads", 0), int) or attrs.get("num_heads", 0) < 0 or \
                not attrs.get("epsilon", contract.RMS_EPSILON) > 0:
            problem = "num_heads is negative or epsilon is not a positive number"
        else:
            dims = shapes[n.input[0]].dim if n.input[0] in shapes else []
            heads = attrs.get("num_heads", 0)
            width = dims[-1].dim_value if dims and dims[-1].HasField("dim_value") else None
            head_dim = width // heads if width is not None and heads else width
            weight = weights.get(n.input[2]) if len(n.input) > 2 and n.input[2] else None
            if heads and (len(dims) not in (0, 3) or (width is not None and width % heads)):
                problem = f"num_heads = {heads}, but its input is not [B, S, heads·D] (shape {[d.dim_value for d in dims]})"
            elif not heads and len(dims) not in (0, 4):
                problem = f"its input has rank {len(dims)}: [B, S, H, D], or [B, S, H·D] with num_heads"
            elif head_dim is not None and 2 * len(inv) > head_dim:
                problem = f"rotary dim 2*{len(inv)} exceeds the head dim {head_dim} of its input"
            elif weight is not None and head_dim is not None and weight != [head_dim]:
                problem = f"its norm weight has shape {weight}, not [{head_dim}] (the head dim)"
        if problem:
            raise FuselmError(f"{path}: node {shown(n.name, 80)} (fuselm::FusedRoPE): {problem}; {_FIX}")


def _check_blocked(n: onnx.NodeProto, weights: dict[str, list[int]], path: Path) -> None:
    """Blocked DequantizeLinear on constant weights: scales (and zero points) hold ceil(D / block_size)
    rows along the axis, as the ONNX spec and onnxruntime require; a runtime that folds it into a
    quantized matmul would otherwise read the wrong scale for most blocks."""
    attrs = {a.name: a.i for a in n.attribute if a.name in ("axis", "block_size")}
    block = attrs.get("block_size", 0)
    x, scale = (weights.get(i) for i in (list(n.input) + [""])[:2])
    if block < 0 or (block and x is not None and scale is not None and not _blocks_fit(x, scale, attrs.get("axis", 1), block)):
        raise FuselmError(f"{path}: node {shown(n.name, 80)} (DequantizeLinear): scale shape {scale} does not hold "
                          f"the blocks of {x} (block_size {block}, axis {attrs.get('axis', 1)}); {_FIX}")
    zero = weights.get(n.input[2]) if len(n.input) > 2 and n.input[2] else None
    if zero is not None and scale is not None and zero != scale:
        raise FuselmError(f"{path}: node {shown(n.name, 80)} (DequantizeLinear): zero point shape {zero} differs from "
                          f"the scale shape {scale}; {_FIX}")


def _blocks_fit(x: list[int], scale: list[int], axis: int, block: int) -> bool:
    if len(x) != len(scale) or not -len(x) <= axis < len(x):
        return False
    axis %= len(x)
    return all(s == (-(-d // block) if i == axis else d) for i, (d, s) in enumerate(zip(x, scale, strict=True)))


def _check_text(message, path: Path) -> None:
    """Every string field is text: protobuf hands invalid UTF-8 (a damaged name or data location)
    back as bytes, which later code would trip over."""
    for field, value in message.ListFields():
        if field.type not in (field.TYPE_STRING, field.TYPE_MESSAGE):
            continue
        for v in (value if field.is_repeated else [value]):
            if field.type == field.TYPE_MESSAGE:
                _check_text(v, path)
            elif not isinstance(v, str):
                raise FuselmError(f"{path}: a {field.full_name} field is not valid UTF-8 ({shown(v)}); the file is "
                                  f"damaged; {_FIX}")


def _tensors(model: onnx.ModelProto) -> Iterator[TensorProto]:
    """Every tensor stored in the model: initializers and constant attributes, subgraphs and functions too."""
    def graph(g: onnx.GraphProto):
        yield from g.initializer
        for sparse in g.sparse_initializer:
            yield sparse.values
            yield sparse.indices
        yield from nodes(g.node)

    def nodes(ns):
        for n in ns:
            for a in n.attribute:
                if a.type == AttributeProto.TENSOR:
                    yield a.t
                elif a.type == AttributeProto.TENSORS:
                    yield from a.tensors
                elif a.type == AttributeProto.GRAPH:
                    yield from graph(a.g)
                elif a.type == AttributeProto.GRAPHS:
                    for g in a.graphs:
                        yield from graph(g)

    yield from graph(model.graph)
    for f in model.functions:
        yield from nodes(f.node)


def _check_tensor(t: TensorProto, base: Path, files: dict[Path, int]) -> None:
    name = shown(t.name, 80)
    if t.data_type == TensorProto.UNDEFINED or t.data_type not in helper.get_all_tensor_dtypes():
        raise FuselmError(f"tensor {name}: element type {t.data_type} is not an ONNX type; {_FIX}")
    if any(d < 0 for d in t.dims):
        raise FuselmError(f"tensor {name}: negative dimension in shape {list(t.dims)}; {_FIX}")
    count = math.prod(t.dims)
    if t.data_type == TensorProto.STRING:
        if t.data_location == TensorProto.EXTERNAL or len(t.string_data) != count:
            raise FuselmError(f"tensor {name}: {len(t.string_data)} strings for shape {list(t.dims)}; {_FIX}")
        return
    itemsize = helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    nbytes = -(-count // 2) if t.data_type in _FOUR_BIT else count * itemsize
    if t.data_location == TensorProto.EXTERNAL:
        _check_external(t, name, nbytes, base, files)
    elif t.raw_data:
        if len(t.raw_data) != nbytes:
            raise FuselmError(f"tensor {name}: {len(t.raw_data)} bytes of data for shape {list(t.dims)} "
                              f"({helper.tensor_dtype_to_string(t.data_type)}, {nbytes} bytes); {_FIX}")
    else:
        field = helper.tensor_dtype_to_field(t.data_type)
        stored = len(getattr(t, field))
        allowed = {count, -(-count // 2), 2 * count} if count else {0}  # 4-bit packed, complex pairs
        if stored not in allowed:
            raise FuselmError(f"tensor {name}: {stored} values for shape {list(t.dims)} "
                              f"({helper.tensor_dtype_to_string(t.data_type)}); {_FIX}")


def _check_external(t: TensorProto, name: str, nbytes: int, base: Path, files: dict[Path, int]) -> None:
    info = {e.key: e.value for e in t.external_data}
    unknown = sorted(set(info) - {"location", "offset", "length", "checksum"})  # the keys ONNX defines
    if unknown:
        raise FuselmError(f"tensor {name}: unknown external data key {shown(unknown[0])} (a damaged 'offset'/'length' "
                          f"would silently read other bytes); {_FIX}")
    location = info.get("location", "")
    if not location:
        raise FuselmError(f"tensor {name}: external data without a location; {_FIX}")
    if os.path.isabs(location) or ".." in Path(location).parts:
        raise FuselmError(f"tensor {name}: external data location {shown(location, 120)} leaves the model directory; "
                          "refusing to read it (keep the data file beside model.onnx)")
    numbers = {}
    for key in ("offset", "length"):
        value = info.get(key, "0" if key == "offset" else None)
        if value is not None and not (value.isascii() and value.isdigit()):
            raise FuselmError(f"tensor {name}: external data {key} {shown(value)} is not a byte count; {_FIX}")
        numbers[key] = None if value is None else int(value)
    path = base / location
    real, root = path.resolve(), base.resolve()
    if root not in real.parents:
        raise FuselmError(f"tensor {name}: external data {shown(location, 120)} resolves to {real}, outside the model "
                          "directory (a symlink?); refusing to read it (copy the file into the directory)")
    if real not in files:
        if not real.is_file():
            raise FuselmError(f"tensor {name}: external data file {path} is missing; copy the whole model directory "
                              "(model.onnx and its data file belong together)")
        files[real] = real.stat().st_size
    length = numbers["length"] if numbers["length"] is not None else nbytes
    if length != nbytes:  # as onnxruntime: a length that disagrees with the shape means a damaged file
        raise FuselmError(f"tensor {name}: external data length {length} does not match its shape {list(t.dims)} "
                          f"({helper.tensor_dtype_to_string(t.data_type)}, {nbytes} bytes); {_FIX}")
    if numbers["offset"] + length > files[real]:
        raise FuselmError(f"tensor {name}: {location} is {files[real]} bytes, but the tensor needs bytes "
                          f"{numbers['offset']}..{numbers['offset'] + length}; the file is truncated or the shape "
                          f"is wrong; {_FIX}")


def _check_dag(g: onnx.GraphProto, path: Path) -> None:
    """Main graph only (subgraphs may read outer values): every input produced once, no cycle."""
    names = [n.name for n in g.node if n.name]
    if len(set(names)) != len(names):  # onnxruntime refuses such a graph too
        twice = next(x for x in names if names.count(x) > 1)
        raise FuselmError(f"{path}: two nodes are named {shown(twice, 80)}; node names must be unique; {_FIX}")
    produced: dict[str, int] = {}
    known = {i.name for i in g.input} | {t.name for t in g.initializer} | \
        {s.values.name for s in g.sparse_initializer}
    for i, n in enumerate(g.node):
        for o in n.output:
            if not o:
                continue
            if o in produced or o in known:
                raise FuselmError(f"{path}: value {shown(o, 80)} is produced twice (node {shown(n.name, 80)}); "
                                  f"a graph assigns each value once; {_FIX}")
            produced[o] = i
    waiting = [0] * len(g.node)
    users: dict[int, list[int]] = {}
    for i, n in enumerate(g.node):
        for x in dict.fromkeys(x for x in n.input if x):
            if x in produced:
                waiting[i] += 1
                users.setdefault(produced[x], []).append(i)
            elif x not in known:
                raise FuselmError(f"{path}: node {shown(n.name, 80)} ({n.op_type}) reads {shown(x, 80)}, which no node, "
                                  f"input or initializer provides (a dangling input); {_FIX}")
    for o in g.output:
        if o.name not in produced and o.name not in known:
            raise FuselmError(f"{path}: graph output {shown(o.name, 80)} is not produced by any node; {_FIX}")
    ready = [i for i, w in enumerate(waiting) if w == 0]
    done = 0
    while ready:  # Kahn's algorithm: what never becomes ready sits on a cycle
        i = ready.pop()
        done += 1
        for u in users.get(i, ()):
            waiting[u] -= 1
            if waiting[u] == 0:
                ready.append(u)
    if done < len(g.node):
        stuck = next(n for i, n in enumerate(g.node) if waiting[i])
        raise FuselmError(f"{path}: the graph has a cycle (node {shown(stuck.name, 80)}, {stuck.op_type}, depends on "
                          f"its own output); a graph must be acyclic; {_FIX}")
