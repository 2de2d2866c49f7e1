"""Build the ONNX graph directly: named nodes, shared constants, weights as external tensors.

The graph is written op by op rather than traced (see exporter/README.md for why): every node
gets its final name (`/model/layers.3/attn/q_proj/MatMul`), every weight its HF name, and the
building blocks below mirror HF's modules op for op (RMSNorm by hand, eager attention).

Weights are declared here but not read: `Builder.weight` records a `WeightJob` (which checkpoint
tensor, how to encode it) and an external-data TensorProto without bytes. exporter/weights.py
writes the bytes later, streaming.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper
from onnx import helper as oh

from fuselm import contract

from . import rope as rope_mod

FLOAT_MIN = float(np.finfo(np.float32).min)  # HF's mask value: torch.finfo(float32).min


class Export(NamedTuple):
    """What an exporter's `build(hf_dir, config, precisions)` returns (exporter/families/build.py,
    exporter/traced/): the graph with every weight declared, the checkpoint the weights stream from,
    the model fields of fuselm.json, and a label for messages."""

    builder: Builder
    checkpoint: object  # exporter.weights.Checkpoint
    meta: dict
    label: str


@dataclass
class Output:
    """One initializer a WeightJob writes. `transposed`: stored [in, out] from HF's [out, in]."""

    proto: TensorProto
    transposed: bool


@dataclass
class WeightJob:
    """Read checkpoint tensor `source`, encode it (f32 rows in -> one array per output), write."""

    source: str
    layer: int | None  # progress grouping; None = embedding / head
    encode: Callable[[np.ndarray], list[np.ndarray]]
    outputs: list[Output] = field(default_factory=list)


class Builder:
    """Collects nodes, graph I/O, small inline constants and declared external weights."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []  # shapes of inner values, where an exporter knows them
        self.constants: dict[tuple, TensorProto] = {}
        self.jobs: list[WeightJob] = []
        self._node_names: set[str] = set()

    def op(self, op_type: str, *inputs: str, name: str, out: str | None = None, **attrs) -> str:
        """Add a node named `name`; its output is `out` or `{name}_output_0`."""
        return self.node(oh.make_node(op_type, list(inputs), [out or f"{name}_output_0"], name=name, **attrs))

    def node(self, node: onnx.NodeProto) -> str:
        assert node.name not in self._node_names, node.name
        self._node_names.add(node.name)
        self.nodes.append(node)
        return node.output[0]

    def const(self, values, dtype=np.int64) -> str:
        """A small constant initializer stored inline, shared by every node that uses the same value."""
        arr = np.asarray(values, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self.constants:
            tag = "_".join(str(v) for v in arr.ravel()[:6]).replace("-", "m").replace(".", "p")
            self.constants[key] = numpy_helper.from_array(arr, f"/model/constants/{arr.dtype.name}_{tag}_{len(self.constants)}")
        return self.constants[key].name

    def weight(self, source: str, layer: int | None, encode, outputs: list[tuple[str, int, tuple, bool]]) -> list[str]:
        """Declare external initializers (name, onnx dtype, shape, transposed) written from `source`."""
        job = WeightJob(source, layer, encode)
        for name, dtype, shape, transposed in outputs:
            proto = TensorProto(name=name, data_type=dtype, dims=list(shape))
            proto.data_location = TensorProto.EXTERNAL
            job.outputs.append(Output(proto, transposed))
        self.jobs.append(job)
        return [o.proto.name for o in job.outputs]

    def model(self, functions: list[onnx.FunctionProto], doc: str) -> onnx.ModelProto:
        initializers = list(self.constants.values()) + [o.proto for j in self.jobs for o in j.outputs]
        graph = oh.make_graph(self.nodes, "fuselm", self.inputs, self.outputs, initializer=initializers,
                              value_info=self.value_info)
        return oh.make_model(graph, ir_version=11, producer_name="fuselm", doc_string=doc,
                             opset_imports=[oh.make_opsetid("", contract.OPSET),
                                            oh.make_opsetid(contract.DOMAIN, contract.DOMAIN_VERSION)],
                             functions=functions)


@dataclass
class Dims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float


class Layer:
    """The building blocks of one decoder layer, under the node scope `/model/layers.{i}`.

    `linear(canonical, x)` asks the precision plan (exporter/quant.py) how the weight is stored
    and emits `MatMul` on it (after `Cast` for f16, `DequantizeLinear` for q8/q4).
    """

    def __init__(self, b: Builder, i: int, dims: Dims, plan, hf_name: Callable[[str], str],
                 position_ids: str, mask: str, rope: rope_mod.Rope):
        self.b, self.i, self.d, self.plan, self.hf_name = b, i, dims, plan, hf_name
        self.position_ids, self.mask, self.rope = position_ids, mask, rope
        self.scope = f"/model/layers.{i}"

    def linear(self, canonical: str, x: str, bias: bool = False) -> str:
        """x @ W (+ b) for the HF Linear `canonical` (also the node scope, e.g. attn/q_proj)."""
        scope = f"{self.scope}/{canonical}"
        w = self.plan.linear_weight(self.b, self.hf_name(canonical), scope, self.i)
        y = self.b.op("MatMul", x, w, name=f"{scope}/MatMul")
        if bias:
            bw = self.plan.vector(self.b, self.hf_name(f"{canonical}.bias"), self.i)
            y = self.b.op("Add", y, bw, name=f"{scope}/Add")
        return y

    def rms_norm(self, canonical: str, x: str) -> str:
        return rms_norm(self.b, x, self.plan.vector(self.b, self.hf_name(canonical), self.i),
                        self.d.eps, f"{self.scope}/{canonical}")

    def heads(self, x: str, n: int, scope: str) -> str:
        """[B,S,n*D] -> [B,S,n,D] (HF's `.view(hidden_shape)`)."""
        return self.b.op("Reshape", x, self.b.const([0, 0, n, self.d.head_dim]), name=f"{self.scope}/{scope}/Reshape")

    def rotary(self, x: str, scope: str) -> str:
        """fuselm::FusedRoPE on [B,S,H,D]."""
        name = f"{self.scope}/{scope}/FusedRoPE"
        return self.b.node(contract.fused_rope_node(x, self.position_ids, f"{name}_output_0", name, self.rope.inv_freq,
                                                    self.rope.attention_scaling))

    def attention(self, q: str, k: str, v: str) -> str:
        """HF eager attention on q [B,S,H,D], k/v [B,S,KV,D] (after rope); appends present.{i}.*.

        past Concat -> GQA repeat (Unsqueeze, Expand, Reshape) -> MatMul QK^T -> Mul scale ->
        Add mask -> Softmax -> MatMul V -> [B,S,H*D].
        """
        b, d, s = self.b, self.d, f"{self.scope}/attn"
        perm = [0, 2, 1, 3]
        q, k, v = (b.op("Transpose", x, name=f"{s}/{n}/Transpose", perm=perm) for x, n in ((q, "q"), (k, "k"), (v, "v")))
        present = []
        for kind, new in (("key", k), ("value", v)):
            past = contract.past_name(self.i, kind)
            b.inputs.append(_kv_info(past, "past_sequence_length", d))
            present.append(b.op("Concat", past, new, name=f"{s}/{kind}/Concat", out=contract.present_name(self.i, kind), axis=2))
            b.outputs.append(_kv_info(present[-1], "total_sequence_length", d))
        k, v = (self._repeat_kv(t, kind) for t, kind in zip(present, ("key", "value"), strict=True))
        kt = b.op("Transpose", k, name=f"{s}/key/Transpose", perm=[0, 1, 3, 2])
        scores = b.op("MatMul", q, kt, name=f"{s}/qk/MatMul")
        scores = b.op("Mul", scores, b.const(d.head_dim ** -0.5, np.float32), name=f"{s}/scale/Mul")
        scores = b.op("Add", scores, self.mask, name=f"{s}/mask/Add")
        probs = b.op("Softmax", scores, name=f"{s}/Softmax", axis=-1)
        out = b.op("MatMul", probs, v, name=f"{s}/pv/MatMul")
        out = b.op("Transpose", out, name=f"{s}/out/Transpose", perm=perm)
        return b.op("Reshape", out, b.const([0, 0, d.heads * d.head_dim]), name=f"{s}/out/Reshape")

    def _repeat_kv(self, x: str, kind: str) -> str:
        """HF repeat_kv: [B,KV,T,D] -> [B,KV,1,T,D] -> Expand [B,KV,rep,T,D] -> Reshape [B,H,T,D]."""
        b, d = self.b, self.d
        rep = d.heads // d.kv_heads
        if rep == 1:
            return x
        s = f"{self.scope}/attn/repeat_{kind}"
        x = b.op("Unsqueeze", x, b.const([2]), name=f"{s}/Unsqueeze")
        x = b.op("Expand", x, b.const([1, 1, rep, 1, 1]), name=f"{s}/Expand")
        return b.op("Reshape", x, b.const([0, d.heads, -1, d.head_dim]), name=f"{s}/Reshape")

    def swiglu_mlp(self, x: str, bias: bool = False) -> str:
        """down(silu(gate(x)) * up(x)), SiLU as Sigmoid * x."""
        s = f"{self.scope}/mlp"
        gate = self.linear("mlp/gate_proj", x, bias)
        up = self.linear("mlp/up_proj", x, bias)
        sig = self.b.op("Sigmoid", gate, name=f"{s}/act/Sigmoid")
        act = self.b.op("Mul", gate, sig, name=f"{s}/act/Mul")
        h = self.b.op("Mul", act, up, name=f"{s}/Mul")
        return self.linear("mlp/down_proj", h, bias)

    def add(self, a: str, c: str, scope: str) -> str:
        return self.b.op("Add", a, c, name=f"{self.scope}/{scope}/Add")


def rms_norm(b: Builder, x: str, weight: str, eps: float, scope: str) -> str:
    """HF's RMSNorm, decomposed: x * 1/sqrt(mean(x^2, -1) + eps) * weight."""
    sq = b.op("Pow", x, b.const(2.0, np.float32), name=f"{scope}/Pow")
    mean = b.op("ReduceMean", sq, b.const([-1]), name=f"{scope}/ReduceMean", keepdims=1)
    var = b.op("Add", mean, b.const(eps, np.float32), name=f"{scope}/Add")
    std = b.op("Sqrt", var, name=f"{scope}/Sqrt")
    inv = b.op("Reciprocal", std, name=f"{scope}/Reciprocal")
    normed = b.op("Mul", x, inv, name=f"{scope}/Mul")
    return b.op("Mul", normed, weight, name=f"{scope}/Mul_1")


def attention_mask(b: Builder, input_ids: str, mask_in: str, sliding_window: int | None = None,
                   s: str = "/model/attn_mask", chunk: int | None = None) -> str:
    """The additive mask [B,1,S,T] (0 or float32 min), computed once and shared by every layer.

    Causal by cache index (query i sits at index past+i, past = T - S), not by position_ids, so
    arbitrary positions work; padding from attention_mask. Sliding window: key index must be
    greater than query index - window (HF's sliding_window mask). Chunked (Llama 4's chunked local
    attention): key and query index in the same chunk of `chunk` indices. `s`: the node scope.
    """
    seq = b.op("Shape", input_ids, name=f"{s}/seq/Shape", start=1, end=2)
    total = b.op("Shape", mask_in, name=f"{s}/total/Shape", start=1, end=2)
    past = b.op("Sub", total, seq, name=f"{s}/past/Sub")
    zero, one = b.const(0), b.const(1)
    past_s = b.op("Squeeze", past, b.const([0]), name=f"{s}/past/Squeeze")
    total_s = b.op("Squeeze", total, b.const([0]), name=f"{s}/total/Squeeze")
    q_idx = b.op("Range", past_s, total_s, one, name=f"{s}/query/Range")
    k_idx = b.op("Range", zero, total_s, one, name=f"{s}/key/Range")
    q_col = b.op("Unsqueeze", q_idx, b.const([1]), name=f"{s}/query/Unsqueeze")
    allowed = b.op("LessOrEqual", k_idx, q_col, name=f"{s}/causal/LessOrEqual")  # [S,T]
    if sliding_window is not None:
        low = b.op("Sub", q_col, b.const(sliding_window), name=f"{s}/window/Sub")
        inside = b.op("Greater", k_idx, low, name=f"{s}/window/Greater")
        allowed = b.op("And", allowed, inside, name=f"{s}/window/And")
    if chunk is not None:
        k_chunk = b.op("Div", k_idx, b.const(chunk), name=f"{s}/chunk/key/Div")  # indices >= 0: Div floors
        q_chunk = b.op("Div", q_col, b.const(chunk), name=f"{s}/chunk/query/Div")
        same = b.op("Equal", k_chunk, q_chunk, name=f"{s}/chunk/Equal")
        allowed = b.op("And", allowed, same, name=f"{s}/chunk/And")
    pad = b.op("Cast", mask_in, name=f"{s}/padding/Cast", to=TensorProto.BOOL)
    pad = b.op("Unsqueeze", pad, b.const([1, 2]), name=f"{s}/padding/Unsqueeze")  # [B,1,1,T]
    allowed = b.op("And", allowed, pad, name=f"{s}/And")  # [B,1,S,T]
    return b.op("Where", allowed, b.const(0.0, np.float32), b.const(FLOAT_MIN, np.float32), name=f"{s}/Where")


def graph_inputs(b: Builder) -> tuple[str, str, str]:
    """input_ids, attention_mask, position_ids as the graph contract names them."""
    ids, mask, positions = contract.STEP_INPUTS
    b.inputs += [oh.make_tensor_value_info(ids, TensorProto.INT64, ["batch_size", "sequence_length"]),
                 oh.make_tensor_value_info(mask, TensorProto.INT64, ["batch_size", "total_sequence_length"]),
                 oh.make_tensor_value_info(positions, TensorProto.INT64, ["batch_size", "sequence_length"])]
    return contract.STEP_INPUTS


def _kv_info(name: str, length: str, d: Dims) -> onnx.ValueInfoProto:
    return oh.make_tensor_value_info(name, TensorProto.FLOAT, ["batch_size", d.kv_heads, length, d.head_dim])
