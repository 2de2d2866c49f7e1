"""Tiny graphs built in code, and the before/after onnxruntime comparison every fusion test runs."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, numpy_helper
from onnx import helper as oh

from fuselm import contract
from fuselm.reference import ort_session

FLOAT = TensorProto.FLOAT


class G:
    """A small graph builder: g.node("MatMul", [a, b]) returns the output name."""

    def __init__(self):
        self.inputs, self.outputs, self.nodes, self.inits = [], [], [], []
        self.feeds: dict[str, np.ndarray] = {}
        self._n = 0
        self.rng = np.random.default_rng(0)

    def inp(self, name, shape, dtype=FLOAT, value=None):
        self.inputs.append(oh.make_tensor_value_info(name, dtype, shape))
        if value is None:
            value = self.rng.standard_normal(shape).astype(np.float32)
        self.feeds[name] = value
        return name

    def init(self, name, array):
        array = np.asarray(array)
        self.inits.append(numpy_helper.from_array(array, name))
        return name

    def weight(self, name, shape, scale=0.3):
        return self.init(name, (self.rng.standard_normal(shape) * scale).astype(np.float32))

    def raw_init(self, name, data_type, dims, values):
        self.inits.append(oh.make_tensor(name, data_type, dims, values))
        return name

    def node(self, op, inputs, n_out=1, name=None, domain="", **attrs):
        self._n += 1
        name = name or f"n{self._n}_{op}"
        outs = [f"{name}_out{i}" for i in range(n_out)]
        self.nodes.append(oh.make_node(op, inputs, outs, name=name, domain=domain, **attrs))
        return outs[0] if n_out == 1 else outs

    def out(self, value, name=None, dtype=FLOAT, rank=3):
        if name is not None:
            value = self.node("Identity", [value], name=f"{name}_identity")
            self.nodes[-1].output[0] = name
            value = name
        self.outputs.append(oh.make_tensor_value_info(value, dtype, [f"{value}_d{i}" for i in range(rank)]))
        return value

    def model(self) -> onnx.ModelProto:
        g = oh.make_graph(self.nodes, "tiny", self.inputs, self.outputs, initializer=self.inits)
        return oh.make_model(g, opset_imports=[oh.make_opsetid("", contract.OPSET)], ir_version=11)


def run(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    s = ort_session(model)
    return dict(zip([o.name for o in s.get_outputs()], s.run(None, feeds), strict=True))


def apply(pass_, model: onnx.ModelProto):
    """Run one pass on a ModelProto; returns (new ModelProto, modified, stats); checks validity."""
    m = ir.serde.deserialize_model(model)
    m, modified, stats = pass_(m)
    out = ir.serde.serialize_model(m)
    onnx.checker.check_model(out, full_check=True)
    return out, modified, stats


def ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def assert_same(before: onnx.ModelProto, after: onnx.ModelProto, feeds: dict, rtol: float = 1e-5) -> None:
    a, b = run(before, feeds), run(after, feeds)
    assert list(a) == list(b), (list(a), list(b))
    for name in a:
        scale = max(float(np.max(np.abs(a[name]))), 1e-6)
        err = float(np.max(np.abs(a[name].astype(np.float64) - b[name])))
        assert err <= rtol * scale, f"{name}: max abs diff {err} vs scale {scale}"


def quantize_uint4(w: np.ndarray, block: int):
    """w [in, out] -> (q uint4 values [in, out], scale [in/block, out], zero point) blocked along axis 0."""
    rows, cols = w.shape
    blocks = w.reshape(rows // block, block, cols)
    lo, hi = np.minimum(blocks.min(1), 0), np.maximum(blocks.max(1), 0)
    scale = ((hi - lo) / 15).astype(np.float32)
    scale[scale == 0] = 1
    zp = np.clip(np.round(-lo / scale), 0, 15).astype(np.uint8)
    q = np.clip(np.round(blocks / scale[:, None]) + zp[:, None], 0, 15).astype(np.uint8).reshape(rows, cols)
    return q, scale, zp


def dq_weight(g: G, name: str, shape, block: int = 16, dtype=TensorProto.UINT4, bits: int = 4):
    """DequantizeLinear(uint4 [in, out], scale, zero point; axis 0, block) of a random weight."""
    w = (g.rng.standard_normal(shape) * 0.3).astype(np.float32)
    q, scale, zp = quantize_uint4(w, block)
    if bits == 8:
        q, zp = q * 16, zp * 16
    qn = g.raw_init(f"{name}.qweight", dtype, list(q.shape), q.ravel().tolist())
    sn = g.init(f"{name}.scales", scale)
    zn = g.raw_init(f"{name}.zero_points", dtype, list(zp.shape), zp.ravel().tolist())
    return g.node("DequantizeLinear", [qn, sn, zn], name=f"{name}/DequantizeLinear", axis=0, block_size=block)
