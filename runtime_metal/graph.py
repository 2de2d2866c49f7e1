"""The graph as the executor runs it: plain Python nodes, rewritten once at load.

Load-time rewrites (each keeps what the graph computes):
- model-local functions (fuselm::FusedRoPE) stay one node when the op table has a fused kernel;
  otherwise, or with `fused=False`, their FunctionProto body is inlined;
- DequantizeLinear -> MatMul with constant weights becomes QMatMul (the backend's quantized
  matmul, weights converted once); DequantizeLinear -> Gather(axis 0) becomes QGather;
- Concat(past_key_values.i.*, new, axis=2) becomes KVAppend (writes into the preallocated cache);
- the lm_head's input passes through LastRows, so a prefill chunk computes the logits of its last
  position only, unless the run asks for all of them (ctx["all_logits"]);
- nodes whose inputs are all constants are folded on the host;
- Attention nodes whose mask is a causal band under the session's plain feeds get `causal_rows`
  (mask_kind.py), so a backend can read only the filled rows of the cache; for such a backend, a
  layer's q/k norms and RoPE run over every head of the fused QKV output at once (qkv_heads.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper

from fuselm import contract
from fuselm.errors import FuselmError

from . import ops_moe, ops_nn  # noqa: F401 - they register the nn ops and fuselm::MoE into OPS
from .backends.numpy_backend import NumpyBackend
from .loader import LoadedModel, Packed4, tensor_to_array
from .ops import OPS
from .ops_nn import RUNTIME
from .prepared import PreparedStore

SUBGRAPH_OPS = ("If",)


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


def build(lm: LoadedModel, backend, fused: bool = True) -> Graph:
    """The executable graph for `backend`: functions handled, load-time rewrites applied."""
    nodes, consts = _nodes(lm.graph.node, lm.functions, fused)
    consts.update(lm.initializers)
    inputs = [i.name for i in lm.graph.input if i.name not in lm.initializers]
    graph = Graph(nodes, consts, inputs, list(lm.output_names), lm.opsets,
                  {t.name: t.data_type for t in lm.graph.initializer})
    check_ops(graph.nodes, graph.opsets)
    _bypass_identity(graph)
    store = PreparedStore(backend, lm.path)
    try:
        _fold_dequantize(graph, backend, lm.release_pages, store)
        ops_moe.fold_experts(graph, backend, lm.release_pages, store)
        store.commit()
    finally:
        store.close()
    graph.prepared = store.describe()
    _unpack_or_drop_packed(graph)
    lm.release_pages()
    _kv_append(graph)
    _fold_constants(graph)
    _last_rows(graph)
    from . import mask_kind, qkv_heads

    if backend.causal_reads and fused:
        qkv_heads.rewrite(graph)
    mask_kind.classify(graph, (lm.meta or {}).get("sliding_window"))
    return graph


def check_ops(nodes: list[Node], opsets: dict[str, int]) -> None:
    for n in nodes:
        if n.op_type in SUBGRAPH_OPS and not n.domain:
            for br in n.branches.values():
                check_ops(br.nodes, opsets)
        elif n.key not in OPS:
            domain = n.domain or "ai.onnx"
            raise FuselmError(f"node {n.name!r}: op {domain}::{n.op_type} (opset {opsets.get(n.domain, '?')}) is not "
                              "supported by the fuselm runtime; run the graph in onnxruntime, or add the op to "
                              "runtime_metal/ops.py")


def _fold_dequantize(graph: Graph, backend, release=lambda: None, store: PreparedStore | None = None) -> None:
    """DQ(const) -> MatMul(x, DQ) becomes QMatMul; so does MatMul(x, Transpose(DQ)) of a table stored
    [out, in] with blocks along `in` (a tied lm_head sharing the embedding's quantized table);
    DQ(const) -> Gather(DQ, ids, axis 0) becomes QGather (a 4-bit table gathered from its packed rows), or
    QGatherRows on the lm_head's prepared weight where the table is tied and the backend gathers that kind.
    No dequantized copy of a weight is made: a 4-bit weight is unpacked only while it is prepared,
    and `release()` drops the mapped pages read for it once the backend holds its own copy. Weights the
    `store` holds from an earlier load (runtime_metal/prepared.py) are taken as they are, unread."""
    producers = {o: n for n in graph.nodes for o in n.outputs}
    consts = graph.constants
    prepared: dict[str, object] = {}
    replace: dict[int, Node] = {}
    # tables a MatMul also reads through a Transpose (a tied lm_head): their embedding gathers from its weight
    tied = {t.inputs[0] for t in graph.nodes if t.key == ("", "Transpose") and t.inputs and
            getattr(producers.get(t.inputs[0]), "key", None) == ("", "DequantizeLinear")}
    for n in graph.nodes:
        if n.key not in (("", "MatMul"), ("", "Gather")) or len(n.inputs) < 2:
            continue
        w = n.inputs[1] if n.op_type == "MatMul" else n.inputs[0]
        dq, transposed = producers.get(w), False
        if n.op_type == "MatMul" and dq is not None and dq.key == ("", "Transpose") and \
                list(dq.attrs.get("perm", [1, 0])) == [1, 0] and dq.outputs[0] not in graph.outputs:
            dq, transposed = producers.get(dq.inputs[0]), True
        if dq is None or dq.key != ("", "DequantizeLinear") or w in graph.outputs or dq.outputs[0] in graph.outputs:
            continue
        if not all(x in consts for x in dq.inputs if x):
            continue
        q, scale = consts[dq.inputs[0]], consts[dq.inputs[1]]
        zp = consts[dq.inputs[2]] if len(dq.inputs) > 2 and dq.inputs[2] else None
        block, axis = int(dq.attrs.get("block_size", 0)), int(dq.attrs.get("axis", 1))
        if q.ndim != 2 or not block or q.dtype.kind not in "u" or dq.attrs.get("output_dtype", 0) not in (0, 1):
            continue
        rows = axis in (1, -1) and (transposed or n.op_type == "Gather")  # the [N, K] table, blocks along K
        # a tied lm_head and the embedding share one prepared table: keyed by the table, not by the MatMul's input
        key = f"{dq.outputs[0]}#rows" if rows else w
        matmul = n.op_type == "MatMul" and axis in ((1, -1) if transposed else (0, -2))
        gather = n.op_type == "Gather" and int(n.attrs.get("axis", 0)) == 0
        on_head = gather and rows and backend.quantized_gather_kind is not None and dq.outputs[0] in tied
        if matmul or on_head:
            if key not in prepared and store is not None and store.get(key) is not None:
                prepared[key] = store.get(key)
            if key not in prepared:
                bits = 4 if graph.elem_types.get(dq.inputs[0]) in (TensorProto.UINT4, TensorProto.INT4) else 8
                q, scale, zp = (_values(t) for t in (q, scale, zp))
                if rows:  # [out, in] blocks along in = the [in, out] weight with blocks along axis 0
                    q, scale, zp = q.T, scale.T, (zp.T if zp is not None else None)
                prepared[key] = backend.prepare_quantized(q, scale, zp, block, bits)
                if store is not None:
                    store.put(key, prepared[key])
                del q, scale, zp
                release()
        if matmul:
            replace[id(n)] = Node("QMatMul", RUNTIME, n.name, [n.inputs[0]], n.outputs,
                                  {"weight": prepared[key], "source": dq.name})
        elif on_head and prepared[key].kind == backend.quantized_gather_kind:
            replace[id(n)] = Node("QGatherRows", RUNTIME, n.name, [n.inputs[1]], n.outputs,
                                  {"weight": prepared[key], "source": dq.name})
        elif gather:
            q = consts[dq.inputs[0]]
            table, packed = dq.inputs[0], 0
            if isinstance(q, Packed4) and q.rows is not None:  # gather packed rows, unpack only those
                table, packed = f"{table}#packed_rows", 1
                consts[table] = q.rows
            zp_name = dq.inputs[2] if len(dq.inputs) > 2 else ""
            replace[id(n)] = Node("QGather", RUNTIME, n.name, [table, dq.inputs[1], zp_name, n.inputs[1]], n.outputs,
                                  {"axis": 0 if axis in (0, -2) else 1, "block_size": block, "packed4": packed})
    nodes = [replace.get(id(n), n) for n in graph.nodes]
    graph.nodes = _drop_unread(nodes, graph.outputs, lambda n: n.key in (("", "DequantizeLinear"), ("", "Transpose")))


def _values(v):
    return v.unpack() if isinstance(v, Packed4) else v


def _drop_unread(nodes: list[Node], outputs: list[str], droppable) -> list[Node]:
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


def _unpack_or_drop_packed(graph: Graph) -> None:
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


def _bypass_identity(graph: Graph) -> None:
    """Consumers of Identity(x) read x directly (other exporters put one between a past input and its Concat)."""
    alias: dict[str, str] = {}
    kept = []
    for n in graph.nodes:
        n.inputs = [alias.get(x, x) for x in n.inputs]
        if n.key == ("", "Identity") and n.outputs[0] not in graph.outputs and n.inputs[0]:
            alias[n.outputs[0]] = n.inputs[0]
        else:
            kept.append(n)
    for n in kept:
        for br in n.branches.values():
            _rename_inputs(br, alias)
    graph.nodes = kept


def _rename_inputs(branch: Branch, alias: dict[str, str]) -> None:
    for n in branch.nodes:
        n.inputs = [alias.get(x, x) for x in n.inputs]
        for br in n.branches.values():
            _rename_inputs(br, alias)
    branch.outputs = [alias.get(x, x) for x in branch.outputs]


def _kv_append(graph: Graph) -> None:
    pasts = {x for x in graph.inputs if contract.is_past(x)}
    for i, n in enumerate(graph.nodes):
        if n.key == ("", "Concat") and len(n.inputs) == 2 and n.inputs[0] in pasts and n.attrs.get("axis") in (2, -2):
            graph.nodes[i] = Node("KVAppend", RUNTIME, n.name, list(n.inputs), list(n.outputs))


_LOGIT_TAIL = {"Mul", "Div", "Add", "Sub", "Tanh", "Cast", "Identity"}  # soft-capping, scaling, bias after the head


def _last_rows(graph: Graph) -> None:
    """Put LastRows on the input of the matmul that makes `logits` (through elementwise ops with constants)."""
    if contract.LOGITS not in graph.outputs:
        return
    producers = {o: n for n in graph.nodes for o in n.outputs}
    n = producers.get(contract.LOGITS)
    for _ in range(6):
        if n is None:
            return
        if n.key in (("", "MatMul"), (RUNTIME, "QMatMul")):
            break
        if n.domain or n.op_type not in _LOGIT_TAIL:
            return
        live = [x for x in n.inputs if x and x not in graph.constants]
        if len(live) != 1:
            return
        n = producers.get(live[0])
    else:
        return
    x = n.inputs[0]
    if not x or x in graph.constants:
        return
    last = x + "/last_rows"
    graph.nodes.insert(graph.nodes.index(n), Node("LastRows", RUNTIME, n.name + "/LastRows", [x], [last]))
    n.inputs = [last, *n.inputs[1:]]


def _fold_constants(graph: Graph) -> None:
    """Evaluate on the host every node whose inputs are all constants (once, at load)."""
    host = NumpyBackend()
    consts, kept = graph.constants, []
    for n in graph.nodes:
        spec = OPS.get(n.key)
        if spec is None or n.branches or n.domain == RUNTIME or spec.fused or spec.wants_context or \
                not all((x in consts) for x in n.inputs if x):
            kept.append(n)
            continue
        try:
            out = call(spec, host, n, [consts[x] if x else None for x in n.inputs])
        except NotImplementedError:
            kept.append(n)
            continue
        except FuselmError:
            raise
        except Exception as e:  # attributes the checker lets through (an axis out of range) fail here
            raise FuselmError(f"node {n.name!r} ({n.op_type}) fails on its constant inputs ({type(e).__name__}: "
                              f"{str(e)[:300]}); the graph is invalid, or uses the op in a form the runtime does "
                              "not support") from e
        for name, v in zip(n.outputs, out, strict=False):
            if name:
                consts[name] = np.asarray(v)
    graph.nodes = kept


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
