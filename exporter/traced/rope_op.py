"""The rotary application as a torch custom op that torch.onnx writes as `fuselm::FusedRoPE`.

`Installed` swaps the module's rotary functions (APPLY_FUNCTIONS: `apply_rotary_pos_emb(q, k, cos, sin,
...)`, DeepSeek-V3's `apply_rotary_pos_emb_interleave`, the complex `apply_rotary_emb(xq, xk, freqs_cis)`)
for ones that call `fuselm_trace::rope` on q and k. While a layer is traced, the layer receives
`position_embeddings = (position_ids, position_ids)` (or `position_ids` alone for a complex rotary), so
the replacement sees the positions (not cos/sin tables) and the op carries the layer kind's `inv_freq` /
`attention_scaling` as attributes.

Before anything is traced, `rope_layouts` runs each of the family's own rotary functions on random
q/k with the rotary module's real cos/sin, and checks which FusedRoPE layout (rotate_half or
interleaved, full or partial rotary) reproduces it: a family whose rotary application is neither
is refused instead of exported wrong.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch

from fuselm import contract
from fuselm.errors import FuselmError


@torch.library.custom_op("fuselm_trace::rope", mutates_args=())
def rope(x: torch.Tensor, position_ids: torch.Tensor, inv_freq: list[float], attention_scaling: float,
         interleaved: int) -> torch.Tensor:
    """x [B,S,H,D], position_ids int64 [B,S] -> x rotated (the FusedRoPE contract, DESIGN.md)."""
    return reference(x, position_ids, torch.tensor(inv_freq, dtype=torch.float32), attention_scaling, interleaved)


@rope.register_fake
def _(x, position_ids, inv_freq, attention_scaling, interleaved):
    return torch.empty_like(x)


def reference(x: torch.Tensor, position_ids: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
              interleaved: int = 0) -> torch.Tensor:
    """FusedRoPE in torch. cos/sin are [B,S,1,R]: `unsqueeze(2)` of [B,S,R] broadcasts over the heads of
    [B,S,H,D] (never [S,1,R,1], the unsqueeze trap); dims R..D pass through unrotated."""
    rdim = 2 * inv_freq.shape[0]
    freqs = position_ids[..., None].to(torch.float32) * inv_freq.to(x.device)  # [B,S,R/2]
    x_rot, x_pass = x[..., :rdim], x[..., rdim:]
    if interleaved:
        emb = freqs.repeat_interleave(2, dim=-1)
        pairs = x_rot.unflatten(-1, (-1, 2))
        rot = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
        half = rdim // 2
        rot = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    cos = (emb.cos() * attention_scaling).unsqueeze(2).to(x.dtype)
    sin = (emb.sin() * attention_scaling).unsqueeze(2).to(x.dtype)
    return torch.cat((x_rot * cos + rot * sin, x_pass), dim=-1)


def translation():
    """{torch op: onnxscript callable} for torch.onnx.export's custom_translation_table."""
    from onnxscript import values

    fused_rope = values.Op(values.Opset(contract.DOMAIN, contract.DOMAIN_VERSION), contract.ROPE_OP,
                          contract.rope_schema(extended=False))

    def to_onnx(x, position_ids, inv_freq, attention_scaling, interleaved):
        return fused_rope(x, position_ids, inv_freq=list(inv_freq), attention_scaling=float(attention_scaling),
                          interleaved=int(interleaved))

    return {torch.ops.fuselm_trace.rope.default: to_onnx}


class RopeSpec:
    """One layer kind's rotary: the frequencies (scaling folded in, as the model's module holds them), and per
    rotary function of the modeling file (`APPLY_FUNCTIONS`) its Layout. `complex`: the model hands the layers one
    complex tensor polar(1, position x inv_freq) (Llama 4, DeepSeek-V2) rather than a (cos, sin) pair.
    `interleaved` / `heads_first` are those of the function the layer calls (`use`, after its trace)."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, layouts: dict[str, Layout], complex_pe: bool = False):
        self.inv_freq = inv_freq.detach().to("cpu", torch.float32)
        self.attention_scaling = float(attention_scaling)
        self.layouts, self.complex = dict(layouts), complex_pe
        # the op's attribute per sign, as Python floats made here (inside a trace, tensor math is symbolic)
        self.signed = {sign: [sign * v for v in self.inv_freq.tolist()] for sign in (1, -1)}
        self.use(next(iter(self.layouts)))

    def use(self, function: str) -> None:
        """The layout of `function` (the one the traced layer called) is the spec's."""
        self.function = function
        layout = self.layouts[function]
        self.interleaved, self.heads_first = layout.interleaved, layout.heads_first

    def key(self) -> tuple:
        return (tuple(self.inv_freq.tolist()), self.attention_scaling, self.complex,
                tuple(sorted((k, tuple(v)) for k, v in self.layouts.items())))


class Layout(NamedTuple):
    """How one rotary function of a modeling file maps to FusedRoPE: the pair layout, whether it takes q/k as
    [B,H,S,D], the sign of inv_freq, and `permuted`: it returns the interleaved pairs' rotated halves as
    [evens, odds] (DeepSeek-V3's apply_rotary_pos_emb_interleave). FusedRoPE then leaves the pairs in place:
    the same permutation of q's and k's rotary dims, so q·kᵀ is unchanged (only q and k are rotated)."""

    interleaved: int
    heads_first: bool
    sign: int = 1
    permuted: bool = False


# The modeling files' rotary functions (rotate_half / interleaved on cos and sin; DeepSeek-V3's interleaved
# variant; the complex form on freqs_cis): each is replaced by FusedRoPE while a layer is traced.
APPLY_FUNCTIONS = ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave", "apply_rotary_emb")


def as_written(fn):
    """`fn` as the modeling file wrote it. transformers 5.25 depends on `kernels`, whose
    `use_kernel_forward_from_hub` (on apply_rotary_pos_emb and other functions) turns a function into an
    nn.Module instance that calls it (its signature: (*args, **kwargs)); the function is the one its
    forward closes over. Anything else is returned as it is."""
    if isinstance(fn, torch.nn.Module):
        inner = [c.cell_contents for c in type(fn).forward.__closure__ or () if inspect.isfunction(c.cell_contents)]
        if len(inner) == 1:
            return inner[0]
    return fn


def _pe_params(params: list[str]) -> list[str]:
    """The position-embedding parameters of a rotary function: `cos` and `sin`, or one complex `freqs_cis`."""
    if "cos" in params and "sin" in params:
        return ["cos", "sin"]
    return [p for p in params if "freq" in p][:1]


def rotated_arguments(apply, model_type: str) -> list[str]:
    """The parameters of an apply_rotary_pos_emb that it rotates: those before `cos` / `sin` (or `freqs_cis`)
    (q, k for most families; one `tensor` for GPT-J's `apply_rotary_pos_emb(tensor, sin, cos)`)."""
    apply = as_written(apply)
    params = list(inspect.signature(apply).parameters)
    pe = _pe_params(params)
    if not pe or min(params.index(p) for p in pe) == 0:
        raise FuselmError(f"model_type {model_type!r}: its {apply.__name__}{inspect.signature(apply)} takes no "
                          "(tensors, cos, sin) or (tensors, freqs_cis); fuselm's traced exporter cannot map it to FusedRoPE")
    return params[:min(params.index(p) for p in pe)]


ACTIVE: Installed | None = None  # the Installed in effect (a layer trace's)


class Installed:
    """While active: the family module's rotary functions (APPLY_FUNCTIONS) call the custom op with `spec`."""

    def __init__(self, module, positions_marker):
        self.module, self.marker = module, positions_marker
        self.spec: RopeSpec | None = None
        self.originals = {n: getattr(module, n) for n in APPLY_FUNCTIONS if callable(getattr(module, n, None))}
        self.calls = 0
        self.used: str | None = None  # the function the layer called

    def __enter__(self):
        self.signatures, self.rotated, self.pe = {}, {}, {}
        for name, original in self.originals.items():
            written = as_written(original)  # (the module's attribute itself is what __exit__ puts back)
            self.signatures[name] = inspect.signature(written)
            self.rotated[name] = rotated_arguments(written, self.module.__name__)
            self.pe[name] = _pe_params(list(self.signatures[name].parameters))
            setattr(self.module, name, lambda *a, _name=name, **k: self._apply(_name, *a, **k))
        global ACTIVE
        self.outer, ACTIVE = ACTIVE, self
        return self

    def __exit__(self, *exc):
        global ACTIVE
        for name, original in self.originals.items():
            setattr(self.module, name, original)
        ACTIVE = self.outer
        return False

    def rotate_at(self, x: torch.Tensor, positions: torch.Tensor, function: str = "apply_rotary_pos_emb") -> torch.Tensor:
        """x [B,S,H,D] rotated as `function` rotates, at `positions` [B,S] other than the step's (a block indexer's keys
        at their blocks' first positions): in standard ops, as the runtime reads FusedRoPE's positions as the step's."""
        s = self.spec
        if s is None or function not in s.layouts:
            raise FuselmError(f"{self.module.__name__}: the layer rotates at other positions than the step's without a "
                              "rotary the model hands it; not supported by the traced exporter")
        layout = s.layouts[function]
        return reference(x, positions, torch.tensor(s.signed[layout.sign]), s.attention_scaling, layout.interleaved)

    def _apply(self, function: str, *args, **kwargs):
        bound = self.signatures[function].bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        s = self.spec
        if s is None and all(a[p] is not self.marker() for p in self.pe[function]):
            # the model hands the layer no rotary and the layer makes its own cos/sin from position_ids (Moshi's
            # rotary module inside the attention): traced as written, in standard ops
            return as_written(self.originals[function])(*args, **kwargs)
        if any(a[p] is not self.marker() for p in self.pe[function]) or s is None or function not in s.layouts:
            raise FuselmError(f"{self.module.__name__}: the layer changes cos/sin before {function}; "
                              "fuselm's traced exporter cannot map this rotary to FusedRoPE")
        self.calls += 1
        self.used = function
        layout = s.layouts[function]
        heads_first = a["unsqueeze_dim"] == 1 if "unsqueeze_dim" in a else layout.heads_first
        inv_freq = s.signed[layout.sign]
        out = []
        for name in self.rotated[function]:
            if a[name] is None:  # (Qwen4-Exp's rotates q alone: k=None)
                continue
            t = a[name].transpose(1, 2) if heads_first else a[name]  # HF's [B,H,S,D] -> FusedRoPE's [B,S,H,D]
            y = torch.ops.fuselm_trace.rope(t, self.marker(), inv_freq, s.attention_scaling, layout.interleaved)
            out.append(y.transpose(1, 2) if heads_first else y)
        return tuple(out) if len(out) > 1 else out[0]


def rope_layouts(module, pe, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float, head_dim: int,
                 model_type: str) -> dict[str, Layout]:
    """Per rotary function of the modeling file (APPLY_FUNCTIONS) the Layout that makes FusedRoPE equal it, checked
    on random tensors with the rotary module's real position embeddings `pe` ((cos, sin), or one complex tensor);
    a function no layout reproduces is left out, and a file where none is left is refused."""
    found = {}
    for name in APPLY_FUNCTIONS:
        apply = as_written(getattr(module, name, None))
        if callable(apply):
            layout = _layout(apply, pe, positions, inv_freq, attention_scaling, head_dim, model_type)
            if layout is not None:
                found[name] = layout
    if not found:
        present = [n for n in APPLY_FUNCTIONS if callable(getattr(module, n, None))]
        raise FuselmError(f"model_type {model_type!r}: " + (
            f"its {', '.join(present)} match neither rotate_half nor interleaved FusedRoPE with the rotary module's "
            "inv_freq; it cannot be exported as FusedRoPE" if present else
            f"its modeling code has none of {', '.join(APPLY_FUNCTIONS)}; fuselm's traced exporter maps only those "
            "to FusedRoPE"))
    return found


def _layout(apply, pe, positions, inv_freq, attention_scaling, head_dim, model_type) -> Layout | None:
    names = rotated_arguments(apply, model_type)
    pe_names = _pe_params(list(inspect.signature(apply).parameters))
    if len(pe_names) == 2 and isinstance(pe, torch.Tensor):  # a (cos, sin) function beside a complex rotary
        pe = (pe.real, pe.imag)
    if len(pe_names) == 1 and not isinstance(pe, torch.Tensor):
        return None
    pe_args = dict(zip(pe_names, pe, strict=True)) if len(pe_names) == 2 else {pe_names[0]: pe}
    gen = torch.Generator().manual_seed(0)
    batch, seq = positions.shape
    rdim = 2 * len(inv_freq)
    pairs = torch.cat((torch.arange(0, rdim, 2), torch.arange(1, rdim, 2)))  # [evens, odds]
    # head_dim wide (the function handles partial rotary itself), or only the rotary part (the
    # attention slices q/k before calling it: Phi, StableLM, Persimmon, GPT-J, DeepSeek)
    for width in dict.fromkeys((head_dim, rdim)):
        for heads_first in (True, False):
            # FusedRoPE's [B,S,H,D]; 3 heads for the first tensor, 1 for the others (q and a GQA k)
            xs = [torch.randn(batch, seq, 3 if i == 0 else 1, width, generator=gen) for i in range(len(names))]
            with torch.no_grad():
                try:
                    want = apply(**{n: x.transpose(1, 2) if heads_first else x for n, x in zip(names, xs, strict=True)},
                                 **pe_args)
                except RuntimeError:  # shapes it does not take
                    continue
            want = [w.transpose(1, 2) if heads_first else w for w in (want if isinstance(want, tuple) else (want,))]
            # sign -1: the rotation runs the other way (NanoChat's rotate_half is cat(x2, -x1)): FusedRoPE of -inv_freq
            for interleaved, sign in ((0, 1), (1, 1), (0, -1), (1, -1)):
                got = [reference(x, positions, sign * inv_freq, attention_scaling, interleaved) for x in xs]
                if _same(got, want):
                    return Layout(interleaved, heads_first, sign)
                if interleaved and len(names) == 2 and width == rdim and _same([g[..., pairs] for g in got], want):
                    return Layout(interleaved, heads_first, sign, permuted=True)
    return None


def _same(got, want) -> bool:
    return len(want) == len(got) and all(w.shape == g.shape and torch.allclose(g, w.to(g.dtype), atol=1e-5, rtol=1e-5)
                                         for g, w in zip(got, want, strict=True))
