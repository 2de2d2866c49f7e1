"""What every pass shares: the Pass / Fusion base classes, statistics, and small graph helpers.

A pass is called on an `onnx_ir.Model` and returns `(model, modified, stats)`. A fusion reads as
pattern / check / rewrite: `match(anchor)` walks the subgraph around an anchor node and calls
`fail("why")` on the first mismatch; `rewrite(graph, match)` builds the fused nodes. Every rejection
lands in the statistics with its reason, so `fuselm diff` can show why a fusion did not fire.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

import numpy as np
import onnx_ir as ir

from fuselm import contract

from .stats import Stats

# Constants larger than this are weights: never read them to check a pattern.
SMALL_CONST = 4096


class Reject(Exception):
    """A pattern did not match; the message says why."""


def fail(reason: str) -> NoReturn:
    raise Reject(reason)


class Pass:
    """Base class: subclasses implement `apply(model, stats) -> modified`."""

    aliases: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return type(self).__name__

    def __call__(self, model: ir.Model) -> tuple[ir.Model, bool, Stats]:
        stats = Stats()
        forget_names(model.graph)
        before = set(vars(self))
        try:
            modified = self.apply(model, stats)
        finally:  # what a run kept on the pass is the run's: PIPELINE's instances live as long as the process,
            for name in set(vars(self)) - before:  # and a value of the graph held here would keep its weights
                delattr(self, name)
        if modified:
            remove_unused(model)
        forget_names(model.graph)
        return model, modified, stats

    def apply(self, model: ir.Model, stats: Stats) -> bool:
        raise NotImplementedError


class Fusion(Pass):
    """Pattern / check / rewrite over the anchors a subclass yields."""

    needs_opset: int | None = contract.OPSET
    only: set[str] | None = None  # anchor names to try (the pipeline's one-at-a-time retry), None: all
    anchor_ops: tuple[str, ...] = ()  # the default anchors: the default-domain nodes of these ops
    functions = False  # the rewrites write fuselm ops: attach their functions after a change

    def anchors(self, graph: ir.Graph) -> Iterable[ir.Node]:
        return [n for n in graph if n.op_type in self.anchor_ops and n.domain in ("", "ai.onnx")]

    def match(self, anchor: ir.Node) -> Any:
        raise NotImplementedError

    def rewrite(self, graph: ir.Graph, match: Any) -> str:
        """Replace the matched subgraph; return a short description of where it fired."""
        raise NotImplementedError

    def apply(self, model: ir.Model, stats: Stats) -> bool:
        graph = model.graph
        opset = graph.opset_imports.get("", 0)
        modified = False
        for anchor in list(self.anchors(graph)):
            if anchor.graph is not graph:  # removed by an earlier rewrite in this pass
                continue
            if self.only is not None and anchor.name not in self.only:
                continue
            try:
                if self.needs_opset and opset < self.needs_opset:
                    fail(f"graph's default-domain opset is {opset}; the fused op needs {self.needs_opset}")
                match = self.match(anchor)
            except Reject as r:
                stats.skip(anchor.name or anchor.op_type, str(r))
                continue
            stats.fire(self.rewrite(graph, match))
            modified = True
        if modified:
            ensure_sorted(graph)
            if self.functions:
                attach_functions(model)
        return modified


# ---- small graph helpers -------------------------------------------------------------------

def producer(value: ir.Value | None, *op_types: str) -> ir.Node | None:
    """The node that makes `value` when its op is one of `op_types` (default domain), else None."""
    if value is None:
        return None
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx") or (op_types and node.op_type not in op_types):
        return None
    return node


def const(value: ir.Value | None, max_size: int = SMALL_CONST) -> np.ndarray | None:
    """The value as a numpy array when it is a small constant (initializer or Constant node)."""
    if value is None:
        return None
    tensor = value.const_value
    if tensor is None:
        node = value.producer()
        if node is None or node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
            return None
        attr = next(iter(node.attributes.values()), None)
        if attr is None:
            return None
        if attr.name in ("value_float", "value_int", "value_floats", "value_ints"):
            return np.array(attr.value, dtype=np.float32 if "float" in attr.name else np.int64)
        if attr.name != "value":
            return None
        tensor = attr.as_tensor()
    if tensor.size > max_size:
        return None
    return tensor.numpy()


def scalar(value: ir.Value | None) -> float | None:
    """A constant holding a single number (any shape of size 1), else None."""
    a = const(value, max_size=1)
    return None if a is None or a.size != 1 else a.reshape(()).item()


def attr(node: ir.Node, name: str, default: Any = None) -> Any:
    a = node.attributes.get(name)
    return default if a is None else a.value


def input_at(node: ir.Node, i: int) -> ir.Value | None:
    """The node's input i, None when it is omitted."""
    return node.inputs[i] if len(node.inputs) > i else None


def users(value: ir.Value) -> list[ir.Node]:
    return [u.node for u in value.uses()]


def only_user(value: ir.Value, *op_types: str) -> ir.Node | None:
    """The single node reading `value` (and not a graph output), when its op is in `op_types`."""
    uses = users(value)
    if len(uses) != 1 or value.is_graph_output():
        return None
    node = uses[0]
    return node if not op_types or node.op_type in op_types else None


def other_input(node: ir.Node, value: ir.Value) -> ir.Value | None:
    """For a binary node with `value` as one input, the other input."""
    a, b = node.inputs[0], node.inputs[1]
    return b if a is value else a if b is value else None


def static_shape(value: ir.Value | None) -> tuple | None:
    """The value's shape as a tuple of ints (None for a dynamic dim), or None when unknown."""
    if value is None or value.shape is None:
        return None
    return tuple(d if isinstance(d, int) else None for d in value.shape.dims)


def rank(value: ir.Value | None) -> int | None:
    return None if value is None or value.shape is None else value.shape.rank()


def initializer(graph: ir.Graph, name: str, array: np.ndarray | ir.TensorProtocol) -> ir.Value:
    """Register a new initializer under a unique name derived from `name`."""
    name = unique_name(graph, name)
    tensor = array if isinstance(array, ir.TensorProtocol) else ir.tensor(array, name=name)
    tensor.name = name
    value = ir.Value(name=name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype),
                     const_value=tensor)
    graph.register_initializer(value)
    return value


def lazy_initializer(graph: ir.Graph, name: str, dtype: ir.DataType, shape,
                     build: Callable[[], np.ndarray]) -> ir.Value:
    """An initializer `build()` computes only when the model is written (the weights it reads stay on disk)."""
    tensor = ir.LazyTensor(lambda: ir.tensor(build(), dtype=dtype, name=name), dtype=dtype, shape=ir.Shape(shape),
                           name=name)
    return initializer(graph, name, tensor)


def small_constant(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """An initializer holding `array`, reusing an identical small one (so passes stay idempotent)."""
    cache = graph.meta.get("fuselm_consts")
    if cache is None:
        cache = {}
        for v in graph.initializers.values():
            t = v.const_value
            if t is not None and t.size <= SMALL_CONST and not v.is_graph_input() and not is_external(t):
                cache.setdefault(_const_key(t.numpy()), v)
        graph.meta["fuselm_consts"] = cache
    key = _const_key(array)
    if key not in cache:
        cache[key] = initializer(graph, name, array)
    return cache[key]


def is_external(tensor: ir.TensorProtocol) -> bool:
    """Whether reading the tensor means reading the weights file (scans must not): external data,
    or a lazy concatenation of external data."""
    return isinstance(tensor, ir.ExternalTensor | ir.LazyTensor)


def _const_key(a: np.ndarray) -> tuple:
    return (a.dtype.str, a.shape, a.tobytes())


def unique_name(graph: ir.Graph, name: str) -> str:
    taken = _names(graph)
    new, i = name, 0
    while new in taken:
        i += 1
        new = f"{name}_{i}"
    taken.add(new)
    return new


def _names(graph: ir.Graph) -> set[str]:
    # Cached per graph object for the duration of one pass run: a full scan per new name would
    # make large graphs quadratic.
    cache = graph.meta.get("fuselm_names")
    if cache is None:
        cache = {v.name for v in graph.initializers.values()} | {v.name for v in graph.inputs}
        cache |= {o.name for n in graph for o in n.outputs} | {n.name for n in graph}
        cache.discard(None)
        graph.meta["fuselm_names"] = cache
    return cache


def forget_names(graph: ir.Graph) -> None:
    """Drop the per-pass caches (names taken, node order)."""
    graph.meta.pop("fuselm_names", None)
    graph.meta.pop("fuselm_order", None)
    graph.meta.pop("fuselm_consts", None)


def new_node(graph: ir.Graph, op_type: str, inputs: list[ir.Value | None], name: str, *,
             outputs: int | list[str] = 1, domain: str = "", **attributes) -> ir.Node:
    """A node named `name` (made unique) whose outputs are named after it."""
    name = unique_name(graph, name)
    out_names = [f"{name}_output_{i}" for i in range(outputs)] if isinstance(outputs, int) else outputs
    out_names = [unique_name(graph, n) for n in out_names]
    attrs = {k: v for k, v in attributes.items() if v is not None}
    node = ir.node(op_type, inputs, attributes=attrs, domain=domain, name=name, num_outputs=len(out_names))
    for value, n in zip(node.outputs, out_names, strict=False):
        value.name = n
    return node


class Nodes(list):
    """The nodes a rewrite makes, in order, for `graph.insert_before(anchor, nodes)`."""

    def __init__(self, graph: ir.Graph, nodes: Iterable[ir.Node] = ()):
        super().__init__(nodes)
        self.graph = graph

    def add(self, op_type: str, inputs: list[ir.Value | None], name: str, **kwargs) -> Any:
        """`new_node(...)`, kept; returns its output (a tuple of its outputs when it has several)."""
        node = new_node(self.graph, op_type, inputs, name, **kwargs)
        self.append(node)
        return node.outputs[0] if len(node.outputs) == 1 else tuple(node.outputs)


def take_over(old: ir.Value, new: ir.Value) -> None:
    """Make `new` replace `old` everywhere; a graph output keeps its name (the contract)."""
    new.shape = new.shape or old.shape
    new.type = new.type or old.type
    if old.is_graph_output():
        name = old.name
        old.name = None  # free the name before giving it to `new`
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        new.name = name
    else:
        old.replace_all_uses_with(new)


def remove_unused(model: ir.Model) -> int:
    """Dead-node and dead-initializer elimination; returns how many went.

    Like onnx_ir's RemoveUnusedNodesPass, without its per-node schema lookups (which dominate on
    graphs of thousands of nodes); optional outputs are left as they are.
    """
    graph = model.graph
    outputs = frozenset(graph.outputs)
    count = 0
    for node in reversed(list(graph)):
        if any(o in outputs or o.uses() for o in node.outputs):
            continue
        graph.remove(node, safe=True)
        count += 1
    inputs = frozenset(graph.inputs)
    for name, value in list(graph.initializers.items()):
        if not value.uses() and value not in outputs and value not in inputs:
            del graph.initializers[name]
            count += 1
    forget_names(graph)
    return count


def ensure_sorted(graph: ir.Graph) -> None:
    """Topologically sort only when a rewrite left a node before one of its producers."""
    seen: set[ir.Node] = set()
    for node in graph:
        for v in node.inputs:
            p = v.producer() if v is not None else None
            if p is not None and p.graph is graph and p not in seen:
                graph.sort()
                return
        seen.add(node)


_LAYER = re.compile(r"layers?[._/](\d+)(?:[._/]|$)")


def layer_of_name(name: str | None) -> int | None:
    m = _LAYER.search(name or "")
    return int(m.group(1)) if m else None


def node_layer(node: ir.Node) -> int | None:
    """The decoder layer a node names directly (node name, or a weight it reads), else None."""
    names = [node.name] + [v.name for v in node.inputs if v is not None and v.is_initializer()]
    return next((i for i in map(layer_of_name, names) if i is not None), None)


def name_like(template: str | None, old: str, new: str, fallback: str) -> str:
    """`template` with `old` replaced by `new` when it contains `old`, else `fallback`."""
    if template and old in template:
        return template.replace(old, new)
    return fallback


def rope_node(graph: ir.Graph, x: ir.Value, position_ids: ir.Value, name: str, inv_freq, scaling: float,
              interleaved: int) -> ir.Node:
    """A `fuselm::FusedRoPE` node (fuselm/contract.py), x [B,S,H,D] -> [B,S,H,D]."""
    return new_node(graph, contract.ROPE_OP, [x, position_ids], name, domain=contract.DOMAIN,
                    inv_freq=[float(v) for v in inv_freq], attention_scaling=float(scaling), interleaved=int(interleaved))


def attach_functions(model: ir.Model) -> None:
    """Attach the model-local functions of the fuselm ops the graph uses (one definition: the contract's),
    in the form its nodes use (FusedRoPE's rotary layout, [B,S,H·D] inputs, norm weight); a fuselm function
    the graph no longer needs, or one of another form, goes."""
    protos = contract.functions_for(list(model.graph))
    used = {n.op_type for n in model.graph if n.domain == contract.DOMAIN}
    for key in [k for k in model.functions if k[0] == contract.DOMAIN]:
        if key[1] not in used or any(p.name == key[1] for p in protos):
            del model.functions[key]
    if protos:
        model.opset_imports.setdefault(contract.DOMAIN, contract.DOMAIN_VERSION)
    for proto in protos:
        fn = ir.serde.deserialize_function(proto)
        model.functions[fn.identifier()] = fn
