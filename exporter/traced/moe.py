"""Sparse mixture-of-experts blocks, found by structure and traced as one `fuselm::MoE` op.

A block is a module with two children: a router holding one weight [E, H] and an experts module
holding the stacked expert weights `gate_up_proj` [E, 2I, H] (gate rows first) and `down_proj`
[E, H, I] (transformers 5's layout for Mixtral, Qwen2/3-MoE, OLMoE, Granite-MoE, ...). Anything
else in the block (Qwen2-MoE's shared expert and its sigmoid gate) is traced as plain nodes beside
the op. Nothing is per family: what the router computes (renormalised top-k or not) and the expert
activation are read back by running the model's own router and experts modules on random tensors
and matching them against the op's reference (`reference`), as rope_op.py does for the rotary;
a block that matches no form is refused instead of exported wrong.

While a layer is traced, the router's forward returns placeholders and the experts' forward calls
`fuselm_trace::moe`, so the data-dependent expert loop is never traced.

Checkpoints store the experts per expert (`experts.{e}.w1.weight`, ...) or stacked; transformers'
own conversion mapping (its WeightConverters: MergeModulelist + Concatenate) says which stored
tensors make each stacked parameter. `ExpertCheckpoint` presents the stacked parameters as
tensors read a few experts at a time, so converting streams like a dense model (memory: one block
of experts, whatever their number).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
from onnx import TensorProto
from torch import nn

from fuselm import contract
from fuselm.errors import FuselmError

from ..quant import _QTYPE, quantize
from ..weights import Checkpoint

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


@dataclass
class Block:
    """One sparse MoE block: where it is, its router and experts, and the routing the op reproduces."""

    name: str
    module: nn.Module
    router: nn.Module
    experts: nn.Module
    weight_at: tuple[nn.Module, str] = (None, "weight")  # the router's one parameter: (owner, name)
    bias_at: tuple[nn.Module, str] | None = None  # a selection bias buffer [E] (e_score_correction_bias)
    top_k: int = 0
    normalize: int = 0
    activation: str = "silu"
    scoring: str = "softmax"
    scaling: float = 1.0

    @property
    def num_experts(self) -> int:
        return self.experts.gate_up_proj.shape[0]

    @property
    def router_weight(self) -> torch.Tensor:
        return getattr(*self.weight_at)

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(*self.bias_at) if self.bias_at else None


# --- the op --------------------------------------------------------------------------------------
@torch.library.custom_op("fuselm_trace::moe", mutates_args=())
def moe(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, bias: torch.Tensor | None,
        top_k: int, normalize: int, activation: str, scoring: str, scaling: float) -> torch.Tensor:
    """x [..., H] -> y [..., H]: fuselm::MoE (contract.moe_function's semantics)."""
    return reference(x, router, gate_up, down, top_k, normalize, activation,
                     routed=routing(x.reshape(-1, x.shape[-1]), router, top_k, normalize, scoring, bias, scaling))


@moe.register_fake
def _(x, router, gate_up, down, bias, top_k, normalize, activation, scoring, scaling):
    return torch.empty_like(x)


_ACTIVATIONS = {"silu": nn.functional.silu, "gelu": nn.functional.gelu,
                "gelu_tanh": lambda x: nn.functional.gelu(x, approximate="tanh")}


def routing(x2: torch.Tensor, router: torch.Tensor, top_k: int, normalize: int, scoring: str = "softmax",
            bias: torch.Tensor | None = None, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], experts [T, k]): softmax over the experts (or each one's sigmoid, chosen with `bias`
    added), the top_k, renormalised if asked, times `scaling`."""
    logits = x2.float() @ router.float().T
    probs = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    choice = probs + bias.float() if bias is not None and scoring == "sigmoid" else probs
    index = torch.topk(choice, top_k, dim=-1).indices
    values = probs.gather(1, index)
    if normalize:
        values = values / values.sum(dim=-1, keepdim=True)
    return values * scaling, index


def reference(x, router, gate_up, down, top_k: int, normalize: int, activation: str,
              routed: tuple | None = None) -> torch.Tensor:
    """The op in torch, sparse: each token through its top_k experts."""
    x2 = x.reshape(-1, x.shape[-1])
    weights, index = routed if routed is not None else routing(x2, router, top_k, normalize)
    out = torch.zeros_like(x2)
    act = _ACTIVATIONS[activation]
    for e in index.unique().tolist():
        tok, slot = torch.where(index == e)
        gate, up = (x2[tok] @ gate_up[e].T).chunk(2, dim=-1)
        out.index_add_(0, tok, (act(gate) * up) @ down[e].T * weights[tok, slot, None].to(x2.dtype))
    return out.reshape(x.shape)


def translation():
    """{torch op: onnxscript callable} for torch.onnx.export's custom_translation_table."""
    from onnxscript import values

    op = values.Op(values.Opset(contract.DOMAIN, contract.DOMAIN_VERSION), contract.MOE_OP, contract.moe_schema())

    def to_onnx(x, router, gate_up, down, bias, top_k, normalize, activation, scoring, scaling):
        inputs = (x, router, gate_up, down) + ((bias,) if bias is not None else ())
        return op(*inputs, top_k=int(top_k), normalize=int(normalize), activation=str(activation), scoring=str(scoring),
                  scaling=float(scaling))

    return {torch.ops.fuselm_trace.moe.default: to_onnx}


# --- finding and checking the blocks -------------------------------------------------------------
def _expert_params(m: nn.Module) -> bool:
    p = dict(m.named_parameters(recurse=False))
    return all(k in p and p[k].dim() == 3 for k in EXPERT_PARAMS)


def find_blocks(model: nn.Module, model_type: str) -> list[Block]:
    """Every sparse MoE block of the model (a router + stacked experts pair of children), checked."""
    blocks = []
    for name, m in model.named_modules():
        experts = [c for c in m.children() if _expert_params(c)]
        if not experts:
            continue
        where = f"{name}.{next(n for n, c in m.named_children() if c is experts[0])}"
        ex = experts[0]
        extra = sorted(set(dict(ex.named_parameters()).keys()) - set(EXPERT_PARAMS))
        if len(experts) != 1 or extra:
            raise FuselmError(f"model_type {model_type!r}: its experts at {where} carry {', '.join(extra) or 'two stacks'} "
                              "beside gate_up_proj/down_proj (expert biases); fuselm::MoE has no expert biases yet")
        n_exp, hidden = ex.gate_up_proj.shape[0], ex.gate_up_proj.shape[2]
        routers = [(c, at) for c in m.children() if c is not ex and (at := _one_weight(c, (n_exp, hidden)))]
        if len(routers) != 1:
            raise FuselmError(f"model_type {model_type!r}: the experts at {where} have no router of one weight "
                              f"[{n_exp}, {hidden}] beside them (a router with a bias or its own layout); not supported")
        blocks.append(_checked(Block(name, m, routers[0][0], ex, routers[0][1]), model_type))
    return blocks


def _one_weight(module: nn.Module, shape: tuple[int, int]) -> tuple[nn.Module, str] | None:
    """(owner, name) of the module's only parameter when it has `shape` (its own `weight`, or a Linear
    inside it: HunYuan's `gate.wg`); None otherwise (a bias, a second tensor, another shape)."""
    params = list(module.named_parameters())
    if len(params) != 1 or tuple(params[0][1].shape) != shape:
        return None
    owner, _, name = params[0][0].rpartition(".")
    return (module.get_submodule(owner) if owner else module), name


def covered(model: nn.Module, blocks: list[Block]) -> set[int]:
    """ids of the modules inside the blocks (the blocks themselves included)."""
    return {id(x) for b in blocks for x in b.module.modules()}


def _checked(block: Block, model_type: str) -> Block:
    """Read top_k, the routing (scoring, normalize, scaling, selection bias) and the activation back from the
    model's own router and experts."""
    gen = torch.Generator().manual_seed(0)
    n_exp, hidden = block.num_experts, block.experts.gate_up_proj.shape[2]
    x2 = torch.randn(7, hidden, generator=gen)
    block.bias_at = _selection_bias(block)
    owner, pname = block.weight_at
    with _swapped(owner, **{pname: torch.randn(n_exp, hidden, generator=gen)}), torch.no_grad(), \
            _buffer_swapped(block.bias_at, torch.rand(n_exp, generator=gen)):
        router = block.router
        try:
            try:
                out = router(x2)
            except TypeError:  # MiniMax-M2's router takes the block's bias as an argument
                if block.bias is None:
                    raise
                out = router(x2, block.bias)
        except Exception as e:
            raise FuselmError(f"model_type {model_type!r}: its router at {block.name} does not run on [tokens, hidden] "
                              f"({type(e).__name__}: {str(e)[:120]}); not supported") from None
        parts = list(out) if isinstance(out, tuple) else [out]
        index = next((t for t in parts if isinstance(t, torch.Tensor) and not t.is_floating_point()), None)
        if index is None:
            raise FuselmError(f"model_type {model_type!r}: its router at {block.name} returns no expert indices; not supported")
        weights = next((t for t in parts if isinstance(t, torch.Tensor) and t.is_floating_point()
                        and t.shape == index.shape), None)
        top_k = index.shape[-1]
        if not _routing_form(block, x2, index, weights, top_k):
            raise FuselmError(f"model_type {model_type!r}: its router at {block.name} is neither softmax-top-k nor "
                              "sigmoid-top-k with a selection bias, renormalised or not (grouped top-k, a router bias, "
                              "sparsemixer); fuselm::MoE cannot express it")
        # the experts on tiny stand-in weights (the real expert count, small widths)
        inter, h = 4, 8
        small = {"gate_up_proj": torch.randn(n_exp, 2 * inter, h, generator=gen) * 0.5,
                 "down_proj": torch.randn(n_exp, h, inter, generator=gen) * 0.5}
        xs = torch.randn(5, h, generator=gen)
        w_small, i_small = routing(xs, torch.randn(n_exp, h, generator=gen), top_k, 1)
        with _swapped(block.experts, **small) as experts:
            try:
                got = experts(xs, i_small, w_small)
            except Exception as e:
                raise FuselmError(f"model_type {model_type!r}: its experts at {block.name} do not run as "
                                  f"experts(hidden, top_k_index, top_k_weights) ({type(e).__name__}: {str(e)[:120]}); "
                                  "not supported") from None
        for activation in contract.MOE_ACTIVATIONS:
            want = reference(xs, None, small["gate_up_proj"], small["down_proj"], top_k, 1, activation,
                             routed=(w_small, i_small))
            if got.shape == want.shape and torch.allclose(got, want, atol=1e-5):
                block.activation = activation
                return block
    raise FuselmError(f"model_type {model_type!r}: its experts at {block.name} are not act(gate) * up -> down over "
                      "gate_up_proj = [gate; up] with silu or gelu (an interleaved or clamped GLU); fuselm::MoE "
                      "cannot express them")


def _routing_form(block: Block, x2, index, weights, top_k: int) -> bool:
    """Set the block's top_k, scoring, normalize and scaling from the router's output on `x2`; False if
    no form of fuselm::MoE gives its choice of experts and their weights (compared in expert order:
    routers may return the top_k unsorted)."""
    if weights is None:
        return False
    order = index.argsort(-1)
    index, weights = index.gather(1, order), weights.float().gather(1, order)
    for scoring in contract.MOE_SCORINGS:
        for normalize in (1, 0):
            w, i = routing(x2, block.router_weight, top_k, normalize, scoring, block.bias)
            mine = i.argsort(-1)
            w, i = w.gather(1, mine), i.gather(1, mine)
            scaling = float((weights / w).mean())
            if torch.equal(i, index) and torch.allclose(w * scaling, weights, atol=1e-5, rtol=1e-4):
                block.top_k, block.scoring, block.normalize = int(top_k), scoring, normalize
                block.scaling = 1.0 if abs(scaling - 1.0) < 1e-6 else scaling
                if scoring == "softmax":
                    block.bias_at = None  # a softmax router chose without it
                return True
    return False


def _selection_bias(block: Block) -> tuple[nn.Module, str] | None:
    """A persistent float buffer [E] of the router (or of the block itself): the bias added to the scores
    when choosing experts (DeepSeek-V3's e_score_correction_bias)."""
    n_exp = block.num_experts
    owners = [(m, n) for m in block.router.modules() for n in m._buffers] + [(block.module, n) for n in block.module._buffers]
    found = [(m, n) for m, n in owners if m._buffers[n] is not None and tuple(m._buffers[n].shape) == (n_exp,)
             and m._buffers[n].is_floating_point() and n not in m._non_persistent_buffers_set]
    return found[0] if len(found) == 1 else None


@contextlib.contextmanager
def _buffer_swapped(at: tuple[nn.Module, str] | None, value: torch.Tensor):
    """A buffer replaced by `value` (random: the check sees whether it steers the choice), put back afterwards."""
    if at is None:
        yield
        return
    module, name = at
    old = module._buffers[name]
    module._buffers[name] = value
    try:
        yield
    finally:
        module._buffers[name] = old


@contextlib.contextmanager
def _swapped(module: nn.Module, **params):
    """The module with some parameters replaced by real tensors, put back afterwards."""
    old = {k: module._parameters[k] for k in params}
    try:
        for k, v in params.items():
            module._parameters[k] = nn.Parameter(v, requires_grad=False)
        yield module
    finally:
        module._parameters.update(old)


# --- tracing -------------------------------------------------------------------------------------
class _Routed:
    """What a router returns while its layer is traced: a placeholder its experts recognise."""

    def __init__(self, hidden):
        self.hidden = hidden


@contextlib.contextmanager
def installed(layer: nn.Module, blocks: list[Block]):
    """While active, the blocks inside `layer` compute their routed experts as one fuselm_trace::moe."""
    inside = [b for b in blocks if any(m is b.module for m in layer.modules())]

    def route(x, *args, **kwargs):
        r = _Routed(x)
        return None, r, r

    def experts_of(b: Block):
        def run(hidden, *args, **kwargs):
            routed = [a for a in (*args, *kwargs.values()) if isinstance(a, _Routed)]
            same = routed and (routed[0].hidden is hidden or (routed[0].hidden.shape[-1] == hidden.shape[-1]
                                                              and routed[0].hidden.numel() == hidden.numel()))
            if not same:  # the router saw other tokens (or another tensor) than the experts get
                raise FuselmError(f"{b.name}: the experts get other hidden states than their router; not supported")
            return torch.ops.fuselm_trace.moe(hidden, b.router_weight, b.experts.gate_up_proj, b.experts.down_proj,
                                              b.bias if b.scoring == "sigmoid" else None, b.top_k, b.normalize,
                                              b.activation, b.scoring, b.scaling)
        return run

    biases = [b.bias_at for b in inside if b.bias_at]
    try:
        for b in inside:
            b.router.forward = route
            b.experts.forward = experts_of(b)
        for module, name in biases:  # a parameter while traced: the stamp reads it from the checkpoint
            module._parameters[name] = nn.Parameter(module._buffers.pop(name), requires_grad=False)
        yield
    finally:
        for module, name in biases:
            if name in module._parameters:
                module._buffers[name] = module._parameters.pop(name).data
        for b in inside:
            for m in (b.router, b.experts):
                m.__dict__.pop("forward", None)


# --- weights -------------------------------------------------------------------------------------
def reads_experts(node, value: str) -> bool:
    """Whether `node` is a fuselm::MoE reading `value` as its stacked gate_up or down weights."""
    return node.domain == contract.DOMAIN and node.op_type == contract.MOE_OP and value in list(node.input)[2:4]


def expert_weight(plan, b, name: str, scope: str, layer: int | None) -> str:
    """A stacked expert weight [E, out, in] as a float32 value: f32 as is, f16 through Cast, q8 / q4 as
    blocked DequantizeLinear along `in` (axis 2; the dense matmuls' blocks, in their [out, in] order)."""
    p = plan.linear
    shape = tuple(plan.shapes[name])
    n_exp, rows, cols = shape
    if p.kind == "f32":
        return b.weight(name, layer, lambda w: [w.reshape(-1, rows, cols)], [(name, TensorProto.FLOAT, shape, False)])[0]
    if p.kind == "f16":
        w16 = b.weight(name, layer, lambda w: [w.reshape(-1, rows, cols).astype(np.float16)],
                       [(name, TensorProto.FLOAT16, shape, False)])[0]
        return b.op("Cast", w16, name=f"{scope}/Cast", to=TensorProto.FLOAT)
    nblk = -(-cols // p.block)

    def encode(w, p=p):
        q, s, z = quantize(w.reshape(-1, cols), p.bits, p.block, axis=1)
        return [q.reshape(-1, rows, cols), s.reshape(-1, rows, nblk), z.reshape(-1, rows, nblk)]

    qtype = _QTYPE[p.bits]
    q, s, z = b.weight(name, layer, encode, [(f"{name}.qweight", qtype, shape, False),
                                             (f"{name}.scales", TensorProto.FLOAT, (n_exp, rows, nblk), False),
                                             (f"{name}.zero_points", qtype, (n_exp, rows, nblk), False)])
    return b.op("DequantizeLinear", q, s, z, name=f"{scope}/DequantizeLinear", axis=2, block_size=p.block)


class ExpertCheckpoint(Checkpoint):
    """A Checkpoint whose stacked expert parameters are virtual tensors made of the stored ones.

    `tensors` lists each stacked parameter [E, R, C] as [E, R * C], so exporter/weights.py reads
    it a few experts at a time; `read_rows` returns those experts as [n, R, C] float32. Validation
    sees the parameters' own shapes and not the per-expert parts they are made of."""

    def __init__(self, base: Checkpoint, stacks: dict[str, tuple[tuple, list[list[str]]]]):
        self.__dict__.update(base.__dict__)
        self.tensors = dict(base.tensors)
        self.stacks = stacks  # name -> (shape [E, R, C], per expert the stored parts concatenated along R)
        self.parts = {p for _, experts in stacks.values() for e in experts for p in e} - set(stacks)
        for name, (shape, experts) in stacks.items():
            path, dtype, _ = self.tensors[experts[0][0]]
            self.tensors[name] = (path, dtype, (shape[0], shape[1] * shape[2]))

    def validate(self, expected, ignorable) -> None:
        flat = self.tensors
        self.tensors = {k: (v[0], v[1], self.stacks[k][0]) if k in self.stacks else v for k, v in flat.items()
                        if k not in self.parts}
        try:
            super().validate(expected, ignorable)
        finally:
            self.tensors = flat

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        if name not in self.stacks:
            return super().read_rows(name, start, stop)
        shape, experts = self.stacks[name]
        if experts[0] == [name]:  # stored stacked: its first dim is the experts
            return super().read_rows(name, start, stop).reshape(-1, shape[1], shape[2])
        return np.stack([np.concatenate([super(ExpertCheckpoint, self).read_rows(p, 0, self.tensors[p][2][0])
                                         for p in experts[e]]) for e in range(start, stop)])


def stack_experts(ckpt: Checkpoint, skel, blocks: list[Block]) -> Checkpoint:
    """The checkpoint with each block's stacked expert parameters as virtual tensors (ExpertCheckpoint)."""
    if not blocks:
        return ckpt
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    converters = [c for c in get_model_conversion_mapping(skel.model) if isinstance(c, WeightConverter)]
    names = {id(p): n for n, p in skel.model.named_parameters()}
    stacks: dict[str, tuple[tuple, list[list[str]]]] = {}
    for b in blocks:
        for attr in EXPERT_PARAMS:
            param = getattr(b.experts, attr)
            name, shape = names[id(param)], tuple(param.shape)
            if name in ckpt.tensors:  # stored stacked (Granite-MoE's input_linear after transformers' rename)
                stacks[name] = (shape, [[name]])
                continue
            conv = next((c for c in converters for t in c.target_patterns if name.endswith(t)), None)
            if conv is None:
                continue  # validate reports it missing
            ops = [(type(o).__name__, getattr(o, "dim", None)) for o in conv.operations]
            if ops not in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]):
                raise FuselmError(f"{name}: transformers builds it from the checkpoint with {ops}; fuselm streams "
                                  "only per-expert tensors stacked (and gate/up concatenated)")
            prefix = name[: -len(next(t for t in conv.target_patterns if name.endswith(t)))]
            experts = [[prefix + src.replace("*", str(e)) for src in conv.source_patterns] for e in range(shape[0])]
            missing = [p for e in experts for p in e if p not in ckpt.tensors]
            if missing:
                raise FuselmError(f"checkpoint {ckpt.dir}: {missing[0]} is missing (one of the expert tensors "
                                  f"transformers stacks into {name}); re-download the checkpoint")
            stacks[name] = (shape, experts)
    return ExpertCheckpoint(ckpt, stacks)


def cached_stacks(ckpt: Checkpoint, stacks: dict) -> Checkpoint:
    """The checkpoint with the stacked expert parameters a cached trace recorded (exporter/traced/cache.py:
    JSON, so shapes come back as lists)."""
    if not stacks:
        return ckpt
    return ExpertCheckpoint(ckpt, {name: (tuple(shape), parts) for name, (shape, parts) in stacks.items()})


def metadata(blocks: list[Block]) -> dict | None:
    """fuselm.json's `moe` field: experts, top_k, normalize, activation, expert width, the layers' blocks."""
    if not blocks:
        return None
    b = blocks[0]
    return {"experts": b.num_experts, "top_k": b.top_k, "normalize": b.normalize, "activation": b.activation,
            "scoring": b.scoring, "scaling": b.scaling, "selection_bias": b.bias_at is not None,
            "expert_intermediate": b.experts.down_proj.shape[2], "blocks": len(blocks),
            "shared_expert": any(len(list(x.module.children())) > 2 for x in blocks)}
