"""The graph as the executor runs it: plain Python nodes, converted once from the ONNX graph at load.

Model-local functions (fuselm::FusedRoPE, MoE, SwiGLU, LatentAttention) stay one node when the op table has a fused kernel;
otherwise, or with `fused=False`, their FunctionProto body is inlined. Everything else a load does to the graph
is a rewrite of its own (runtime_metal/rewrites/: listed, skippable, shown by `fuselm diff --target mlx`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import AttributeProto, helper

from fuselm.errors import FuselmError

# (they register the nn ops, fuselm::MoE, LatentAttention and the recurrent-state ops into OPS)
from . import ops_latent, ops_moe, ops_nn, ops_state  # noqa: F401
from .loader import LoadedModel, Packed4, tensor_to_array
from .ops import OPS


@dataclass
class Node:
    op_type: str
    domain: str
    name: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict = field(default_factory=dict)
    branches: dict[str, Branch] = field(default_factory=dict)  # If: then_branch / else_branch

    @property
    def key(self) -> tuple[str, str]:
        return (self.domain, self.op_type)


@dataclass
class Branch:
    nodes: list[Node]
    outputs: list[str]
    constants: dict[str, np.ndarray]


@dataclass
class Graph:
    nodes: list[Node]
    constants: dict[str, np.ndarray]
    inputs: list[str]
    outputs: list[str]
    opsets: dict[str, int]
    elem_types: dict[str, int] = field(default_factory=dict)  # declared ONNX types of the initializers
    prepared: str = "off"  # where the backend's prepared weights came from (runtime_metal/prepared.py)
    rewrites: list = field(default_factory=list)  # what each load-time rewrite did (runtime_metal/rewrites/)


def attr_value(a: AttributeProto):
    if a.type == AttributeProto.TENSOR:
        return tensor_to_array(a.t)
    if a.type == AttributeProto.GRAPH:
        return a.g
    v = helper.get_attribute_value(a)
    if a.type == AttributeProto.STRING:
        return v.decode()
    if a.type == AttributeProto.FLOATS:
        return np.asarray(v, np.float32)  # one array per node: kernels can memoize on identity
    if a.type == AttributeProto.INTS:
        return list(v)
    if a.type == AttributeProto.STRINGS:
        return [s.decode() for s in v]
    return v


def _nodes(protos, functions, fused: bool, prefix: str = "") -> tuple[list[Node], dict[str, np.ndarray]]:
    """Convert NodeProtos; inline model-local functions that will not run as a fused kernel."""
    out, consts = [], {}
    for p in protos:
        attrs = {a.name: attr_value(a) for a in p.attribute if a.type != AttributeProto.GRAPH}
        node = Node(p.op_type, p.domain if p.domain != "ai.onnx" else "", p.name or f"{prefix}{p.op_type}_{len(out)}",
                    list(p.input), list(p.output), attrs)
        for a in p.attribute:
            if a.type == AttributeProto.GRAPH:
                sub, sub_consts = _nodes(a.g.node, functions, fused, prefix)
                sub_consts.update({t.name: tensor_to_array(t) for t in a.g.initializer})
                node.branches[a.name] = Branch(sub, [o.name for o in a.g.output], sub_consts)
        spec = OPS.get(node.key)
        if node.key in functions and (spec is None or (spec.fused and not fused)):
            body, body_consts = _inline(node, p, functions[node.key], functions, fused)
            out += body
            consts.update(body_consts)
        else:
            out.append(node)
    return out, consts


_uid = itertools.count()


def _inline(node: Node, proto: onnx.NodeProto, f: onnx.FunctionProto, functions, fused: bool):
    """A function call as its body: formal names renamed into the caller's, attribute refs resolved."""
    tag = f"{node.name}/{f.name}#{next(_uid)}/"
    rename = dict(zip(f.input, proto.input, strict=False))
    rename.update(zip(f.output, proto.output, strict=False))
    given = {a.name: a for a in proto.attribute}
    defaults = {a.name: a for a in f.attribute_proto}

    def resolve(nodes: list) -> list:
        resolved = []
        for n in nodes:
            n2 = onnx.NodeProto()
            n2.CopyFrom(n)
            del n2.attribute[:]
            for a in n.attribute:
                if a.ref_attr_name:
                    src = given.get(a.ref_attr_name) or defaults.get(a.ref_attr_name)
                    if src is None:
                        continue
                    a2 = AttributeProto()
                    a2.CopyFrom(src)
                    a2.name = a.name
                    n2.attribute.append(a2)
                elif a.type == AttributeProto.GRAPH:
                    a2 = AttributeProto()
                    a2.CopyFrom(a)
                    del a2.g.node[:]
                    a2.g.node.extend(resolve(a.g.node))
                    n2.attribute.append(a2)
                else:
                    n2.attribute.append(a)
            resolved.append(n2)
        return resolved

    body, consts = _nodes(resolve(f.node), functions, fused, prefix=tag)

    def name(x: str) -> str:
        return x if not x else rename.get(x, tag + x)

    def apply(nodes: list[Node]):
        for n in nodes:
            n.name = tag + n.name
            n.inputs = [name(x) for x in n.inputs]
            n.outputs = [name(x) for x in n.outputs]
            for br in n.branches.values():
                apply(br.nodes)
                br.outputs = [name(x) for x in br.outputs]

    apply(body)
    return body, {name(k): v for k, v in consts.items()}


def from_model(lm: LoadedModel, fused: bool = True) -> Graph:
    """The executor's graph of a loaded model: its nodes (functions inlined where no fused kernel runs them) and
    constants; no rewrite yet (runtime_metal/rewrites/ prepare)."""
    nodes, consts = _nodes(lm.graph.node, lm.functions, fused)
    consts.update(lm.initializers)
    inputs = [i.name for i in lm.graph.input if i.name not in lm.initializers]
    graph = Graph(nodes, consts, inputs, list(lm.output_names), lm.opsets,
                  {t.name: t.data_type for t in lm.graph.initializer})
    check_ops(graph.nodes, graph.opsets)
    return graph


def check_ops(nodes: list[Node], opsets: dict[str, int]) -> None:
    for n in nodes:
        if n.op_type == "If" and not n.domain:
            for br in n.branches.values():
                check_ops(br.nodes, opsets)
        elif n.key not in OPS:
            domain = n.domain or "ai.onnx"
            raise FuselmError(f"node {n.name!r}: op {domain}::{n.op_type} (opset {opsets.get(n.domain, '?')}) is not "
                              "supported by the fuselm runtime; run the graph in onnxruntime, or add the op to "
                              "runtime_metal/ops.py")


def values(v):
    """A constant's values (a packed 4-bit one unpacked)."""
    return v.unpack() if isinstance(v, Packed4) else v


def drop_unread(nodes: list[Node], outputs: list[str], droppable) -> list[Node]:
    """Remove `droppable` nodes whose outputs nobody reads (repeated: a DQ read only by a dead Transpose)."""
    while True:
        read = set(outputs)
        for n in nodes:
            read.update(reads(n))
        kept = [n for n in nodes if not droppable(n) or any(o in read for o in n.outputs)]
        if len(kept) == len(nodes):
            return kept
        nodes = kept


def reads(n: Node):
    """Every value name node `n` reads (an If reads what its branches read)."""
    yield from n.inputs
    for br in n.branches.values():
        yield from br.outputs
        for sub in br.nodes:
            yield from reads(sub)


def unpack_or_drop_packed(graph: Graph) -> None:
    """Constants nobody reads any more are dropped (a folded weight's source); a 4-bit constant that
    a node still reads as values (a DequantizeLinear the folds left) is unpacked for it."""
    read = set(graph.outputs)
    for n in graph.nodes:
        read.update(reads(n))
    for name in list(graph.constants):
        if name not in read:
            del graph.constants[name]
        elif isinstance(graph.constants[name], Packed4):
            graph.constants[name] = graph.constants[name].unpack()


def call(spec, backend, node: Node, args: list, ctx: dict | None = None) -> tuple:
    """Call an op function with the node's attributes; always returns a tuple of outputs."""
    kwargs = dict(node.attrs)
    if spec.wants_outputs:
        kwargs["_n_outputs"] = len(node.outputs)
    if spec.wants_context:
        kwargs["_ctx"] = ctx
    while args and args[-1] is None:
        args = args[:-1]
    try:
        out = spec.fn(backend, *args, **kwargs)
    except TypeError as e:
        if e.__traceback__ is not None and e.__traceback__.tb_next is None:  # the call's binding failed
            raise FuselmError(f"node {node.name!r} ({node.op_type}): {e}; the runtime does not support this form "
                              "of the op") from None
        raise
    return out if isinstance(out, tuple) else (out,)
