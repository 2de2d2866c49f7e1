"""UpgradeOpset: a graph at default-domain opset 14-22 -> opset 23, before any fusion runs.

torch.onnx (both exporters) writes opset 20 by default, optimum 14-18, onnxruntime-genai 21/22;
the fusions write opset-23 ops (RMSNormalization, Attention), which need the graph at 23.
"""

from __future__ import annotations

import onnx
import onnx.version_converter
import onnx_ir as ir

from fuselm.contract import OPSET as TARGET_OPSET
from fuselm.errors import FuselmError, shown
from fuselm.graphcheck import ORT_ONNX_DOMAIN_CONTRIB

from .base import Pass, Stats

OLDEST_OPSET = 14  # the oldest opset the exporters users bring write (optimum's default)
# Held out of the converter (it knows no schema for them) and mapped by FromGenAI afterwards:
# onnxruntime registers these contrib ops in the ONNX domain, and onnxruntime-genai writes them there.
_HELD = "fuselm.held"


class UpgradeOpset(Pass):
    """Default-domain opset 14..22 -> 23 with onnx's version converter (its adapters rewrite the ops
    whose signature changed, e.g. ReduceMean's axes attribute becoming an input at 18).

    The converter sees the graph without its weights (initializers become typed inputs while it
    runs), so nothing is read from the data file; onnxruntime's contrib ops in the ONNX domain
    (onnxruntime-genai's SimplifiedLayerNormalization) are held out of it and kept as they are.
    Must not fire: the graph is at 23 already. Refuses (FuselmError): an opset above 23 (no
    down-conversion) or below 14; a node the converter cannot upgrade (named, with its op).
    """

    aliases = ("upgrade-opset", "opset")

    def apply(self, model: ir.Model, stats: Stats) -> bool:
        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))
        if opset == TARGET_OPSET:
            return False
        if opset > TARGET_OPSET or opset < OLDEST_OPSET:
            raise FuselmError(f"the graph uses default-domain opset {opset}; fuselm reads opsets {OLDEST_OPSET}.."
                              f"{TARGET_OPSET} (it writes {TARGET_OPSET}); re-export it at one of those "
                              f"(torch.onnx.export(..., opset_version={TARGET_OPSET}) or `fuselm convert`)")
        converted = _convert(model, opset)
        _take_graph(model, converted)
        stats.fire(f"default-domain opset {opset} -> {TARGET_OPSET}")
        stats.counts["opset_from"] = opset
        return True


def _convert(model: ir.Model, opset: int) -> onnx.ModelProto:
    proto = _graph_only(model)
    held = [n for n in proto.graph.node if n.domain in ("", "ai.onnx") and n.op_type in ORT_ONNX_DOMAIN_CONTRIB]
    for n in held:
        n.domain = _HELD
    if held:
        proto.opset_import.append(onnx.helper.make_opsetid(_HELD, 1))
    try:
        converted = onnx.version_converter.convert_version(proto, TARGET_OPSET)
    except Exception as e:  # the C++ converter raises RuntimeError / ValidationError with a terse text
        node = _first_unconvertible(proto)
        where = f"node {shown(node.name, 80)} ({node.op_type})" if node is not None else "a node"
        raise FuselmError(f"onnx's version converter cannot upgrade {where} from opset {opset} to "
                          f"{TARGET_OPSET} ({shown(str(e).strip().splitlines()[-1] if str(e).strip() else '', 200)}); "
                          f"re-export the model at opset {TARGET_OPSET} (torch.onnx.export(..., "
                          f"opset_version={TARGET_OPSET})) or `fuselm convert` the checkpoint") from None
    for n in converted.graph.node:
        if n.domain == _HELD:
            n.domain = ""
    kept = [o for o in converted.opset_import if o.domain != _HELD]
    del converted.opset_import[:]
    converted.opset_import.extend(kept)
    return converted


def _graph_only(model: ir.Model) -> onnx.ModelProto:
    """The model as a proto whose initializers are typed graph inputs (no tensor bytes read)."""
    proto = onnx.ModelProto()
    proto.ir_version = max(model.ir_version, 8)
    for domain, version in model.opset_imports.items():
        proto.opset_import.append(onnx.helper.make_opsetid(domain, version))
    inits = dict(model.graph.initializers)
    saved = {name: v.const_value for name, v in inits.items()}
    try:
        for v in inits.values():
            v.const_value = None
        model.graph.initializers.clear()
        extra = [v for v in inits.values() if v not in model.graph.inputs]
        model.graph.inputs.extend(extra)
        proto.graph.CopyFrom(ir.serde.serialize_graph(model.graph))
    finally:
        n = len(model.graph.inputs) - len(extra)
        del model.graph.inputs[n:]
        for name, v in inits.items():
            v.const_value = saved[name]
            model.graph.register_initializer(v)
    for f in model.functions.values():
        proto.functions.append(ir.serde.serialize_function(f))
    return proto


def _take_graph(model: ir.Model, converted: onnx.ModelProto) -> None:
    """Put the converted graph into `model`, its initializers back as the original (lazy) tensors."""
    inits = {name: v.const_value for name, v in model.graph.initializers.items()}
    n_inputs = len(model.graph.inputs)
    graph = ir.serde.deserialize_model(converted).graph
    for v in graph.inputs:
        if v.name in inits:
            v.const_value = inits[v.name]
            graph.register_initializer(v)
    del graph.inputs[n_inputs:]
    model.graph = graph  # the model's opset imports are its graph's


def _first_unconvertible(proto: onnx.ModelProto) -> onnx.NodeProto | None:
    """The first default-domain node the converter refuses on its own (a one-node model each)."""
    types = {v.name: v for v in [*proto.graph.input, *proto.graph.value_info, *proto.graph.output]}
    opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    for node in proto.graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        ins = [types.get(i) or onnx.helper.make_tensor_value_info(i, onnx.TensorProto.FLOAT, None)
               for i in dict.fromkeys(x for x in node.input if x)]
        outs = [onnx.helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in node.output if o]
        one = onnx.helper.make_model(onnx.helper.make_graph([node], "one", ins, outs),
                                     opset_imports=[onnx.helper.make_opsetid("", opset)], ir_version=proto.ir_version)
        try:
            onnx.version_converter.convert_version(one, TARGET_OPSET)
        except Exception:
            return node
    return None
