"""The runtime as an `onnx.backend.base.Backend`, so ONNX's own node tests can run against the op table.

    from onnx_backend import FuselmBackend
    rep = FuselmBackend.prepare(model)          # torch on CPU by default
    outputs = rep.run([x, y])

tests/test_runtime_conformance.py runs `onnx.backend.test.case.node.collect_testcases()` for
every standard op the table claims, with each exclusion listed with its reason.
"""

from __future__ import annotations

import numpy as np
import onnx
from fuselm.runtime_metal import rewrites
from fuselm.runtime_metal.backends import make_backend
from fuselm.runtime_metal.executor import Executor
from fuselm.runtime_metal.loader import LoadedModel, tensor_to_array
from onnx.backend.base import Backend, BackendRep


def load_proto(model: onnx.ModelProto) -> LoadedModel:
    """A LoadedModel from an in-memory ModelProto with inline tensors (no external data)."""
    g = model.graph
    inits = {t.name: tensor_to_array(t) for t in g.initializer}
    inputs = {vi.name: (vi.type.tensor_type.elem_type, [d.dim_value or d.dim_param or None
                                                        for d in vi.type.tensor_type.shape.dim])
              for vi in g.input if vi.name not in inits}
    return LoadedModel(g, inits, {(f.domain, f.name): f for f in model.functions},
                       {o.domain or "": o.version for o in model.opset_import}, path=None, meta=None,
                       input_types=inputs, output_names=[o.name for o in g.output])


class FuselmRep(BackendRep):
    def __init__(self, model: onnx.ModelProto, backend: str = "torch", device: str | None = "cpu",
                 fused: bool = True):
        self.b = make_backend(backend, device)
        self.graph = rewrites.prepare(load_proto(model), self.b, fused)
        self.executor = Executor(self.graph, self.b)

    def run(self, inputs, **kwargs):
        if isinstance(inputs, dict):
            feeds = dict(inputs)
        else:
            inputs = inputs if isinstance(inputs, (list, tuple)) else [inputs]
            feeds = dict(zip(self.graph.inputs, inputs, strict=False))
        feeds = {k: tensor_to_array(v) if isinstance(v, onnx.TensorProto) else np.asarray(v) for k, v in feeds.items()}
        out = self.executor.run({k: self.b.asarray(v) for k, v in feeds.items()})
        return [self.b.to_numpy(out[name]) for name in self.graph.outputs]


class FuselmBackend(Backend):
    @classmethod
    def prepare(cls, model, device: str = "CPU", **kwargs):
        super().prepare(model, device, **kwargs)
        return FuselmRep(model, **kwargs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device.upper() == "CPU"

    @classmethod
    def run_node(cls, node, inputs, device="CPU", outputs_info=None, **kwargs):
        raise NotImplementedError("fuselm runs whole models; build a one-node model and call prepare")
