"""FoldQuantizedWeights: blocked DequantizeLinear weights become the backend's own quantized matmuls, prepared once."""

from __future__ import annotations

from fuselm.passes.stats import Stats
from onnx import TensorProto

from fuselm import contract

from ..graph import Graph, Node, drop_unread, values
from ..loader import Packed4
from ..ops_nn import RUNTIME
from ..prepared import PreparedStore
from .base import Load, Rewrite


class FoldQuantizedWeights(Rewrite):
    """The graph contract's quantized weights, as the backend runs them (its quantized matmul kernels):
    - DQ(const) -> MatMul(x, DQ), and MatMul(x, Transpose(DQ)) of a table stored [out, in] with blocks along `in`
      (a tied lm_head sharing the embedding's quantized table), become QMatMul;
    - DQ(const) -> Gather(DQ, ids, axis 0) becomes QGather (a 4-bit table gathered from its packed rows), or
      QGatherRows on the lm_head's prepared weight where the table is tied and the backend gathers that kind;
    - fuselm::MoE with constant 3-D blocked DQ experts along the input dim becomes QMoE, experts prepared once.
    No dequantized copy of a weight is made: a 4-bit weight is unpacked only while it is prepared, and the mapped
    pages read for it are given back once the backend holds its own copy. Weights the prepared store holds from an
    earlier load (runtime_metal/prepared.py) are taken as they are, unread.

    Must not fire: a DQ that is not constant, whose output is a graph output, with no block size, signed or
    other data than uint4/uint8, an output dtype other than float, or blocks along the wrong axis for its reader.
    Skipped, the DequantizeLinear nodes run as ops (FoldConstants dequantizes constant ones once, on the host)."""

    aliases = ("quantized-weights", "qmatmul")

    def apply(self, graph: Graph, load: Load, stats: Stats) -> bool:
        store = PreparedStore(load.backend, load.path) if load.path is not None else None
        try:
            _matmuls(graph, load.backend, load, store, stats)
            _experts(graph, load.backend, load, store, stats)
            if store is not None:
                store.commit()
        finally:
            if store is not None:
                store.close()
        graph.prepared = store.describe() if store is not None else "off"
        return bool(stats.fired)


def _matmuls(graph: Graph, backend, load: Load, store, stats: Stats) -> None:
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
                q, scale, zp = (values(t) for t in (q, scale, zp))
                if rows:  # [out, in] blocks along in = the [in, out] weight with blocks along axis 0
                    q, scale, zp = q.T, scale.T, (zp.T if zp is not None else None)
                prepared[key] = backend.prepare_quantized(q, scale, zp, block, bits)
                if store is not None:
                    store.put(key, prepared[key])
                del q, scale, zp
                load.release()
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
    for n in graph.nodes:
        if id(n) in replace:
            stats.counts[replace[id(n)].op_type] += 1
            stats.fire(n.name)
    nodes = [replace.get(id(n), n) for n in graph.nodes]
    graph.nodes = drop_unread(nodes, graph.outputs, lambda n: n.key in (("", "DequantizeLinear"), ("", "Transpose")))


def _experts(graph: Graph, backend, load: Load, store, stats: Stats) -> None:
    producers = {o: n for n in graph.nodes for o in n.outputs}
    consts = graph.constants
    prepared: dict[str, object] = {}
    replace = {}
    for n in graph.nodes:
        if n.key != (contract.DOMAIN, contract.MOE_OP) or len(n.inputs) not in (4, 5, 8):
            continue
        dqs = [producers.get(w) for w in n.inputs[2:4]]
        if not all(_foldable(dq, consts, graph) for dq in dqs):
            continue
        for w, dq in zip(n.inputs[2:4], dqs, strict=True):
            key = f"{w}#experts"
            if w not in prepared and store is not None and store.get(key) is not None:
                prepared[w] = store.get(key)
            if w not in prepared:
                q, scale = values(consts[dq.inputs[0]]), consts[dq.inputs[1]]
                zp = values(consts[dq.inputs[2]]) if len(dq.inputs) > 2 and dq.inputs[2] else None
                bits = 4 if graph.elem_types.get(dq.inputs[0]) in (TensorProto.UINT4, TensorProto.INT4) else 8
                prepared[w] = backend.prepare_experts(q, scale, zp, int(dq.attrs["block_size"]), bits)
                if store is not None:
                    store.put(key, prepared[w])
                del q, scale, zp
                load.release()
        replace[id(n)] = Node("QMoE", RUNTIME, n.name, n.inputs[:2] + n.inputs[4:], n.outputs,
                              {**n.attrs, "gate_up": prepared[n.inputs[2]], "down": prepared[n.inputs[3]],
                               "source": dqs[0].name})
    for n in graph.nodes:
        if id(n) in replace:
            stats.counts["QMoE"] += 1
            stats.fire(n.name)
    if replace:
        nodes = [replace.get(id(n), n) for n in graph.nodes]
        graph.nodes = drop_unread(nodes, graph.outputs, lambda n: n.key == ("", "DequantizeLinear"))


def _foldable(dq, consts, graph) -> bool:
    return (dq is not None and dq.key == ("", "DequantizeLinear") and dq.outputs[0] not in graph.outputs
            and all(x in consts for x in dq.inputs if x) and int(dq.attrs.get("block_size", 0)) > 0
            and int(dq.attrs.get("axis", 1)) in (2, -1) and consts[dq.inputs[0]].ndim == 3
            and dq.attrs.get("output_dtype", 0) in (0, 1))


