"""The rotary application as a torch custom op that torch.onnx writes as `fuselm::FusedRoPE`.

`install(modeling_module, ...)` swaps the module's `apply_rotary_pos_emb(q, k, cos, sin, ...)`
for one that calls `fuselm_trace::rope` on q and k. While a layer is traced, the layer receives
`position_embeddings = (position_ids, position_ids)`, so the replacement sees the positions (not
cos/sin tables) and the op carries the layer kind's `inv_freq` / `attention_scaling` as attributes.

Before anything is traced, `rope_layout` runs the family's own `apply_rotary_pos_emb` on random
q/k with the rotary module's real cos/sin, and checks which FusedRoPE layout (rotate_half or
interleaved, full or partial rotary) reproduces it: a family whose rotary application is neither
is refused instead of exported wrong.
"""

from __future__ import annotations

import inspect

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
    """One layer kind's rotary: the frequencies (scaling folded in, as the model's module holds them),
    the pair layout, and whether apply_rotary_pos_emb gets q/k as [B,H,S,D] (else [B,S,H,D], GPT-J)."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, interleaved: int = 0, heads_first: bool = True):
        self.inv_freq = inv_freq.detach().to("cpu", torch.float32)
        self.attention_scaling = float(attention_scaling)
        self.interleaved, self.heads_first = interleaved, heads_first

    def key(self) -> tuple:
        return (tuple(self.inv_freq.tolist()), self.attention_scaling, self.interleaved, self.heads_first)


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


def rotated_arguments(apply, model_type: str) -> list[str]:
    """The parameters of an apply_rotary_pos_emb that it rotates: those before `cos` / `sin`
    (q, k for most families; one `tensor` for GPT-J's `apply_rotary_pos_emb(tensor, sin, cos)`)."""
    apply = as_written(apply)
    params = list(inspect.signature(apply).parameters)
    if "cos" not in params or "sin" not in params or min(params.index("cos"), params.index("sin")) == 0:
        raise FuselmError(f"model_type {model_type!r}: its apply_rotary_pos_emb{inspect.signature(apply)} takes no "
                          "(tensors, cos, sin); fuselm's traced exporter cannot map it to FusedRoPE")
    return params[:min(params.index("cos"), params.index("sin"))]


class Installed:
    """While active: `apply_rotary_pos_emb` of the family's module calls the custom op with `spec`."""

    def __init__(self, module, positions_marker):
        self.module, self.marker = module, positions_marker
        self.spec: RopeSpec | None = None
        self.original = getattr(module, "apply_rotary_pos_emb", None)
        self.calls = 0

    def __enter__(self):
        if self.original is not None:
            written = as_written(self.original)  # (the module's attribute itself is what __exit__ puts back)
            self.signature = inspect.signature(written)
            self.rotated = rotated_arguments(written, self.module.__name__)
            self.module.apply_rotary_pos_emb = self._apply
        return self

    def __exit__(self, *exc):
        if self.original is not None:
            self.module.apply_rotary_pos_emb = self.original
        return False

    def _apply(self, *args, **kwargs):
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if a["cos"] is not self.marker() or a["sin"] is not self.marker() or self.spec is None:
            raise FuselmError(f"{self.module.__name__}: the layer changes cos/sin before apply_rotary_pos_emb; "
                              "fuselm's traced exporter cannot map this rotary to FusedRoPE")
        self.calls += 1
        s = self.spec
        heads_first = a["unsqueeze_dim"] == 1 if "unsqueeze_dim" in a else s.heads_first
        out = []
        for name in self.rotated:
            t = a[name].transpose(1, 2) if heads_first else a[name]  # HF's [B,H,S,D] -> FusedRoPE's [B,S,H,D]
            y = torch.ops.fuselm_trace.rope(t, self.marker(), s.inv_freq.tolist(), s.attention_scaling, s.interleaved)
            out.append(y.transpose(1, 2) if heads_first else y)
        return tuple(out) if len(out) > 1 else out[0]


def rope_layout(module, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                attention_scaling: float, head_dim: int, model_type: str) -> tuple[int, bool, int]:
    """(interleaved, heads_first, sign of inv_freq): the FusedRoPE layout and q/k layout that make FusedRoPE equal the
    family's apply_rotary_pos_emb (checked on random tensors, with the rotary module's real cos/sin);
    refuses anything else."""
    apply = as_written(getattr(module, "apply_rotary_pos_emb", None))
    if apply is None:
        raise FuselmError(f"model_type {model_type!r}: its modeling code has no apply_rotary_pos_emb; fuselm's "
                          "traced exporter maps only that function to FusedRoPE")
    names = rotated_arguments(apply, model_type)
    gen = torch.Generator().manual_seed(0)
    batch, seq = positions.shape
    # head_dim wide (the function handles partial rotary itself), or only the rotary part (the
    # attention slices q/k before calling it: Phi, StableLM, Persimmon, GPT-J)
    for width in dict.fromkeys((head_dim, 2 * len(inv_freq))):
        for heads_first in (True, False):
            # FusedRoPE's [B,S,H,D]; 3 heads for the first tensor, 1 for the others (q and a GQA k)
            xs = [torch.randn(batch, seq, 3 if i == 0 else 1, width, generator=gen) for i in range(len(names))]
            with torch.no_grad():
                try:
                    want = apply(**{n: x.transpose(1, 2) if heads_first else x for n, x in zip(names, xs, strict=True)},
                                 cos=cos, sin=sin)
                except RuntimeError:  # shapes it does not take
                    continue
            want = [w.transpose(1, 2) if heads_first else w for w in (want if isinstance(want, tuple) else (want,))]
            # sign -1: the rotation runs the other way (NanoChat's rotate_half is cat(x2, -x1)): FusedRoPE of -inv_freq
            for interleaved, sign in ((0, 1), (1, 1), (0, -1), (1, -1)):
                got = [reference(x, positions, sign * inv_freq, attention_scaling, interleaved) for x in xs]
                if len(want) == len(got) and all(
                        w.shape == g.shape and torch.allclose(g, w, atol=1e-5, rtol=1e-5) for g, w in zip(got, want, strict=True)):
                    return interleaved, heads_first, sign
    raise FuselmError(f"model_type {model_type!r}: its apply_rotary_pos_emb matches neither rotate_half nor "
                      "interleaved FusedRoPE with the rotary module's inv_freq; it cannot be exported as FusedRoPE")
