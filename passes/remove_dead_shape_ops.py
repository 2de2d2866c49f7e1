"""RemoveDeadShapeOp: fold constant shape arithmetic, drop no-op data movement and dead nodes."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_ir as ir

from .base import (
    SMALL_CONST,
    Pass,
    Stats,
    attr,
    const,
    initializer,
    input_at,
    is_external,
    producer,
    remove_unused,
    static_shape,
    take_over,
)

_INT_MAX_ISH = 2**62
_SMALL_FLOAT = 64


def _div(a, b):
    if np.issubdtype(np.asarray(a).dtype, np.integer):
        return np.trunc(np.true_divide(a, b)).astype(np.asarray(a).dtype)  # ONNX int Div truncates
    return np.divide(a, b)


def _slice(data, starts, ends, axes=None, steps=None):
    axes = range(len(starts)) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    index = [slice(None)] * data.ndim
    for s, e, a, st in zip(starts, ends, axes, steps, strict=False):
        index[int(a)] = slice(int(s), int(e), int(st))
    return data[tuple(index)]


def _reshape(data, shape, allowzero=0):
    shape = [data.shape[i] if (d == 0 and not allowzero) else int(d) for i, d in enumerate(shape)]
    return data.reshape(shape)


# numpy versions of the ops that compute shapes; each takes numpy inputs and the node.
FOLD = {
    "Identity": lambda n, x: x,
    "Cast": lambda n, x: x.astype(ir.DataType(attr(n, "to")).numpy()),
    "Reshape": lambda n, x, s: _reshape(x, s, attr(n, "allowzero", 0)),
    "Unsqueeze": lambda n, x, a: np.expand_dims(x, tuple(int(i) % (x.ndim + len(a)) for i in a)),
    "Squeeze": lambda n, x, a=None: np.squeeze(x, axis=None if a is None else tuple(int(i) for i in a)),
    "Concat": lambda n, *xs: np.concatenate(xs, axis=attr(n, "axis")),
    "Gather": lambda n, x, i: np.take(x, i, axis=attr(n, "axis", 0)),
    "Slice": lambda n, x, *args: _slice(x, *args),
    "Add": lambda n, a, b: a + b,
    "Sub": lambda n, a, b: a - b,
    "Mul": lambda n, a, b: a * b,
    "Div": lambda n, a, b: _div(a, b),
    "Max": lambda n, *xs: np.maximum.reduce(np.broadcast_arrays(*xs)),
    "Min": lambda n, *xs: np.minimum.reduce(np.broadcast_arrays(*xs)),
    "Neg": lambda n, x: -x,
    "Equal": lambda n, a, b: a == b,
    "Less": lambda n, a, b: a < b,
    "Greater": lambda n, a, b: a > b,
    "Not": lambda n, x: ~x,
    "And": lambda n, a, b: a & b,
    "Or": lambda n, a, b: a | b,
    "Where": lambda n, c, a, b: np.where(c, a, b),
    "Range": lambda n, s, lim, d: np.arange(s, lim, d, dtype=np.asarray(s).dtype),
    "Expand": lambda n, x, s: np.broadcast_to(x, np.broadcast_shapes(x.shape, tuple(int(d) for d in s))).copy(),
    "ConstantOfShape": lambda n, s: np.full(
        tuple(int(d) for d in s), attr(n, "value").numpy().reshape(()) if attr(n, "value") is not None else 0.0,
        dtype=attr(n, "value").numpy().dtype if attr(n, "value") is not None else np.float32),
}
# Ops merged when two nodes compute the same thing from the same inputs (shape bookkeeping only).
CSE_OPS = {"Shape", "Size", "Gather", "Unsqueeze", "Squeeze", "Concat", "Slice", "Cast", "Reshape", "Range",
           "Expand", "ConstantOfShape", "Equal", "Where", "Add", "Sub", "Mul", "Div", "Max", "Min", "Neg",
           "Identity"}
_INT_TYPES = {ir.DataType.INT64, ir.DataType.INT32, ir.DataType.BOOL}


class RemoveDeadShapeOp(Pass):
    """Remove shape-computation ops that reach no output and fold shape subgraphs that are constant.

    Rewrites, repeated until nothing changes:
    - `Constant` nodes become initializers;
    - a shape op whose inputs are all small constants (integer shape data, or floats of at most
      _SMALL_FLOAT elements) (or `Shape`/`Size` of a statically shaped
      value, or `Gather` of static dims from a partly dynamic `Shape`) is evaluated once and
      replaced by an initializer;
    - no-op data movement is bypassed: `Identity`, a one-input `Concat`, `Cast` to the same type, `Transpose` with the
      identity permutation, `Slice` over the whole tensor, `Reshape` to the same static shape,
      `Expand` by ones;
    - duplicate shape computations (same op, attributes and inputs) are merged, identical small
      initializers deduplicated;
    - nodes and initializers that reach no graph output are removed.
    Must not fire on: anything producing a graph output (the contract's names stay); constants
    larger than SMALL_CONST elements (weights are never read); ops outside the shape table
    (float math is left to the fusions).
    """

    aliases = ("remove-dead-shape-ops", "dead-shape", "shape")

    def apply(self, model: ir.Model, stats: Stats) -> bool:
        graph = model.graph
        before = Counter(n.op_type for n in graph)
        modified = False
        for _ in range(20):
            done = sum(stats.counts.values())  # each rewrite below counts itself
            self._lift_constants(graph, stats)
            self._bypass_noops(graph, stats)
            self._dedupe_initializers(graph, stats)
            self._fold(graph, stats)
            self._merge_duplicates(graph, stats)
            changed = remove_unused(model) > 0 or sum(stats.counts.values()) != done
            modified |= changed
            if not changed:
                break
        after = Counter(n.op_type for n in graph)
        removed = before - after
        stats.counts.update({f"removed {op}": n for op, n in removed.items()})
        if modified:
            stats.fire(f"{sum(before.values())} -> {sum(after.values())} nodes")
        return modified

    def _lift_constants(self, graph: ir.Graph, stats: Stats) -> None:
        for node in list(graph):
            if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or node.outputs[0].is_graph_output():
                continue
            array = const(node.outputs[0], max_size=1 << 62)
            if array is None:
                continue
            _replace_with_constant(graph, node.outputs[0], array)
            graph.remove(node, safe=True)
            stats.counts["constants lifted"] += 1

    def _bypass_noops(self, graph: ir.Graph, stats: Stats) -> None:
        for node in list(graph):
            if node.domain not in ("", "ai.onnx") or not node.inputs or node.inputs[0] is None:
                continue
            if len(node.outputs) != 1 or not _is_noop(node):
                continue
            out, inp = node.outputs[0], node.inputs[0]
            if out.is_graph_output() and (inp.is_graph_input() or inp.is_initializer() or inp.is_graph_output()):
                continue
            take_over(out, inp)
            graph.remove(node, safe=True)
            stats.counts[f"no-op {node.op_type} bypassed"] += 1

    def _dedupe_initializers(self, graph: ir.Graph, stats: Stats) -> None:
        seen: dict[tuple, ir.Value] = {}
        for value in list(graph.initializers.values()):
            t = value.const_value
            if t is None or t.size > SMALL_CONST or is_external(t) or value.is_graph_input() or value.is_graph_output():
                continue
            key = (t.dtype, tuple(t.shape.numpy()), t.tobytes())
            if key in seen:
                value.replace_all_uses_with(seen[key])
                graph.initializers.pop(value.name)
                stats.counts["duplicate constants merged"] += 1
            else:
                seen[key] = value

    def _fold(self, graph: ir.Graph, stats: Stats) -> None:
        for node in list(graph):
            if node.domain not in ("", "ai.onnx") or len(node.outputs) != 1 or node.outputs[0].is_graph_output():
                continue
            try:
                array = _evaluate(node)
            except Exception:  # a shape we cannot evaluate statically stays in the graph
                array = None
            if array is None or array.size > SMALL_CONST:
                continue
            _replace_with_constant(graph, node.outputs[0], np.asarray(array))
            graph.remove(node, safe=True)
            stats.counts[f"folded {node.op_type}"] += 1

    def _merge_duplicates(self, graph: ir.Graph, stats: Stats) -> None:
        seen: dict[tuple, ir.Node] = {}
        for node in list(graph):
            if node.op_type not in CSE_OPS or node.domain not in ("", "ai.onnx"):
                continue
            if node.op_type in ("Add", "Sub", "Mul", "Div") and node.outputs[0].dtype not in _INT_TYPES:
                continue
            if any(o.is_graph_output() for o in node.outputs):
                continue
            key = (node.op_type, tuple(id(v) for v in node.inputs),
                   tuple(sorted((k, repr(a.value)) for k, a in node.attributes.items())))
            first = seen.get(key)
            if first is None:
                seen[key] = node
                continue
            for old, new in zip(node.outputs, first.outputs, strict=False):
                old.replace_all_uses_with(new)
            graph.remove(node, safe=True)
            stats.counts[f"duplicate {node.op_type} merged"] += 1


def _replace_with_constant(graph: ir.Graph, value: ir.Value, array: np.ndarray) -> None:
    name = value.name or "const"
    value.name = None
    if value.dtype is not None and array.dtype != value.dtype.numpy() and value.dtype != ir.DataType.BFLOAT16:
        array = array.astype(value.dtype.numpy())
    value.replace_all_uses_with(initializer(graph, name, array))


def _evaluate(node: ir.Node) -> np.ndarray | None:
    """The node's output when it is computable now from small constants and static shapes."""
    if node.op_type in ("Shape", "Size"):
        shape = static_shape(node.inputs[0])
        if shape is None:
            return None
        if node.op_type == "Size":
            return None if None in shape else np.array(int(np.prod(shape)), dtype=np.int64)
        start, end = attr(node, "start", 0), attr(node, "end", None)
        dims = shape[slice(start, end)]
        return None if None in dims else np.array(dims, dtype=np.int64)
    shape_of = producer(node.inputs[0], "Shape") if node.op_type == "Gather" else None
    if shape_of is not None and attr(node, "axis", 0) == 0:  # one static dim of a partly dynamic shape
        shape, idx = static_shape(shape_of.inputs[0]), const(node.inputs[1])
        if shape is None or idx is None:
            return None
        dims = shape[slice(attr(shape_of, "start", 0), attr(shape_of, "end", None))]
        try:
            picked = np.take(np.array(dims, dtype=object), idx)
        except IndexError:
            return None
        return None if any(d is None for d in np.atleast_1d(picked)) else np.array(picked, dtype=np.int64)
    if node.op_type == "CastLike" and node.inputs[1].dtype is not None:
        x = const(node.inputs[0])
        return None if x is None else x.astype(node.inputs[1].dtype.numpy())
    fn = FOLD.get(node.op_type)
    if fn is None:
        return None
    inputs = list(node.inputs)
    while inputs and inputs[-1] is None:
        inputs.pop()
    # Integer/bool tensors are shape data; float constants beyond a handful are weights.
    args = [None if v is None else const(v, max_size=SMALL_CONST if v.dtype in _INT_TYPES else _SMALL_FLOAT)
            for v in inputs]
    if any(a is None for a in args):
        return None
    return np.asarray(fn(node, *args))


def _is_noop(node: ir.Node) -> bool:
    op, x = node.op_type, node.inputs[0]
    shape = static_shape(x)
    if op == "Identity" or (op == "Concat" and len(node.inputs) == 1):  # TorchScript's cache: Concat(past)
        return True
    if op == "Cast":
        return x.dtype is not None and x.dtype == ir.DataType(attr(node, "to"))
    if op == "Transpose":
        perm = attr(node, "perm")
        return perm is not None and list(perm) == list(range(len(perm)))
    if op == "Slice":
        starts, ends, axes, steps = (const(input_at(node, i)) for i in range(1, 5))
        if starts is None or ends is None or (input_at(node, 3) is not None and axes is None):
            return False
        if steps is not None and not np.all(steps == 1):
            return False
        axes = range(len(starts)) if axes is None else axes
        for s, e, a in zip(starts.tolist(), ends.tolist(), list(axes), strict=False):
            dim = shape[a] if shape is not None and -len(shape) <= a < len(shape) else None
            if s != 0 or not (e >= _INT_MAX_ISH or (dim is not None and e >= dim)):
                return False
        return True
    if op == "Reshape":
        target = const(node.inputs[1])
        out = static_shape(node.outputs[0])
        return (shape is not None and None not in shape and target is not None
                and tuple(target.tolist()) == shape and out == shape)
    if op == "Expand":
        target = const(node.inputs[1])
        return target is not None and shape is not None and len(target) <= len(shape) and bool(np.all(target == 1))
    return False
