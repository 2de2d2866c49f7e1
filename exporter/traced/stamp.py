"""Stamp the traced templates into one graph, with the builder's weights, inputs and outputs.

The outer template's `fuselm_trace::Layer` markers are replaced, in order, by copies of each
layer's kind template: values and nodes renamed under `/model/layers.{i}/`, the layer inputs wired
to the previous hidden state, the shared mask of its kind (exporter/graph.py's `attention_mask`,
sliding window or not) where it reads one, `position_ids`, `past_key_values.{i}.*` and `past_state.{i}.*`
where it has them, the other tensors the model computes for it (the marker's inputs: per-token inputs, ALiBi
biases), and its outputs to `present.{i}.*` / `present_state.{i}.*`. Node names follow the module scopes torch.onnx records
(`/model/layers.3/self_attn/q_proj/MatMul`).

Parameters become the builder's weights (exporter/quant.py's Plan, so f32/f16/q8/q4 are
stored exactly as the builder stores them), named by their HF tensor names:
- `Transpose(W, perm=[1,0])` (torch's Linear) -> the plan's [in, out] weight (Cast / DQ for f16 / q8 / q4);
- `Gather(W, ids)` in the outer graph (the embedding, per-layer or position tables) -> the plan's embedding;
- anything else (norm weights, biases, scales) -> float32 as in the checkpoint.
Non-parameter initializers (buffers, traced constants) are copied once per template.
"""

from __future__ import annotations

import ast

import onnx
from onnx import helper as oh

from fuselm import contract
from fuselm.errors import FuselmError

from ..graph import Builder, attention_mask, graph_inputs
from . import moe
from .trace import LAYER_INPUTS, LAYER_OUTPUTS, Template, _attr


class Stamper:
    """Builds the final graph into a Builder from the outer template and one template per layer kind."""

    def __init__(self, plan, aliases: dict[str, str], layers_prefix: str, embed_name: str, head_name: str):
        self.b, self.plan, self.aliases, self.prefix, self.embed = Builder(), plan, aliases, layers_prefix, embed_name
        self.head = head_name
        self.skip: set[tuple[int, str]] = set()  # (template, node name): nodes a weight's plan replaces (torch's weight Transpose, Gather)
        self.kv_rows: dict[int, tuple[str, str]] = {}  # layer -> the new key/value rows its Attention appends
        self.given: dict[int, str] = {}  # layer -> what it returns beside its hidden state, for a later layer
        self.used: set[str] = set()  # checkpoint tensors the graph reads
        self.as_matmul: dict[tuple[int, str], str] = {}  # Gemm(x, W, transB=1) nodes -> MatMul on the plan's weight
        self.gathers: dict[tuple[int, str], tuple] = {}  # (template, node): an embedding whose ids the graph computes
        self.late: dict[tuple[int, str], tuple] = {}  # (template, node): the Transpose of a head tied to such an embedding
        self.linears: dict[str, str] = {}  # checkpoint weight -> its declared [in, out] form
        self.vectors: dict[str, str] = {}  # checkpoint tensor -> its declared float32 value (norm weights, biases)
        self.value_info: dict[int, dict[str, onnx.ValueInfoProto]] = {}  # per template: value -> traced shape
        self.kinds: dict[int, int] = {}  # template -> its number in stamping order (names that are the same every run)

    def build(self, outer: Template, layers: list[Template], kinds: list[str], sizes: dict[str, int | None],
              sources: list[int | None], carried: list[int | None] | None = None) -> Builder:
        """`kinds`: each layer's mask kind (causal, sliding, chunked: `sizes` has the window and chunk size);
        `sources`: per layer the layer whose keys and values it reads (KV sharing), or None; `carried`: per layer the
        layer whose other output (what it returns beside its hidden state) it is handed, or None."""
        b = self.b
        ids, mask_in, position_ids = graph_inputs(b)
        masks = {}

        def mask(k: str) -> str:  # made where the first layer that reads it is stamped (a recurrent block reads none)
            if k not in masks:
                masks[k] = attention_mask(b, ids, mask_in, sizes.get("sliding") if k == "sliding" else None,
                                          "/model/attn_mask" + ("" if k == "causal" else f"_{k}"),
                                          chunk=sizes.get("chunked") if k == "chunked" else None)
            return masks[k]
        given = {contract.INPUT_IDS: ids, contract.ATTENTION_MASK: mask_in, contract.POSITION_IDS: position_ids}
        names = {v.name: given[v.name] for v in outer.graph.input}  # (mask and positions where the model reads them)
        self._constants(outer, "outer", names)
        self._weights(outer, names, "/model", None, lambda rel: self.aliases.get(rel, rel))
        markers = 0
        for node in outer.graph.node:
            if node.domain == "fuselm_trace" and node.op_type == "Layer":
                i = node.attribute[0].i
                if i < markers:  # a looped (recurrent-depth) model runs its layers again
                    raise FuselmError(f"the traced model calls decoder layer {i} again after layer {markers - 1}: its "
                                      "layers run more than once per token, each run with a cache of its own, and the "
                                      "graph contract holds one cache per layer; not supported")
                if i != markers:
                    raise FuselmError(f"the traced model calls decoder layer {i} out of order; not supported")
                x, inputs = names[node.input[0]], [names[n] for n in node.input[1:]]
                names[node.output[0]] = self._layer(layers[i], i, x, lambda k=kinds[i]: mask(k), position_ids, inputs,
                                                    sources[i] if sources else None,
                                                    carried[i] if carried else None)
                markers += 1
                continue
            self._copy(outer, node, names, "/model", prefix_values="/model/")
        if markers != len(layers):
            raise FuselmError(f"the traced model called {markers} of its {len(layers)} decoder layers; not supported")
        b.nodes[:] = one_rope_layout(b.nodes)
        logits = names[outer.graph.output[0].name]
        b.nodes.append(oh.make_node("Identity", [logits], [contract.LOGITS], name="/model/logits/Identity"))
        vocab = outer.graph.output[0].type.tensor_type.shape.dim[-1].dim_value
        b.outputs.insert(0, oh.make_tensor_value_info(contract.LOGITS, onnx.TensorProto.FLOAT,
                                                      ["batch_size", "sequence_length", vocab]))
        return b

    def _layer(self, t: Template, i: int, x: str, mask, position_ids: str, inputs: list[str],
               source: int | None, handed: int | None = None) -> str:
        """Stamp layer `i` from its kind's template: its pasts become the graph inputs past_key_values.{i}.* /
        past_state.{i}.*, its presents the outputs present.{i}.* / present_state.{i}.*; `mask()` gives the
        attention mask where the template reads one. A layer that reads layer `source`'s keys and values (KV
        sharing) gets that layer's past inputs and new rows and gives no cache outputs of its own; one handed what
        layer `handed` returns beside its hidden state gets it last."""
        from .cache import kv_shape

        b, scope = self.b, f"/model/layers.{i}"
        given = [v.name for v in t.graph.input]
        dims = {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
                for v in t.graph.input}
        names = {"hidden_states": x, "position_ids": position_ids}
        if "attention_mask" in given:
            names["attention_mask"] = mask()
        out_names, out_dims = {}, {}
        if "past_key" in given:
            kv_heads, k_dim, v_dim = kv_shape(t)
            owner = i if source is None else source
            names.update(zip(("past_key", "past_value"), [contract.past_name(owner, k) for k in contract.KINDS], strict=True))
            if source is None:
                for kind, dim in zip(contract.KINDS, (k_dim, v_dim), strict=True):
                    b.inputs.append(oh.make_tensor_value_info(contract.past_name(i, kind), onnx.TensorProto.FLOAT,
                                                              ["batch_size", kv_heads, "past_sequence_length", dim]))
                    out_names[f"present_{kind}"] = contract.present_name(i, kind)
                    out_dims[contract.present_name(i, kind)] = ["batch_size", kv_heads, "total_sequence_length", dim]
            else:
                if source not in self.kv_rows:
                    raise FuselmError(f"layer {i} reads the keys and values of layer {source}, whose attention does not "
                                      "append them to its cache in one Attention op; not supported")
                inputs = [*inputs, *self.kv_rows[source]]
        if "past_index" in given:  # a sparse-attention layer's indexer keys: a third cache that grows like K/V
            names["past_index"], out_names["present_index"] = contract.past_name(i, "index"), contract.present_name(i, "index")
            width = dims["past_index"][3]
            b.inputs.append(oh.make_tensor_value_info(names["past_index"], onnx.TensorProto.FLOAT,
                                                      ["batch_size", 1, "past_sequence_length", width]))
            out_dims[out_names["present_index"]] = ["batch_size", 1, "total_sequence_length", width]
        if handed is not None:
            inputs = [*inputs, self.given[handed]]
        for kind in contract.STATE_KINDS:  # recurrent states: fixed size, the present replaces the past
            if f"past_{kind}" in given:
                past, present = contract.state_name(i, kind), contract.state_name(i, kind, contract.STATE_PRESENT)
                b.inputs.append(oh.make_tensor_value_info(past, onnx.TensorProto.FLOAT,
                                                          ["batch_size", *dims[f"past_{kind}"][1:]]))
                names[f"past_{kind}"], out_names[f"present_{kind}"] = past, present
                out_dims[present] = ["batch_size", *dims[f"past_{kind}"][1:]]
        extra = [n for n in given if n not in LAYER_INPUTS]
        if len(extra) != len(inputs):
            raise FuselmError(f"layer {i}: the traced layer takes {len(extra)} other inputs, the model gives it "
                              f"{len(inputs)}; not supported")
        names.update(zip(extra, inputs, strict=True))
        self._constants(t, f"layer_kind_{self.kinds.setdefault(id(t), len(self.kinds))}", names)
        self._weights(t, names, scope, i, lambda rel: self.aliases.get(f"{self.prefix}.{i}.{rel}", f"{self.prefix}.{i}.{rel}"))
        outputs = [o.name for o in t.graph.output]
        assert outputs[0] == "hidden_out" and set(outputs) <= set(LAYER_OUTPUTS) and given[0] == LAYER_INPUTS[0]
        # a reader's Attention appends the source's rows again: its presents (onnxruntime wants them where a past is
        # given) are the source's present values, read by nothing
        first = len(b.nodes)
        for node in t.graph.node:
            self._copy(t, node, names, scope, prefix_values=f"{scope}/", fixed=out_names)
        for out, name in out_names.items():
            if names.get(out) != name:
                raise FuselmError(f"layer {i}: the traced layer does not produce its {out} output directly; not supported")
            b.outputs.append(oh.make_tensor_value_info(name, onnx.TensorProto.FLOAT, out_dims[name]))
        if "carried_out" in outputs:
            self.given[i] = names["carried_out"]
        key = contract.present_name(i, "key")
        attention = next((n for n in b.nodes[first:] if n.op_type == "Attention" and key in n.output), None)
        if attention is not None:
            self.kv_rows[i] = (attention.input[1], attention.input[2])
        return names[outputs[0]]

    def _constants(self, t: Template, tag: str, names: dict[str, str]) -> None:
        """Traced non-parameter initializers, once per template (shared by every stamp of it)."""
        for name, proto in t.constants.items():
            key = ("traced", tag, name)
            if key not in self.b.constants:
                copy = onnx.TensorProto()
                copy.CopyFrom(proto)
                copy.name = f"/model/traced/{tag}/{name}"
                self.b.constants[key] = copy
            names[name] = self.b.constants[key].name

    def _weights(self, t: Template, names: dict[str, str], scope: str, layer: int | None, hf_name) -> None:
        """Declare the plan's weights for the template's parameters; map the values that use them."""
        consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in t.graph.node:
            for inp in node.input:
                if inp in t.params:
                    consumers.setdefault(inp, []).append(node)
        for value, rel in t.params.items():
            name = hf_name(rel)
            if name not in self.plan.shapes:
                raise FuselmError(f"the traced model reads parameter {name}, which is not a tensor of the checkpoint")
            self.used.add(name)
            vector = experts = None
            for node in consumers.get(value, []):
                if node.op_type == "Transpose" and _attr(node, "perm", None) == [1, 0] and len(self.plan.shapes[name]) == 2:
                    if layer is None and name == self.embed and any(
                            n.op_type == "Gather" and n.input[1] not in names for n in consumers[value]):
                        self.late[(id(t), node.name)] = (name, scope)  # a tied head: declared after its embedding
                        continue
                    names[node.output[0]] = self._linear(name, scope, layer)
                elif node.op_type == "Gather" and node.input[0] == value and _attr(node, "axis", 0) == 0 and layer is None:
                    other = None if name == self.embed else self._scope(name, scope, layer)  # per-layer embeddings
                    if node.input[1] not in names:  # ids computed in the graph (Gemma 3n clips them): stamped in order
                        self.gathers[(id(t), node.name)] = (name, other)
                        continue
                    names[node.output[0]] = self.plan.embedding(self.b, name, names[node.input[1]], other)
                elif moe.reads_experts(node, value) and experts is None:  # stacked experts: the plan's precision
                    experts = moe.expert_weight(self.plan, self.b, name, self._scope(name, scope, layer), layer)
                    continue
                elif _plain_gemm(node, value) and len(self.plan.shapes[name]) == 2:  # a Linear on [tokens, in]
                    self.as_matmul[(id(t), node.name)] = self._linear(name, scope, layer)
                    continue
                else:
                    continue
                self.skip.add((id(t), node.name))
            if any((id(t), n.name) not in self.skip and (id(t), n.name) not in self.as_matmul and not moe.reads_experts(n, value)
                   and (id(t), n.name) not in self.gathers and (id(t), n.name) not in self.late
                   for n in consumers.get(value, [])):
                if name not in self.vectors:  # declared once: a module shared by several layers (Zamba's)
                    self.vectors[name] = self.plan.vector(self.b, name, layer)
                vector = self.vectors[name]
            names[value] = experts or vector or name

    def _scope(self, name: str, scope: str, layer: int | None) -> str:
        """`{scope}/{module path}` of a layer's parameter (`/model/layers.0/mlp/experts/gate_up_proj`)."""
        rel = name[len(f"{self.prefix}.{layer}."):] if layer is not None else name
        return f"{scope}/{rel.removesuffix('.weight').replace('.', '/')}"

    def _linear(self, name: str, scope: str, layer: int | None) -> str:
        """The plan's [in, out] weight for the Linear weight `name`, declared once (Gemma 3n's AltUp router runs twice)."""
        if name not in self.linears and layer is None and name == self.head:  # get_output_embeddings(), tied or not
            self.linears[name] = self.plan.head_weight(self.b, self.embed, None if name == self.embed else name)
        elif name not in self.linears:  # a layer's Linear, or another one around the layers (a projection in or out)
            self.linears[name] = self.plan.linear_weight(self.b, name, self._scope(name, scope, layer), layer)
        return self.linears[name]

    def _copy(self, t: Template, node: onnx.NodeProto, names: dict[str, str], scope: str, prefix_values: str,
              fixed: dict[str, str] | None = None) -> None:
        if (id(t), node.name) in self.skip:
            return
        if (id(t), node.name) in self.late:
            name, at = self.late[(id(t), node.name)]
            names[node.output[0]] = self._linear(name, at, None)
            return
        if (id(t), node.name) in self.gathers:
            name, other = self.gathers[(id(t), node.name)]
            names[node.output[0]] = self.plan.embedding(self.b, name, names[node.input[1]], other)
            return
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            raise FuselmError(f"the traced graph has a control-flow node ({node.op_type}); not supported")
        fixed = fixed or {}
        new = onnx.NodeProto()
        new.CopyFrom(node)
        del new.metadata_props[:]
        for k, inp in enumerate(node.input):
            if inp:
                if inp not in names:
                    raise FuselmError(f"traced node {node.name} reads {inp}, which nothing produces; not supported")
                new.input[k] = names[inp]
        if (id(t), node.name) in self.as_matmul:  # x @ W^T as the dense layers write it: MatMul on [in, out]
            new.op_type, new.input[1] = "MatMul", self.as_matmul[(id(t), node.name)]
            del new.attribute[:]
        shapes = self._shapes(t)
        for k, out in enumerate(node.output):
            if out:
                names[out] = fixed.get(out, f"{prefix_values}{out}")
                new.output[k] = names[out]
                if out in shapes and out not in fixed:  # the trace's static dims (heads, head_dim) for passes
                    info = onnx.ValueInfoProto()
                    info.CopyFrom(shapes[out])
                    info.name = names[out]
                    for d in info.type.tensor_type.shape.dim:
                        if not d.HasField("dim_value"):
                            d.Clear()
                    self.b.value_info.append(info)
        new.name = self._node_name(node, scope)
        self.b.node(new)

    def _shapes(self, t: Template) -> dict[str, onnx.ValueInfoProto]:
        if id(t) not in self.value_info:
            self.value_info[id(t)] = {v.name: v for v in t.graph.value_info if v.type.HasField("tensor_type")}
        return self.value_info[id(t)]

    def _node_name(self, node: onnx.NodeProto, scope: str) -> str:
        """`{scope}/{module path}/{op}` from the name scopes torch.onnx records, made unique."""
        meta = {p.key: p.value for p in node.metadata_props}
        path = ""
        try:
            scopes = ast.literal_eval(meta.get("pkg.torch.onnx.name_scopes", "[]"))
            modules = [s for s in scopes if s.startswith(("layer.", "lm."))]
            if modules:
                path = modules[-1].split(".", 1)[1]
                path = path.removeprefix("model.") if scope == "/model" else path
        except (ValueError, SyntaxError):
            pass
        base = "/".join(p for p in (scope, path.replace(".", "/"), node.op_type) if p)
        name, n = base, 0
        while name in self.b._node_names:
            n += 1
            name = f"{base}_{n}"
        return name


def _plain_gemm(node: onnx.NodeProto, value: str) -> bool:
    """Gemm(x, W, transB=1) with no bias or scaling: torch's Linear on a 2-D input (MoE shared experts)."""
    return (node.op_type == "Gemm" and list(node.input) == [node.input[0], value] and _attr(node, "transB", 0) == 1
            and not _attr(node, "transA", 0) and _attr(node, "alpha", 1.0) == 1.0)


# where a walk forward from a rotary's output stops: attention reads it (q, k, v inputs), or it only selects keys
_READERS = {("", "Attention"): 3, (contract.DOMAIN, contract.LATENT_OP): 3, ("", "TopK"): 0}


def one_rope_layout(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """`nodes` with FusedRoPE nodes of one layout (its function has one body per graph): where they mix interleaved and
    rotate-half, those that attention does not read (DeepSeek-V3.2's indexer, rotate-half beside its interleaved
    attention: its keys only select) are written in standard ops. A graph whose attention reads both is refused."""
    ropes = [n for n in nodes if n.domain == contract.DOMAIN and n.op_type == contract.ROPE_OP]
    if len({_attr(n, "interleaved", 0) for n in ropes}) < 2:
        return nodes
    users: dict[str, list[onnx.NodeProto]] = {}
    for n in nodes:
        for x in n.input:
            users.setdefault(x, []).append(n)

    def read_by_attention(rope) -> bool:
        todo, seen = [rope.output[0]], set()
        while todo:
            value = todo.pop()
            for n in users.get(value, []):
                reads = _READERS.get((n.domain, n.op_type))
                if reads is not None:
                    if value in n.input[:reads]:
                        return True
                elif id(n) not in seen:
                    seen.add(id(n))
                    todo.extend(n.output)
        return False

    attended = {_attr(n, "interleaved", 0) for n in ropes if read_by_attention(n)}
    if len(attended) != 1:
        return nodes  # (contract.rope_form refuses the mix by name)
    out = []
    for n in nodes:
        is_other = n.domain == contract.DOMAIN and n.op_type == contract.ROPE_OP and _attr(n, "interleaved", 0) not in attended
        out.extend(contract.rope_in_standard_ops(n) if is_other else [n])
    return out
