"""Sparse mixture-of-experts blocks, found by structure and traced as one `fuselm::MoE` op.

A block is a module with two children: a router holding one weight [E, H] (and one tensor of E values:
gpt-oss's bias on its logits where the experts have biases too, else a selection bias: Ernie-4.5-MoE's
[1, E]) and an experts module holding the stacked expert weights `gate_up_proj` [E, 2I, H] (gate rows first)
and `down_proj` [E, H, I] (transformers 5's layout for Mixtral, Qwen2/3-MoE, OLMoE, Granite-MoE, ...),
or gpt-oss's: [in, out] per expert (`gate_up_proj` [E, H, 2I], `down_proj` [E, I, H], told apart by
shape), gate and up interleaved, with `gate_up_proj_bias` [E, 2I] and `down_proj_bias` [E, H].
Such experts are streamed into the op's layout (transposed, gate rows first: `Layout`), so the op
and its runtime kernels see one layout. Anything else in the block (Qwen2-MoE's shared expert and
its sigmoid gate) is traced as plain nodes beside the op. Nothing is per family: what the router
computes (softmax, sigmoid or PhiMoE's sparsemixer with its window from the router's float settings,
chosen with a selection bias or not, renormalised or not) and the expert activation (silu, gelu, gpt-oss's
clamped SwiGLU with its alpha and limit taken from the experts module's float settings) are read back by
running the model's own router and experts modules on random tensors and matching them against the
op's reference (`reference`), as rope_op.py does for the rotary; a block that matches no form is
refused instead of exported wrong. Expert stacks outside any block (JetMoE's) are refused by `unrecognised`,
which says where they are and why.

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
import inspect
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
EXPERT_BIASES = ("gate_up_proj_bias", "down_proj_bias")  # [E, 2I], [E, H] (gpt-oss)


@dataclass(frozen=True)
class Layout:
    """How a module's stacked expert tensor differs from the op's: stored [E, in, out] (`transposed`),
    gate and up interleaved along the output dim (`interleaved`: gate = [0::2], up = [1::2])."""

    transposed: bool = False
    interleaved: bool = False

    def canonical(self, w):
        """The tensor (torch or numpy, experts first) in the op's layout: [E, out, in], gate rows first."""
        if self.transposed and w.ndim == 3:
            w = w.transpose(1, 2) if isinstance(w, torch.Tensor) else w.transpose(0, 2, 1)
        if self.interleaved:
            axis = 1 if w.ndim == 3 else w.ndim - 1  # the output dim: rows of [E, 2I, H], the last of a bias [E, 2I]
            idx = np.r_[0:w.shape[axis]:2, 1:w.shape[axis]:2]
            if isinstance(w, torch.Tensor):
                return w.index_select(axis, torch.as_tensor(idx, device=w.device))
            return np.take(w, idx, axis=axis)
        return w


@dataclass
class Block:
    """One sparse MoE block: where it is, its router and experts, and the routing the op reproduces."""

    name: str
    module: nn.Module
    router: nn.Module
    experts: nn.Module
    weight_at: tuple[nn.Module, str] = (None, "weight")  # the router's weight: (owner, name)
    bias_at: tuple[nn.Module, str] | None = None  # a selection bias buffer [E] (e_score_correction_bias)
    router_bias_at: tuple[nn.Module, str] | None = None  # the router Linear's bias [E], added to its logits
    top_k: int = 0
    normalize: int = 0
    activation: str = "silu"
    scoring: str = "softmax"
    scaling: float = 1.0
    alpha: float = 1.0  # clamped_swiglu's sigmoid gain and clamp
    limit: float = float("inf")
    jitter_eps: float = 0.01  # sparsemixer's relative window (PhiMoE's router_jitter_noise)
    gate_up_layout: Layout = Layout()
    down_layout: Layout = Layout()

    @property
    def biased(self) -> bool:
        """Router and expert biases (all three: the op takes them together)."""
        return self.router_bias_at is not None

    @property
    def num_experts(self) -> int:
        return self.experts.gate_up_proj.shape[0]

    @property
    def hidden(self) -> int:
        return self.experts.down_proj.shape[2 if self.down_layout.transposed else 1]

    @property
    def expert_intermediate(self) -> int:
        return self.experts.down_proj.shape[1 if self.down_layout.transposed else 2]

    @property
    def router_bias(self) -> torch.Tensor | None:
        return getattr(*self.router_bias_at) if self.router_bias_at else None

    @property
    def router_weight(self) -> torch.Tensor:
        return getattr(*self.weight_at)

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(*self.bias_at) if self.bias_at else None


# --- the op --------------------------------------------------------------------------------------
@torch.library.custom_op("fuselm_trace::moe", mutates_args=())
def moe(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, bias: torch.Tensor | None,
        router_bias: torch.Tensor | None, gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
        top_k: int, normalize: int, activation: str, scoring: str, scaling: float, alpha: float, limit: float,
        jitter_eps: float, layouts: list[int]) -> torch.Tensor:
    """x [..., H] -> y [..., H]: fuselm::MoE (contract.moe_function's semantics). `layouts` (gate_up's transposed,
    interleaved, down's transposed): the module's layout, which the graph's weights no longer have."""
    gu_layout, down_layout = Layout(bool(layouts[0]), bool(layouts[1])), Layout(bool(layouts[2]))
    gate_up, down = gu_layout.canonical(gate_up), down_layout.canonical(down)
    gate_up_bias = gu_layout.canonical(gate_up_bias) if gate_up_bias is not None else None
    routed = routing(x.reshape(-1, x.shape[-1]), router, top_k, normalize, scoring, bias, scaling, router_bias, jitter_eps)
    return reference(x, router, gate_up, down, top_k, normalize, activation, routed=routed,
                     biases=(gate_up_bias, down_bias), alpha=alpha, limit=limit)


@moe.register_fake
def _(x, router, gate_up, down, bias, router_bias, gate_up_bias, down_bias, top_k, normalize, activation, scoring,
      scaling, alpha, limit, jitter_eps, layouts):
    return torch.empty_like(x)


_ACTIVATIONS = {"silu": nn.functional.silu, "gelu": nn.functional.gelu,
                "gelu_tanh": lambda x: nn.functional.gelu(x, approximate="tanh")}


def _act(activation: str, gate, up, alpha: float, limit: float):
    """The expert MLP's gated activation (contract.MOE_ACTIVATIONS)."""
    if activation == "clamped_swiglu":
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return gate * torch.sigmoid(gate * alpha) * (up + 1)
    return _ACTIVATIONS[activation](gate) * up


def routing(x2: torch.Tensor, router: torch.Tensor, top_k: int, normalize: int, scoring: str = "softmax",
            bias: torch.Tensor | None = None, scaling: float = 1.0,
            router_bias: torch.Tensor | None = None, jitter_eps: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], experts [T, k]): softmax over the experts of x2 @ router^T (+ router_bias) (or each
    one's sigmoid), chosen with `bias` added where given, the top_k, renormalised if asked, times `scaling`;
    or PhiMoE's sparsemixer (`_sparsemixer`)."""
    logits = x2.float() @ router.float().T
    if router_bias is not None:
        logits = logits + router_bias.float()
    if scoring == "sparsemixer":
        values, index = _sparsemixer(logits, top_k, jitter_eps)
    else:
        probs = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
        choice = probs + bias.float().reshape(-1) if bias is not None else probs
        index = torch.topk(choice, top_k, dim=-1).indices
        values = probs.gather(1, index)
    if normalize:
        values = values / values.sum(dim=-1, keepdim=True)
    return values * scaling, index


def _sparsemixer(logits: torch.Tensor, top_k: int, jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PhiMoE's sparsemixer at inference, for any top_k (transformers' is top-2): slot j takes the j-th largest
    logit v_j; its weight is the softmax, at that expert, over the experts e not chosen before with
    (v_j - s_e) / max(|s_e|, v_j) <= 2 * jitter_eps (contract.moe_function)."""
    values, index = [], []
    masked = logits
    for _ in range(top_k):
        top, at = masked.max(dim=-1, keepdim=True)
        far = (top - logits) / logits.abs().clamp(min=top) > 2 * jitter_eps
        gates = torch.softmax(masked.masked_fill(far, float("-inf")), dim=-1)
        values.append(gates.gather(-1, at))
        index.append(at)
        masked = masked.scatter(-1, at, float("-inf"))
    return torch.cat(values, dim=-1), torch.cat(index, dim=-1)


def reference(x, router, gate_up, down, top_k: int, normalize: int, activation: str,
              routed: tuple | None = None, biases: tuple = (None, None), alpha: float = 1.0,
              limit: float = float("inf")) -> torch.Tensor:
    """The op in torch, sparse: each token through its top_k experts (weights in the op's layout)."""
    x2 = x.reshape(-1, x.shape[-1])
    weights, index = routed if routed is not None else routing(x2, router, top_k, normalize)
    gate_up_bias, down_bias = biases
    out = torch.zeros_like(x2)
    for e in index.unique().tolist():
        tok, slot = torch.where(index == e)
        gu = x2[tok] @ gate_up[e].T + (gate_up_bias[e] if gate_up_bias is not None else 0)
        gate, up = gu.chunk(2, dim=-1)
        y = _act(activation, gate, up, alpha, limit) @ down[e].T + (down_bias[e] if down_bias is not None else 0)
        out.index_add_(0, tok, y * weights[tok, slot, None].to(x2.dtype))
    return out.reshape(x.shape)


def translation():
    """{torch op: onnxscript callable} for torch.onnx.export's custom_translation_table."""
    from onnxscript import values

    op = values.Op(values.Opset(contract.DOMAIN, contract.DOMAIN_VERSION), contract.MOE_OP, contract.moe_schema())

    def to_onnx(x, router, gate_up, down, bias, router_bias, gate_up_bias, down_bias, top_k, normalize, activation,
                scoring, scaling, alpha, limit, jitter_eps, layouts):
        biases = (router_bias, gate_up_bias, down_bias)
        inputs = (x, router, gate_up, down) + ((bias,) if bias is not None or biases[0] is not None else ())
        inputs += biases if biases[0] is not None else ()
        clamp = dict(alpha=float(alpha), limit=float(limit)) if activation == "clamped_swiglu" else {}
        if scoring == "sparsemixer":
            clamp["jitter_eps"] = float(jitter_eps)
        return op(*inputs, top_k=int(top_k), normalize=int(normalize), activation=str(activation), scoring=str(scoring),
                  scaling=float(scaling), **clamp)

    return {torch.ops.fuselm_trace.moe.default: to_onnx}


# --- finding and checking the blocks -------------------------------------------------------------
def _expert_params(m: nn.Module) -> bool:
    p = dict(m.named_parameters(recurse=False))
    return all(k in p and p[k].dim() == 3 for k in EXPERT_PARAMS)


def _layouts(ex: nn.Module) -> tuple[Layout, Layout] | None:
    """(gate_up's, down's) transposition, from their shapes: [E, 2I, H] and [E, H, I], or [E, H, 2I] and
    [E, I, H] (never both: that needs I = 0); None for neither. Interleaving is read back later (_checked)."""
    (_, a1, a2), (_, b1, b2) = ex.gate_up_proj.shape, ex.down_proj.shape
    if a2 == b1 and a1 == 2 * b2:
        return Layout(), Layout()
    if a1 == b2 and a2 == 2 * b1:
        return Layout(transposed=True), Layout(transposed=True)
    return None


def find_blocks(model: nn.Module, model_type: str, skip: list[nn.Module] = ()) -> list[Block]:
    """Every sparse MoE block of the model (a router + stacked experts pair of children), checked; those of `skip`
    (scaled_input's) left out."""
    blocks = []
    for name, m in model.named_modules():
        experts = [c for c in m.children() if _expert_params(c)]
        if not experts or any(m is x for x in skip):
            continue
        where = f"{name}.{next(n for n, c in m.named_children() if c is experts[0])}"
        ex = experts[0]
        params = dict(ex.named_parameters())
        extra = sorted(set(params) - set(EXPERT_PARAMS) - set(EXPERT_BIASES))
        biases = [k for k in EXPERT_BIASES if k in params]
        if len(experts) != 1 or extra or len(biases) not in (0, 2):
            raise FuselmError(f"model_type {model_type!r}: its experts at {where} carry "
                              f"{', '.join(extra or biases) or 'two stacks'} beside gate_up_proj/down_proj; fuselm::MoE "
                              f"takes stacked expert weights and, optionally, both {' and '.join(EXPERT_BIASES)}")
        layouts = _layouts(ex)
        if layouts is None:
            raise FuselmError(f"model_type {model_type!r}: its experts at {where} have gate_up_proj "
                              f"{list(ex.gate_up_proj.shape)} and down_proj {list(ex.down_proj.shape)}, neither "
                              "[E, 2I, H] / [E, H, I] nor [E, H, 2I] / [E, I, H]; fuselm::MoE cannot read them")
        n_exp = ex.gate_up_proj.shape[0]
        hidden = ex.down_proj.shape[2 if layouts[1].transposed else 1]
        routers = [(c, at) for c in m.children() if c is not ex and (at := _router_params(c, (n_exp, hidden)))]
        if len(routers) != 1 and _dense(ex):
            continue  # a router of its own: traced as written, the experts through transformers' batched_mm
        if len(routers) != 1:
            raise FuselmError(f"model_type {model_type!r}: the experts at {where} have no router of one weight "
                              f"[{n_exp}, {hidden}] (and a bias [{n_exp}]) beside them (a router of its own layout); "
                              "not supported")
        router, (weight_at, extra_at) = routers[0]
        if biases and extra_at is None:
            raise FuselmError(f"model_type {model_type!r}: the block at {name} has expert biases but a router without "
                              "one; fuselm::MoE takes the router and expert biases together or none")
        # a router's own [E] tensor is its logits' bias where the experts have biases too (gpt-oss), else a
        # candidate selection bias (Ernie-4.5-MoE's moe_statics.e_score_correction_bias): _checked tells
        block = Block(name, m, router, ex, weight_at, bias_at=None if biases else extra_at,
                      router_bias_at=extra_at if biases else None, gate_up_layout=layouts[0], down_layout=layouts[1])
        try:
            blocks.append(_checked(block, model_type))
        except FuselmError:
            if not _dense(ex):
                raise
            # routing or experts of a form fuselm::MoE does not have (Kolibri's top-k on logits + bias, then
            # sigmoid): the router traced as written, the experts through transformers' batched_mm (dense_experts)
    return blocks


def _dense(experts: nn.Module) -> bool:
    """transformers' experts class (use_experts_implementation): its batched_mm implementation traces in standard ops."""
    return hasattr(experts, "has_gate") and hasattr(experts, "is_transposed")


def _router_params(module: nn.Module, shape: tuple[int, int]):
    """((owner, name) of the router's weight, that of its bias or None) when the module's parameters are one
    weight of `shape` (its own `weight`, or a Linear inside it: HunYuan's `gate.wg`) and at most one tensor
    of E values beside it ([E] or [1, E]: gpt-oss's bias, Ernie-4.5-MoE's selection bias); None otherwise
    (a second tensor, another shape)."""
    params = list(module.named_parameters())
    weights = [n for n, p in params if tuple(p.shape) == shape]
    bias = [n for n, p in params if tuple(p.shape) in (shape[:1], (1, shape[0]))]
    if len(weights) != 1 or len(bias) > 1 or len(params) != 1 + len(bias):
        return None

    def at(path):
        owner, _, name = path.rpartition(".")
        return (module.get_submodule(owner) if owner else module), name

    return at(weights[0]), (at(bias[0]) if bias else None)


def dense_experts(model: nn.Module, blocks: list[Block]) -> list[nn.Module]:
    """transformers' experts modules outside `blocks` (its `use_experts_implementation` classes: non-gated experts,
    a norm per expert, as Ergo's): traced in standard ops through transformers' own `batched_mm` implementation
    (each token's top-k experts' weights gathered and multiplied: shapes that do not depend on the routing)."""
    inside = covered(model, blocks)
    return [m for m in model.modules() if id(m) not in inside and _dense(m)
            and any(p.dim() == 3 for p in m.parameters(recurse=False))]


def shared_experts(model: nn.Module) -> list[nn.Module]:
    """Shared experts kept as 3-D stacks (Inkling's [n_shared, I, H], run with bmm on every token): no routing, so
    they trace as plain nodes beside the routed block."""
    return [m for m in model.modules() if "sharedexpert" in type(m).__name__.lower()
            and any(p.dim() == 3 for p in m.parameters(recurse=False))]


def unrecognised(model: nn.Module, blocks: list[Block], dense: list[nn.Module] = ()) -> str | None:
    """Why the model's experts outside `blocks` cannot be exported, naming where they are and their tensors
    (None: no 3-D expert stacks outside the blocks): experts inside an attention module (a mixture of attention
    heads) or stacks fuselm::MoE does not read, beside a router of another form than `grouped` traces."""
    inside = covered(model, blocks) | {id(m) for d in dense for m in d.modules()}
    owners: dict[str, tuple[nn.Module, list[str]]] = {}
    for name, m in model.named_modules():
        if id(m) in inside or isinstance(m, nn.Conv1d):  # a convolution's [C, 1, K] weight is no expert stack
            continue
        for pname, p in m.named_parameters(recurse=False):
            if p.dim() == 3:
                parent = name.rpartition(".")[0]
                owners.setdefault(parent, (model.get_submodule(parent), []))[1].append(
                    f"{name[len(parent) + 1:]}.{pname} {list(p.shape)}")
    if not owners:
        return None
    seen, attention, other = set(), [], []
    for where, (module, tensors) in owners.items():
        if type(module).__name__ in seen:
            continue  # the next layers' copies
        seen.add(type(module).__name__)
        chain = [model.get_submodule(".".join(where.split(".")[:i])) for i in range(1, where.count(".") + 2)]
        in_attention = any("attention" in type(c).__name__.lower() for c in chain)
        (attention if in_attention else other).append(f"{where} ({type(module).__name__}: {', '.join(tensors)})")
    parts = []
    if attention:
        parts.append(f"attention experts at {', '.join(attention)}: each token's top-k query and output "
                     "projections (a mixture of attention heads), computed on token groups sorted by expert whose "
                     "sizes depend on the routing (not traceable), and no fuselm op expresses them")
    if other:
        parts.append(f"experts at {', '.join(other)} that fuselm::MoE does not read (it takes transformers' stacked "
                     "gate_up_proj [E, 2I, H] / down_proj [E, H, I] beside a router of one weight [E, H])")
    return "; and ".join(parts)


def covered(model: nn.Module, blocks: list[Block]) -> set[int]:
    """ids of the modules inside the blocks (the blocks themselves included)."""
    return {id(x) for b in blocks for x in b.module.modules()}


def _checked(block: Block, model_type: str) -> Block:
    """Read top_k, the routing (scoring, normalize, scaling, selection bias) and the activation back from the
    model's own router and experts."""
    gen = torch.Generator().manual_seed(0)
    n_exp, hidden = block.num_experts, block.hidden
    block.bias_at = block.bias_at or _selection_bias(block)
    stand_in = torch.randn(n_exp, hidden, generator=gen)
    x2 = torch.cat([torch.randn(7, hidden, generator=gen), _near_ties(stand_in, gen)])
    # the router's weight, its bias and the selection bias (random: the check sees whether it steers the choice)
    swaps = [(block.weight_at, stand_in)]
    if block.router_bias_at is not None:
        swaps.append((block.router_bias_at, torch.randn(n_exp, generator=gen)))
    if block.bias_at is not None:
        swaps.append((block.bias_at, torch.rand(getattr(*block.bias_at).shape, generator=gen)))
    with contextlib.ExitStack() as stack, torch.no_grad():
        for (module, name), value in swaps:
            stack.enter_context(_swapped(module, **{name: value}))
        router = block.router
        # [tokens, hidden], or [1, tokens, hidden] for a router that unpacks (batch, seq, hidden) (AFMoE); the
        # block's selection bias as an argument where the router takes it (MiniMax-M2, AFMoE)
        calls = [(x, *extra) for extra in ((), (block.bias,))[:2 if block.bias is not None else 1] for x in (x2, x2[None])]
        for k, args in enumerate(calls):
            try:
                out = router(*args)
                break
            except (TypeError, ValueError, RuntimeError) as e:
                if k == len(calls) - 1:
                    raise FuselmError(f"model_type {model_type!r}: its router at {block.name} does not run on [tokens, "
                                      f"hidden] ({type(e).__name__}: {str(e)[:120]}); not supported") from None
        parts = list(out) if isinstance(out, tuple) else [out]
        index = next((t for t in parts if isinstance(t, torch.Tensor) and not t.is_floating_point()), None)
        if index is None:
            dense = any(isinstance(t, torch.Tensor) and t.shape == (x2.shape[0], n_exp) for t in parts)
            raise FuselmError(f"model_type {model_type!r}: its router at {block.name} returns no expert indices" + (
                f" but a score for each of the {n_exp} experts (Llama 4's: zero off its top-k, and the block scales "
                "each expert's input by it, where fuselm::MoE weights the experts' outputs)" if dense else "") +
                "; not supported")
        weights = next((t for t in parts if isinstance(t, torch.Tensor) and t.is_floating_point()
                        and t.shape == index.shape), None)
        top_k = index.shape[-1]
        if not _routing_form(block, x2, index, weights, top_k):
            raise FuselmError(f"model_type {model_type!r}: its router at {block.name} is neither softmax-top-k nor "
                              "sigmoid-top-k, with or without a selection bias, renormalised or not, nor PhiMoE's "
                              "sparsemixer (grouped top-k, for one); fuselm::MoE cannot express it")
    if _experts_form(block, top_k, gen):
        return block
    raise FuselmError(f"model_type {model_type!r}: its experts at {block.name} are not act(gate, up) -> down over "
                      "gate_up_proj = [gate; up] (or gate/up interleaved) with silu, gelu or a clamped SwiGLU; "
                      "fuselm::MoE cannot express them")


def _experts_form(block: Block, top_k: int, gen) -> bool:
    """Set the block's activation (alpha, limit) and gate/up interleaving from its experts run on tiny stand-in
    weights (the real expert count, small widths, the module's own layout and biases); False if none matches.
    silu / gelu are told apart on unit inputs (gelu and its tanh form differ by ~1e-4 there); a clamped SwiGLU
    is checked on inputs large enough that its clamp bites."""
    n_exp, inter, h = block.num_experts, 4, 16  # widths of 16-byte multiples (torch._grouped_mm)
    gu_layout, down_layout = block.gate_up_layout, block.down_layout
    gate_up = torch.randn(n_exp, 2 * inter, h, generator=gen) * 0.5  # the op's layout
    down = torch.randn(n_exp, h, inter, generator=gen) * 0.5
    biases = (None, None)
    if "gate_up_proj_bias" in dict(block.experts.named_parameters()):
        biases = (torch.randn(n_exp, 2 * inter, generator=gen), torch.randn(n_exp, h, generator=gen))
    xs = torch.randn(6, h, generator=gen)
    w_small, i_small = routing(xs, torch.randn(n_exp, h, generator=gen), top_k, 1)
    floats = [v for k, v in vars(block.experts).items() if not k.startswith("_") and isinstance(v, float)]
    # (activation, settings, input scale, atol)
    candidates = [(a, {}, 1.0, 1e-5) for a in contract.MOE_ACTIVATIONS if a != "clamped_swiglu"]
    candidates += [("clamped_swiglu", dict(alpha=al, limit=li), 8.0, 1e-4) for al in floats for li in floats
                   if al != li or len(floats) == 1]
    for interleaved in (False, True):
        # the module's tensors hold gate_up's rows interleaved: the same experts if it reads them so
        gu = _interleaved(gate_up) if interleaved else gate_up
        small = {"gate_up_proj": gu.transpose(1, 2) if gu_layout.transposed else gu,
                 "down_proj": down.transpose(1, 2) if down_layout.transposed else down}
        if biases[0] is not None:
            small.update(gate_up_proj_bias=_interleaved(biases[0]) if interleaved else biases[0], down_proj_bias=biases[1])
        got = {}
        with _swapped(block.experts, **small) as experts, torch.no_grad():
            for scale in (1.0, 8.0):
                try:
                    got[scale] = experts(xs * scale, i_small, w_small)
                except Exception as e:
                    raise FuselmError(f"{block.name}: its experts do not run as experts(hidden, top_k_index, "
                                      f"top_k_weights) ({type(e).__name__}: {str(e)[:120]}); not supported") from None
        for activation, clamp, scale, atol in candidates:
            want = reference(xs * scale, None, gate_up, down, top_k, 1, activation, routed=(w_small, i_small),
                             biases=biases, **clamp)
            if got[scale].shape == want.shape and torch.allclose(got[scale], want, atol=atol, rtol=atol):
                block.activation = activation
                block.alpha, block.limit = clamp.get("alpha", 1.0), clamp.get("limit", float("inf"))
                block.gate_up_layout = Layout(gu_layout.transposed, interleaved)
                return True
    return False


def _interleaved(w: torch.Tensor) -> torch.Tensor:
    """[gate; up] along the output dim (rows of [E, 2I, H], the last dim of [E, 2I]) -> gate/up interleaved
    (Layout.canonical's inverse)."""
    axis = 1 if w.dim() == 3 else w.dim() - 1
    gate, up = w.chunk(2, dim=axis)
    return torch.stack((gate, up), dim=axis + 1).flatten(axis, axis + 1)


def _routing_form(block: Block, x2, index, weights, top_k: int) -> bool:
    """Set the block's top_k, scoring, normalize and scaling from the router's output on `x2`; False if
    no form of fuselm::MoE gives its choice of experts and their weights (compared in expert order:
    routers may return the top_k unsorted)."""
    if weights is None:
        return False
    order = index.argsort(-1)
    index, weights = index.gather(1, order), weights.float().gather(1, order)
    # sparsemixer's window is one of the router's float settings (PhiMoE: router_jitter_noise)
    windows = sorted({v for v in vars(block.router).values() if isinstance(v, float) and not isinstance(v, bool)})
    found = []
    for scoring in contract.MOE_SCORINGS:
        for eps in (windows if scoring == "sparsemixer" else [0.01]):
            for chooses in ((True, False) if block.bias is not None and scoring == "softmax" else (scoring == "sigmoid",)):
                bias = block.bias if chooses else None
                for normalize in ((0,) if scoring == "sparsemixer" else (1, 0)):
                    w, i = routing(x2, block.router_weight, top_k, normalize, scoring, bias,
                                   router_bias=block.router_bias, jitter_eps=eps)
                    mine = i.argsort(-1)
                    w, i = w.gather(1, mine), i.gather(1, mine)
                    seen = w > 0  # a wide random router's softmax underflows to 0 off its top experts (0/0)
                    scaling = float((weights[seen] / w[seen]).mean()) if bool(seen.any()) else 1.0
                    if torch.equal(i, index) and torch.allclose(w * scaling, weights, atol=1e-5, rtol=1e-4):
                        found.append((abs(scaling - 1.0), scoring, normalize, scaling, chooses, eps))
    if not found:
        return False
    # a near-uniform router (random weights) makes the top-k sums nearly equal, so a normalized form with a
    # scaling matches an unnormalized one too: the form needing no scaling is the router's own
    _, scoring, normalize, scaling, chooses, eps = min(found, key=lambda f: f[0])
    block.top_k, block.scoring, block.normalize, block.jitter_eps = int(top_k), scoring, normalize, float(eps)
    block.scaling = 1.0 if abs(scaling - 1.0) < 1e-6 else scaling
    if not chooses:
        block.bias_at = None  # the router chose without it
    return True


def _near_ties(router: torch.Tensor, gen) -> torch.Tensor:
    """Tokens [8, H] whose logits under `router` [E, H] lie within a few percent of each other (positive and
    negative), so a router that keeps only the experts near the best one (sparsemixer's window) shows it."""
    n_exp = router.shape[0]
    spread = torch.tensor([0.005, 0.01, 0.02, 0.04]).repeat(2)[:, None]
    sign = torch.tensor([1.0] * 4 + [-1.0] * 4)[:, None]
    target = 4.0 * sign * (1 + spread * torch.randn(8, n_exp, generator=gen))
    return (torch.linalg.pinv(router) @ target.T).T  # x with x @ router^T = target (E <= H)


def _selection_bias(block: Block) -> tuple[nn.Module, str] | None:
    """A persistent float buffer [E] of the router (or of the block itself), else a frozen parameter [E] of the
    block: the bias added to the scores when choosing experts (DeepSeek-V3's e_score_correction_bias)."""
    n_exp = block.num_experts
    owners = [(m, n) for m in block.router.modules() for n in m._buffers] + [(block.module, n) for n in block.module._buffers]
    found = [(m, n) for m, n in owners if m._buffers[n] is not None and tuple(m._buffers[n].shape) == (n_exp,)
             and m._buffers[n].is_floating_point() and n not in m._non_persistent_buffers_set]
    if not found:  # a frozen parameter of the block itself (AFMoE's expert_bias)
        found = [(block.module, n) for n, p in block.module._parameters.items()
                 if p is not None and tuple(p.shape) == (n_exp,) and p.is_floating_point() and not p.requires_grad]
    return found[0] if len(found) == 1 else None


@contextlib.contextmanager
def _swapped(module: nn.Module, **tensors):
    """The module with some parameters (or buffers) replaced by real tensors, put back afterwards."""
    stores = {k: module._parameters if k in module._parameters else module._buffers for k in tensors}
    old = {k: stores[k][k] for k in tensors}
    try:
        for k, v in tensors.items():
            stores[k][k] = nn.Parameter(v, requires_grad=False) if stores[k] is module._parameters else v
        yield module
    finally:
        for k, v in old.items():
            stores[k][k] = v


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
            ex = b.experts
            biases = (b.router_bias, ex.gate_up_proj_bias, ex.down_proj_bias) if b.biased else (None, None, None)
            layouts = [int(b.gate_up_layout.transposed), int(b.gate_up_layout.interleaved), int(b.down_layout.transposed)]
            bias = b.bias.reshape(-1) if b.bias is not None else None  # [E] ([1, E] stored: Ernie-4.5-MoE)
            return torch.ops.fuselm_trace.moe(hidden, b.router_weight, ex.gate_up_proj, ex.down_proj, bias, *biases,
                                              b.top_k, b.normalize, b.activation, b.scoring, b.scaling, b.alpha, b.limit,
                                              b.jitter_eps, layouts)
        return run

    biases = [b.bias_at for b in inside if b.bias_at and b.bias_at[1] in b.bias_at[0]._buffers]
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


# --- experts on token groups sorted by expert (JetMoE) -----------------------------------------------
def grouped(model: nn.Module) -> list[nn.Module]:
    """Modules whose `router` sorts the tokens into groups by expert for experts that split their input by the
    group sizes (JetMoE's TopKGating and ParallelExperts, in its MLP and its attention): sizes that depend on the
    routing, which torch.export cannot trace. `grouped_installed` computes the same per (token, slot) row."""
    return [m for m in model.modules() if any(_group_experts(c) for c in m.children())
            and isinstance(getattr(getattr(m, "router", None), "layer", None), nn.Linear)
            and isinstance(getattr(getattr(m, "router", None), "top_k", None), int)]


def _group_experts(m: nn.Module) -> bool:
    params = list(inspect.signature(type(m).forward).parameters)[1:]
    weight = getattr(m, "weight", None)
    return params == ["inputs", "expert_size"] and isinstance(weight, nn.Parameter) and weight.dim() == 3


def _ungrouped_route(router: nn.Module):
    def route(hidden_states):
        """The router's (order, token, gate, expert, logits) per (token, slot) row in token order: the sort
        left out, each row's expert in place of the group sizes."""
        logits = router.layer(hidden_states).float()
        top_logits, top = logits.topk(router.top_k, dim=1)
        gates = torch.softmax(top_logits, dim=1).type_as(hidden_states)
        order = torch.arange(top.numel())
        return order, torch.div(order, router.top_k, rounding_mode="trunc"), gates.reshape(-1), top.reshape(-1), logits
    return route


def _gathered(experts: nn.Module):
    def run(inputs, expert_size):
        """Each row through its own expert's weight (`expert_size`: the rows' experts)."""
        return torch.einsum("roi,ri->ro", experts.weight[expert_size], inputs)
    return run


def verify_grouped(modules: list[nn.Module], model_type: str) -> None:
    """The router's own sort against the ungrouped routing on random tokens: the same gate for every (token,
    expert); refuses a router that computes something else."""
    for m in modules[:1]:
        router = m.router
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(5, router.layer.in_features, generator=gen)
        weight = torch.randn(router.layer.weight.shape, generator=gen)  # (on the meta device while the model is probed)
        with _swapped(router.layer, weight=weight), torch.no_grad():
            _, token, gate, sizes, _ = router(x)
            _, token2, gate2, expert2, _ = _ungrouped_route(router)(x)
        n_exp = router.layer.out_features
        expert = torch.repeat_interleave(torch.arange(n_exp), torch.as_tensor(sizes))
        want = torch.zeros(len(x), n_exp).index_put_((token, expert), gate.float(), accumulate=True)
        got = torch.zeros(len(x), n_exp).index_put_((token2, expert2), gate2.float(), accumulate=True)
        if not torch.allclose(want, got, atol=1e-6):
            raise FuselmError(f"model_type {model_type!r}: its router at {type(router).__name__} does not route as "
                              "top-k of its logits with a softmax over them; not supported by the traced exporter")


def looped(model: nn.Module) -> list[nn.Module]:
    """Experts modules that loop over the experts the tokens were routed to, each a GLU of three [E·I, H] weights
    viewed per expert (DBRX's DbrxExperts: w1, v1, w2 and its mlp's activation): a loop over the routing, which
    torch.export cannot trace. `grouped_installed` computes each token's top-k experts from gathered weights."""
    def glu(m):
        mlp = getattr(m, "mlp", None)
        params = list(inspect.signature(type(m).forward).parameters)[1:]
        return params == ["hidden_states", "top_k_index", "top_k_weights"] and hasattr(mlp, "activation_fn") and all(
            isinstance(getattr(mlp, n, None), nn.Parameter) and getattr(mlp, n).dim() == 2 for n in ("w1", "v1", "w2"))
    return [m for m in model.modules() if glu(m)]


def _looped_rows(m: nn.Module):
    def run(hidden_states, top_k_index, top_k_weights):
        """Each token's top-k experts, their w1 / v1 / w2 gathered: act(x w1ᵀ) · (x v1ᵀ) w2, weighted and summed."""
        mlp = m.mlp
        hidden = mlp.w1.shape[1]
        x = hidden_states.reshape(-1, hidden)
        w1, v1, w2 = (getattr(mlp, n).view(-1, m.ffn_hidden_size, hidden)[top_k_index] for n in ("w1", "v1", "w2"))
        inner = mlp.activation_fn(torch.einsum("nkih,nh->nki", w1, x)) * torch.einsum("nkih,nh->nki", v1, x)
        out = (torch.einsum("nki,nkih->nkh", inner, w2) * top_k_weights[..., None]).sum(1)
        return out.view(hidden_states.shape[0], -1, hidden)
    return run


def verify_looped(modules: list[nn.Module], model_type: str) -> None:
    """The experts' own loop against the gathered form on random tokens, weights and routing; refuses experts
    that compute something else."""
    for m in modules[:1]:
        gen = torch.Generator().manual_seed(0)  # (the weights are on the meta device while the model is probed)
        params = {n: torch.randn(getattr(m.mlp, n).shape, generator=gen) * 0.3 for n in ("w1", "v1", "w2")}
        n_exp = params["w1"].shape[0] // m.ffn_hidden_size
        x = torch.randn(1, 5, params["w1"].shape[1], generator=gen)
        index = torch.stack([torch.randperm(n_exp, generator=gen)[:2] for _ in range(5)])
        weights = torch.rand(5, 2, generator=gen)
        with _swapped(m.mlp, **params), torch.no_grad():
            want, got = m(x, index, weights), _looped_rows(m)(x, index, weights)
        if not torch.allclose(want, got, atol=1e-5, rtol=1e-4):
            raise FuselmError(f"model_type {model_type!r}: its experts at {type(m).__name__} do not compute a GLU of "
                              "w1 / v1 / w2 per routed expert; not supported by the traced exporter")


def scaled_input(model: nn.Module) -> list[nn.Module]:
    """MoE blocks whose router returns a score per expert, zero off its top-k, by which the block scales each
    expert's input before running every expert on every token (Llama 4: a `router` with `top_k`, `experts` with
    stacked gate_up_proj [E, H, 2I] / down_proj [E, I, H], a `shared_expert` beside): fuselm::MoE weights the
    experts' outputs instead. `grouped_installed` runs each token's top-k experts on its scaled input from
    gathered weights (the others get a zero input and give zero). A block of that shape whose own forward
    computes something else on random tokens and weights is not one of them (fuselm::MoE's blocks)."""
    out, form = [], {}
    for m in model.modules():
        router, ex = getattr(m, "router", None), getattr(m, "experts", None)
        stacks = [getattr(ex, n, None) for n in ("gate_up_proj", "down_proj")]
        if isinstance(getattr(router, "top_k", None), int) and hasattr(ex, "act_fn") and all(
                isinstance(p, nn.Parameter) and p.dim() == 3 for p in stacks) and len(list(ex.parameters())) == 2:
            if type(m) not in form:
                form[type(m)] = _is_scaled(m)
            if form[type(m)]:
                out.append(m)
    return out


def _scaled_rows(m: nn.Module):
    def run(hidden_states):
        """The router as written; each token's top-k experts on its input scaled by their scores; the shared expert."""
        ex = m.experts
        x = hidden_states.reshape(-1, ex.gate_up_proj.shape[1])
        scores, logits = m.router(x)
        weight, index = scores.topk(m.router.top_k, dim=1)
        gate, up = torch.einsum("nkh,nkhi->nki", x[:, None, :] * weight[..., None], ex.gate_up_proj[index]).chunk(2, dim=-1)
        routed = torch.einsum("nki,nkih->nh", up * ex.act_fn(gate), ex.down_proj[index])
        shared = getattr(m, "shared_expert", None)
        return (routed if shared is None else shared(x) + routed), logits
    return run


def _is_scaled(m: nn.Module) -> bool:
    """Whether the block's own forward equals the top-k form on random tokens and weights."""
    gen = torch.Generator().manual_seed(0)
    saved = [(owner, n, p) for owner in m.modules() for n, p in owner._parameters.items() if p is not None]
    for owner, n, p in saved:  # (on the meta device while the model is probed)
        owner._parameters[n] = nn.Parameter(torch.randn(p.shape, generator=gen) * 0.3, requires_grad=False)
    try:
        x = torch.randn(6, m.experts.gate_up_proj.shape[1], generator=gen)
        with torch.no_grad():
            want, got = m(x), _scaled_rows(m)(x)
    except Exception:  # noqa: BLE001 - a block of another form (its own forward reads other arguments)
        return False
    finally:
        for owner, n, p in saved:
            owner._parameters[n] = p
    want, got = (t[0] if isinstance(t, tuple) else t for t in (want, got))
    return want.numel() == got.numel() and torch.allclose(want.reshape(got.shape), got, atol=1e-5, rtol=1e-4)


@contextlib.contextmanager
def grouped_installed(layer: nn.Module, modules: list[nn.Module]):
    """While active, the grouped routers and experts inside `layer` compute per (token, slot) row in token order,
    the looped experts and the scaled-input blocks from gathered weights."""
    inside = [m for m in modules if any(m is x for x in layer.modules())]
    patched = []
    try:
        for m in inside:
            scaled = hasattr(getattr(m, "experts", None), "gate_up_proj")
            if getattr(m, "router", None) is None or scaled:  # looped experts, scaled-input blocks
                m.forward = _scaled_rows(m) if scaled else _looped_rows(m)
                patched.append(m)
                continue
            m.router.forward = _ungrouped_route(m.router)
            patched.append(m.router)
            for c in m.children():
                if _group_experts(c):
                    c.forward = _gathered(c)
                    patched.append(c)
        yield
    finally:
        for c in patched:
            c.__dict__.pop("forward", None)


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
    it a few experts at a time; `read_rows` returns those experts as [n, R, C] float32, in the op's
    layout (a stack stored in another `Layout`, gpt-oss's, is transposed / de-interleaved as it is
    read; its gate/up bias [E, 2I] too). Validation sees the parameters in the op's layout and not the
    per-expert parts they are made of."""

    def __init__(self, base: Checkpoint, stacks: dict[str, tuple]):
        self.__dict__.update(base.__dict__)
        self.tensors = dict(base.tensors)
        # name -> (shape [E, R, C] or [E, N] in the op's layout, per expert the stored parts concatenated along R,
        # and the stored Layout as [transposed, interleaved] where it is not the op's)
        self.stacks = stacks
        self.parts = {p for entry in stacks.values() for e in entry[1] for p in e} - set(stacks)
        for name, (shape, experts, *_) in stacks.items():
            path, dtype, _ = self.tensors[experts[0][0]]
            self.tensors[name] = (path, dtype, (shape[0], int(np.prod(shape[1:]))))

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
        shape, experts, *layout = self.stacks[name]
        if experts[0] == [name]:  # stored stacked: its first dim is the experts
            rows = super().read_rows(name, start, stop)
            return Layout(*map(bool, layout[0])).canonical(rows) if layout else rows.reshape(-1, *shape[1:])
        return np.stack([np.concatenate([super(ExpertCheckpoint, self).read_rows(p, 0, self.tensors[p][2][0])
                                         for p in experts[e]]) for e in range(start, stop)])


def stack_experts(ckpt: Checkpoint, skel, blocks: list[Block], dense: list[nn.Module] = ()) -> Checkpoint:
    """The checkpoint with each block's stacked expert parameters (and the `dense` experts', in their own layout)
    as virtual tensors (ExpertCheckpoint)."""
    if not blocks and not dense:
        return ckpt
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    converters = [c for c in get_model_conversion_mapping(skel.model) if isinstance(c, WeightConverter)]
    names = {id(p): n for n, p in skel.model.named_parameters()}
    stacks: dict[str, tuple] = {}
    entries = [(b.experts, {"gate_up_proj": b.gate_up_layout, "down_proj": b.down_layout,
                            **({"gate_up_proj_bias": Layout(interleaved=b.gate_up_layout.interleaved)} if b.biased else {})})
               for b in blocks]
    entries += [(d, {n: Layout() for n, p in d.named_parameters(recurse=False) if p.dim() == 3}) for d in dense]
    for module, relayout in entries:
        for attr, layout in relayout.items():
            param = getattr(module, attr)
            name, shape = names[id(param)], tuple(param.shape)
            if name not in ckpt.tensors and f"{name}_blocks" in ckpt.tensors:
                raise FuselmError(f"checkpoint {ckpt.dir}: its experts are MXFP4-quantized ({name}_blocks / _scales, "
                                  "gpt-oss's released format); fuselm reads float experts: convert a bf16 copy, or "
                                  "dequantize it first (transformers: from_pretrained(..., quantization_config="
                                  "Mxfp4Config(dequantize=True)), then save_pretrained)")
            if layout != Layout():  # stored in another layout than the op's (gpt-oss): stored stacked only
                stored = ckpt.tensors.get(name)
                if stored is None:
                    continue  # validate reports it missing
                if tuple(stored[2]) != shape:
                    raise FuselmError(f"checkpoint {ckpt.dir}: {name} has shape {list(stored[2])}, expected "
                                      f"{list(shape)}; re-download the checkpoint")
                canonical = tuple(layout.canonical(torch.empty(shape, device="meta")).shape)
                stacks[name] = (canonical, [[name]], [int(layout.transposed), int(layout.interleaved)])
                continue
            if attr not in EXPERT_PARAMS and module not in dense:
                continue
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
            # (patterns may escape their dots: Kimi-Linear's `mlp\.experts.*.w1.weight`)
            experts = [[prefix + src.replace("\\.", ".").replace("*", str(e)) for src in conv.source_patterns]
                       for e in range(shape[0])]
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
    return ExpertCheckpoint(ckpt, {name: (tuple(shape), *rest) for name, (shape, *rest) in stacks.items()})


def stacked_shapes(ckpt: Checkpoint) -> dict[str, tuple[int, ...]]:
    """The stacked expert tensors' shapes as the graph stores them (the op's layout), for the expected tensors."""
    return {name: tuple(entry[0]) for name, entry in getattr(ckpt, "stacks", {}).items()}


def metadata(blocks: list[Block]) -> dict | None:
    """fuselm.json's `moe` field: experts, top_k, normalize, activation, expert width, the layers' blocks."""
    if not blocks:
        return None
    b = blocks[0]
    meta = {"experts": b.num_experts, "top_k": b.top_k, "normalize": b.normalize, "activation": b.activation,
            "scoring": b.scoring, "scaling": b.scaling, "selection_bias": b.bias_at is not None,
            "expert_intermediate": b.expert_intermediate, "blocks": len(blocks),
            "shared_expert": any(len(list(x.module.children())) > 2 for x in blocks), "biases": b.biased}
    if b.activation == "clamped_swiglu":
        meta.update(alpha=b.alpha, limit=b.limit)
    if b.scoring == "sparsemixer":
        meta.update(jitter_eps=b.jitter_eps)
    return meta
