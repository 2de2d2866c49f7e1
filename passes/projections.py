"""Linear projections as the passes see them: MatMul(x, W) [+ bias], W made from initializers.

Shared by ReorderQKVProjections, FuseQKV and FuseGateUp. A weight is one of
- `W` an initializer [in, out];
- `Transpose(W [out, in], perm=[1, 0])` (torch.onnx without constant folding);
- `DequantizeLinear(q [in, out], scale, zero_point)`: blocked along the input dim (axis 0,
  block_size > 0) or per output channel (axis 1); uint4/int4/uint8/int8 data;
optionally followed by a `Cast`. Projections fuse when their weights have the same form: the
concatenation happens on the initializers (lazily, at save time), so only the fused weights are
ever read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from .base import Nodes, attr, fail, input_at, lazy_initializer, producer, small_constant, take_over


@dataclass
class Weight:
    form: str  # "plain" | "transposed" | "dequant"
    tensors: dict[str, ir.Value]  # role ("w", "scale", "zero_point") -> initializer
    nodes: list[ir.Node]  # Transpose / DequantizeLinear / Cast between the initializers and MatMul
    in_dim: int
    out_dim: int
    signature: tuple  # everything that must match to concatenate
    attrs: dict = field(default_factory=dict)
    cast_to: int | None = None


@dataclass
class Projection:
    matmul: ir.Node
    weight: Weight
    bias: ir.Value | None
    add: ir.Node | None

    @property
    def output(self) -> ir.Value:
        return (self.add or self.matmul).outputs[0]

    @property
    def input(self) -> ir.Value:
        return self.matmul.inputs[0]

    @property
    def nodes(self) -> list[ir.Node]:
        return [*self.weight.nodes, self.matmul, *([self.add] if self.add else [])]

    @property
    def name(self) -> str:
        return self.matmul.name or ""


def _init(value: ir.Value | None, what: str) -> ir.Value:
    if value is None or not value.is_initializer() or value.const_value is None:
        fail(f"{what} is not an initializer")
    return value


def parse_weight(value: ir.Value) -> Weight:
    """The weight feeding a MatMul's right-hand side, or fail() naming why it is not one."""
    cast_to, nodes = None, []
    cast = producer(value, "Cast")
    if cast is not None:
        cast_to, nodes, value = attr(cast, "to"), [cast], cast.inputs[0]
    if value.is_initializer():
        w = _init(value, "weight")
        if len(w.shape) != 2:
            fail(f"weight {w.name} has rank {len(w.shape)}, not 2")
        i, o = w.shape
        return Weight("plain", {"w": w}, nodes, i, o, ("plain", w.dtype, cast_to), cast_to=cast_to)
    tr = producer(value, "Transpose")
    if tr is not None:
        w = _init(tr.inputs[0], "transposed weight")
        if len(w.shape) != 2 or list(attr(tr, "perm", [1, 0])) != [1, 0]:
            fail(f"weight {w.name} is transposed with perm {attr(tr, 'perm')}, not a 2-D [1, 0]")
        o, i = w.shape
        return Weight("transposed", {"w": w}, [tr, *nodes], i, o, ("transposed", w.dtype, cast_to), cast_to=cast_to)
    dq = producer(value, "DequantizeLinear")
    if dq is not None:
        q = _init(dq.inputs[0], "quantized weight")
        scale = _init(dq.inputs[1], "quantization scale")
        zp = _init(dq.inputs[2], "zero point") if input_at(dq, 2) is not None else None
        if len(q.shape) != 2:
            fail(f"quantized weight {q.name} has rank {len(q.shape)}, not 2")
        axis, block = attr(dq, "axis", 1) % 2, attr(dq, "block_size", 0)
        if block and axis != 0:
            fail(f"{q.name} is blocked along axis {axis}; only blocks along the input dim (axis 0) concatenate")
        if not block and (axis != 1 or len(scale.shape) != 1):
            fail(f"{q.name} has a per-tensor scale; scales of different projections cannot be concatenated")
        i, o = q.shape
        tensors = {"w": q, "scale": scale, **({"zero_point": zp} if zp is not None else {})}
        sig = ("dequant", q.dtype, scale.dtype, zp.dtype if zp is not None else None, axis, block, cast_to,
               attr(dq, "output_dtype", 0))
        return Weight("dequant", tensors, [dq, *nodes], i, o, sig,
                      attrs={k: a.value for k, a in dq.attributes.items()}, cast_to=cast_to)
    fail(f"MatMul's weight {value.name} is not an initializer, Transpose of one, or DequantizeLinear of ones")


def parse_projection(matmul: ir.Node) -> Projection:
    """MatMul(x, W) with an optional `Add(·, bias)` where bias is a 1-D initializer of width out."""
    if matmul.op_type != "MatMul":
        fail(f"{matmul.name} is {matmul.op_type}, not MatMul")
    weight = parse_weight(matmul.inputs[1])
    for n in weight.nodes:
        if len(n.outputs[0].uses()) != 1:
            fail(f"weight node {n.name} has other readers")
    out = matmul.outputs[0]
    uses = list(out.uses())
    if len(uses) == 1 and uses[0].node.op_type == "Add" and not out.is_graph_output():
        add = uses[0].node
        other = add.inputs[1 - uses[0].idx]
        if other is not None and other.is_initializer() and other.shape is not None \
                and list(other.shape) == [weight.out_dim]:
            return Projection(matmul, weight, other, add)
    return Projection(matmul, weight, None, None)


def projections_reading(value: ir.Value) -> list[ir.Node]:
    """MatMuls that read `value` as their left input, in graph order."""
    return [u.node for u in value.uses() if u.node.op_type == "MatMul" and u.idx == 0
            and u.node.domain in ("", "ai.onnx")]


def check_compatible(projs: list[Projection]) -> None:
    """fail() unless the weights share form, dtypes, quantization and input width, biases alike."""
    first = projs[0].weight
    for p in projs[1:]:
        w = p.weight
        if w.signature != first.signature:
            fail(f"weights differ in form or quantization: {_describe(first)} vs {_describe(w)}")
        if w.in_dim != first.in_dim:
            fail(f"input widths differ: {first.in_dim} vs {w.in_dim}")
    with_bias = [p.bias is not None for p in projs]
    if any(with_bias) and not all(with_bias):
        fail("only some projections have a bias")
    if all(with_bias) and len({p.bias.dtype for p in projs}) != 1:
        fail("bias dtypes differ")


def _describe(w: Weight) -> str:
    if w.form == "dequant":
        return f"DequantizeLinear({w.signature[1]}, block {w.signature[5]}, axis {w.signature[4]})"
    return f"{w.form} {w.signature[1]}"


def _concat(graph: ir.Graph, values: list[ir.Value], axis: int, shape: list[int], name: str) -> ir.Value:
    """A lazy initializer: the concatenation is read and built only when the model is written."""

    def build() -> np.ndarray:
        array = np.concatenate([v.const_value.numpy() for v in values], axis=axis)
        for v in values:  # unmap the parts: their pages need not stay resident while saving
            if isinstance(v.const_value, ir.ExternalTensor):
                v.const_value.release()
        return array

    return lazy_initializer(graph, name, values[0].dtype, shape, build)


def fuse(graph: ir.Graph, projs: list[Projection], role: str, fused_role: str) -> str:
    """Replace `projs` by one MatMul over concatenated weights (+ bias) and a Split named for `fused_role`
    (`fused_names`); returns the fused node scope."""
    rename, node_name = fused_names(projs, role, fused_role)
    w0 = projs[0].weight
    widths = [p.weight.out_dim for p in projs]
    total = sum(widths)
    anchor = min((p.matmul for p in projs), key=lambda n: _position(graph, n))
    new = Nodes(graph)
    roles = {}
    for role, v0 in w0.tensors.items():
        parts = [p.weight.tensors[role] for p in projs]
        if w0.form == "transposed" or (w0.form == "dequant" and len(v0.shape) == 1):
            axis = 0
        else:
            axis = 1
        shape = list(v0.shape)
        shape[axis] = sum(v.shape[axis] for v in parts)
        name = rename(v0.name, role)
        roles[role] = _concat(graph, parts, axis, shape, name)
    weight = roles["w"]
    if w0.form == "transposed":
        weight = new.add("Transpose", [weight], f"{node_name}/Transpose", perm=[1, 0])
    elif w0.form == "dequant":
        weight = new.add("DequantizeLinear", [weight, roles["scale"], roles.get("zero_point")],
                         f"{node_name}/DequantizeLinear", **w0.attrs)
    if w0.cast_to is not None:
        weight = new.add("Cast", [weight], f"{node_name}/Cast", to=w0.cast_to)
    y = new.add("MatMul", [projs[0].input, weight], f"{node_name}/MatMul")
    if projs[0].bias is not None:
        name = rename(projs[0].bias.name, "bias")
        y = new.add("Add", [y, _concat(graph, [p.bias for p in projs], 0, [total], name)], f"{node_name}/Add")
    sizes = small_constant(graph, f"{node_name}/split_sizes", np.array(widths, dtype=np.int64))
    parts = new.add("Split", [y, sizes], f"{node_name}/Split", outputs=len(projs), axis=-1)
    graph.insert_before(anchor, new)
    for p, part in zip(projs, parts, strict=True):
        take_over(p.output, part)
    graph.remove([n for p in projs for n in p.nodes], safe=True)
    return node_name


def _position(graph: ir.Graph, node: ir.Node) -> int:
    order = graph.meta.get("fuselm_order")
    if order is None or node not in order:
        order = {n: i for i, n in enumerate(graph)}
        graph.meta["fuselm_order"] = order
    return order[node]


def fused_names(projs: list[Projection], role: str, fused_role: str):
    """(rename, node scope) for the fused projection: names say q_proj -> qkv_proj.

    `rename(name, kind)` maps a tensor name of the first projection (weight, scales, zero points,
    bias) to the fused tensor's name; the node scope comes from the MatMul's or weight's name.
    """
    first = projs[0]
    w = first.weight.tensors["w"].name or ""
    fallback = (first.name or "proj").replace("/", "_") + f"_{fused_role}"

    def rename(name: str | None, kind: str) -> str:
        if name and role in name:
            return name.replace(role, fused_role)
        return f"{fallback}.{kind}"

    node = first.name
    if role in node:
        prefix = node[: node.index(role)] + fused_role
    elif role in w:
        prefix = w[: w.index(role)] + fused_role
    else:
        prefix = fallback
    return rename, prefix
