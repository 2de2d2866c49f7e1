"""Recurrent-state layers traced as fuselm ops: short convolutions, the gated delta rule, Mamba-2's scan.

transformers (5.25) writes every such layer around a few module-level functions of its modeling file, the
kernels it swaps for hub kernels: `causal_conv1d_forward(conv1d, x [B,C,S], cache, layer_idx, activation)`,
`torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state, ...)`,
`mamba2_scan_forward(mixer, x, B, C, dt, cache)` and Mamba-1's `mamba_scan_forward(mixer, x, dt, B, C, gate, cache)`
or, called once per head of a multi-head Mamba-1 (Zamba), `mamba_selective_scan(x, dt, A, B, C, D, z, ...)`.
While a layer is traced, `Installed` swaps them for versions that call `fuselm_trace::causal_conv1d` /
`gated_delta` / `mamba2` / `mamba` on the layer's past state (from `STATE`, the trace context) and leave the present
state there, so the layer's projections, gates and norms trace as plain nodes and the recurrence becomes one
`fuselm::CausalConv1D` / `GatedDeltaNet` / `Mamba2` / `Mamba` node (contract.py).

Before a family is traced, `verify` runs its own functions on random tensors and a random initial state,
single-token and multi-token, against the ops' references: a family whose functions compute something else
is refused instead of exported wrong (as rope_op.py checks the rotary layout).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from fuselm import contract
from fuselm.errors import FuselmError

SWAPPED = ("causal_conv1d_forward", "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
           "chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "mamba2_scan_forward", "mamba_scan_forward",
           "mamba_selective_scan")
L2NORM_EPS = 1e-6  # transformers' l2norm default, FLA's


# --- references: the ops' semantics (fuselm/contract.py's function bodies) ------------------------------
def causal_conv1d_reference(x: torch.Tensor, past: torch.Tensor, weight: torch.Tensor):
    """x [B,S,C], past [B,K-1,C], weight [C,1,K] -> (y [B,S,C], present [B,K-1,C])."""
    full = torch.cat((past.to(x.dtype), x), dim=1)
    taps = weight.shape[-1]
    y = sum(full[:, k:k + x.shape[1]] * weight[:, 0, k] for k in range(taps))
    return y, full[:, x.shape[1]:].clone()


def gated_delta_reference(q, k, v, decay, beta, past):
    """q, k [B,S,Hk,Dk], v [B,S,Hv,Dv], decay [B,S,Hv] or [B,S,Hv,Dk], beta [B,S,Hv], past [B,Hv,Dv,Dk]
    -> (y [B,S,Hv,Dv], present)."""
    rep = v.shape[2] // k.shape[2]
    q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    decay = decay.reshape(*decay.shape[:3], -1)  # [B,S,Hv,1], or per key channel [B,S,Hv,Dk]
    state, out = past.float(), []
    for t in range(q.shape[1]):
        state = state * decay[:, t].exp()[:, :, None, :]
        recalled = (state * k[:, t, :, None, :]).sum(dim=-1)
        delta = (v[:, t] - recalled) * beta[:, t, :, None]
        state = state + delta[..., None] * k[:, t, :, None, :]
        out.append((state * q[:, t, :, None, :]).sum(dim=-1))
    return torch.stack(out, dim=1), state


def mamba2_reference(x, dt, a_log, b, c, d, dt_bias, past, dt_min: float = 0.0, dt_max: float = float("inf")):
    """x [B,S,H,P], dt [B,S,H], A_log / D / dt_bias [H], B / C [B,S,G,N], past [B,H,P,N] -> (y, present)."""
    rep = x.shape[2] // b.shape[2]
    b, c = b.repeat_interleave(rep, dim=2), c.repeat_interleave(rep, dim=2)
    dt = F.softplus(dt + dt_bias).clamp(dt_min, dt_max)
    decay = torch.exp(dt * -torch.exp(a_log))
    state, out = past.float(), []
    for t in range(x.shape[1]):
        state = state * decay[:, t, :, None, None] + (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, :, None, :]
        out.append((state * c[:, t, :, None, :]).sum(dim=-1))
    return torch.stack(out, dim=1) + x * d[:, None], state


def mamba_reference(x, dt, a_log, b, c, d, dt_bias, past):
    """Mamba-1: x / dt [B,S,D], A_log [D,N], B / C [B,S,N], D / dt_bias [D], past [B,D,N] -> (y [B,S,D], present)."""
    dt = F.softplus(dt + dt_bias)
    decay = torch.exp(dt[..., None] * -torch.exp(a_log))  # [B,S,D,N]
    state, out = past.float(), []
    for t in range(x.shape[1]):
        state = state * decay[:, t] + (dt[:, t] * x[:, t])[..., None] * b[:, t, None, :]
        out.append((state * c[:, t, None, :]).sum(dim=-1))
    return torch.stack(out, dim=1) + x * d, state


# --- custom ops ----------------------------------------------------------------------------------------
@torch.library.custom_op("fuselm_trace::causal_conv1d", mutates_args=())
def causal_conv1d(x: torch.Tensor, past: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return causal_conv1d_reference(x, past, weight)


@causal_conv1d.register_fake
def _(x, past, weight):
    return torch.empty_like(x), torch.empty_like(past)


@torch.library.custom_op("fuselm_trace::gated_delta", mutates_args=())
def gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
                past: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return gated_delta_reference(q, k, v, decay, beta, past)


@gated_delta.register_fake
def _(q, k, v, decay, beta, past):
    return torch.empty_like(v), torch.empty_like(past)


@torch.library.custom_op("fuselm_trace::mamba2", mutates_args=())
def mamba2(x: torch.Tensor, dt: torch.Tensor, a_log: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor,
           dt_bias: torch.Tensor, past: torch.Tensor, dt_min: float, dt_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    return mamba2_reference(x, dt, a_log, b, c, d, dt_bias, past, dt_min, dt_max)


@mamba2.register_fake
def _(x, dt, a_log, b, c, d, dt_bias, past, dt_min, dt_max):
    return torch.empty_like(x), torch.empty_like(past)


@torch.library.custom_op("fuselm_trace::mamba", mutates_args=())
def mamba(x: torch.Tensor, dt: torch.Tensor, a_log: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor,
          dt_bias: torch.Tensor, past: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return mamba_reference(x, dt, a_log, b, c, d, dt_bias, past)


@mamba.register_fake
def _(x, dt, a_log, b, c, d, dt_bias, past):
    return torch.empty_like(x), torch.empty_like(past)


def translation():
    """{torch op: onnxscript callable} for torch.onnx.export's custom_translation_table."""
    from onnxscript import values

    ops = {name: values.Op(values.Opset(contract.DOMAIN, contract.DOMAIN_VERSION), name, contract.state_op_schema(name))
           for name in contract.STATE_OPS}

    def conv(x, past, weight):
        return ops[contract.CONV_OP](x, past, weight)

    def delta(q, k, v, decay, beta, past):
        return ops[contract.GDN_OP](q, k, v, decay, beta, past)

    def ssm(x, dt, a_log, b, c, d, dt_bias, past, dt_min, dt_max):
        return ops[contract.MAMBA2_OP](x, dt, a_log, b, c, d, dt_bias, past, dt_min=float(dt_min), dt_max=float(dt_max))

    def scan(x, dt, a_log, b, c, d, dt_bias, past):
        return ops[contract.MAMBA_OP](x, dt, a_log, b, c, d, dt_bias, past)

    return {torch.ops.fuselm_trace.causal_conv1d.default: conv, torch.ops.fuselm_trace.gated_delta.default: delta,
            torch.ops.fuselm_trace.mamba2.default: ssm, torch.ops.fuselm_trace.mamba.default: scan}


# --- the trace context ---------------------------------------------------------------------------------
class Context:
    """One layer trace's states: the pasts it is given (kind -> tensor, or DRY: zeros of the shape the op asks
    for), the presents the ops leave, and which op owns each kind."""

    DRY = "dry"

    def __init__(self):
        self.reset({})

    def reset(self, pasts: dict) -> None:
        self.pasts, self.presents, self.ops, self.shapes, self.parts = dict(pasts), {}, {}, {}, {}
        self.heads: list | None = None  # a multi-head Mamba-1's per-head pasts, while its mixer runs (_HeadsMixer)
        self.head_presents: list = []

    def take(self, kind: str, shape: tuple, op: str) -> torch.Tensor:
        """The layer's past of `kind` for an op of `shape`. Several causal convolutions of one kernel in a layer
        (Inkling's four) share its conv state, their channels side by side in the order they run."""
        past = self.pasts.get(kind, self.DRY)
        if kind in self.ops:
            known = self.shapes.get(kind) or (tuple(past.shape[1:]) if not isinstance(past, str) else None)
            if kind != "conv" or op != self.ops[kind] or known is None or known[0] != shape[1]:
                raise FuselmError(f"a decoder layer runs two {kind} states ({self.ops[kind]} and {op}); fuselm's graph "
                                  "contract carries one of each kind per layer (convolutions of one kernel size share "
                                  "one)")
        self.ops[kind] = op
        at = sum(int(p.shape[-1]) for p in self.parts.get(kind, []))  # the channels earlier convolutions hold
        if isinstance(past, str):
            self.shapes[kind] = (int(shape[1]), at + int(shape[2])) if kind == "conv" else tuple(int(s) for s in shape[1:])
            return torch.zeros(shape, dtype=torch.float32)
        return past[..., at:at + shape[2]] if kind == "conv" else past

    def give(self, kind: str, present: torch.Tensor) -> None:
        self.parts.setdefault(kind, []).append(present)
        parts = self.parts[kind]
        self.presents[kind] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


STATE = Context()


def _conv_forward(conv1d, hidden_states, cache=None, layer_idx=None, activation=None, state_idx=0, **kwargs):
    """transformers' causal_conv1d_forward: x [B,C,S] -> [B,C,S] through fuselm::CausalConv1D."""
    if conv1d.stride != (1,) or conv1d.dilation != (1,) or conv1d.groups != conv1d.in_channels:
        raise FuselmError(f"a {type(conv1d).__name__} that is not a causal depthwise convolution of stride and "
                          "dilation 1 (fuselm::CausalConv1D) is not supported")
    from transformers.activations import ACT2FN

    x = hidden_states.transpose(1, 2)
    past = STATE.take("conv", (x.shape[0], conv1d.kernel_size[0] - 1, x.shape[2]), contract.CONV_OP)
    y, present = torch.ops.fuselm_trace.causal_conv1d(x.float(), past, conv1d.weight.float())
    STATE.give("conv", present)
    if conv1d.bias is not None:
        y = y + conv1d.bias
    if activation is not None:
        y = ACT2FN[activation](y)
    return y.to(hidden_states.dtype).transpose(1, 2)


def _delta_rule(l2norm):
    def rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, **kwargs):
        """transformers' gated delta rule (chunked or recurrent: one op) -> (y [B,S,Hv,Dv], final state)."""
        q, k = query.float(), key.float()
        if use_qk_l2norm_in_kernel:
            q, k = l2norm(q, dim=-1, eps=L2NORM_EPS), l2norm(k, dim=-1, eps=L2NORM_EPS)
        q = q * q.shape[-1] ** -0.5
        b, _, heads, width = value.shape
        past = STATE.take("recurrent", (b, heads, width, k.shape[-1]), contract.GDN_OP)
        y, present = torch.ops.fuselm_trace.gated_delta(q, k, value.float(), g.float(), beta.float(), past)
        STATE.give("recurrent", present)
        return y.to(query.dtype), present.transpose(-1, -2)  # transformers' layout: [B, Hv, Dk, Dv]
    return rule


def _mamba2_scan(module, hidden_states, B, C, dt, cache=None, **kwargs):
    """transformers' mamba2_scan_forward: x [B,S,H·P] -> [B,S,H·P] (D skip included) through fuselm::Mamba2."""
    b, s, _ = hidden_states.shape
    h, p, g, n = module.num_heads, module.head_dim, module.n_groups, module.ssm_state_size
    past = STATE.take("recurrent", (b, h, p, n), contract.MAMBA2_OP)
    lo, hi = (float(v) for v in module.time_step_limit)
    y, present = torch.ops.fuselm_trace.mamba2(hidden_states.reshape(b, s, h, p).float(), dt.float(), module.A_log.float(),
                                               B.reshape(b, s, g, n).float(), C.reshape(b, s, g, n).float(),
                                               module.D.float(), module.dt_bias.float(), past, lo, hi)
    STATE.give("recurrent", present)
    return y.reshape(b, s, h * p).to(hidden_states.dtype)


def _mamba_scan(module, hidden_states, time_step, B, C, gate, cache=None, **kwargs):
    """transformers' mamba_scan_forward (Mamba-1): x / time_step / gate [B,D,S], B / C [B,S,N] -> [B,D,S], through
    fuselm::Mamba and the gate SiLU(gate) after it."""
    x, dt = hidden_states.transpose(1, 2).float(), time_step.transpose(1, 2).float()
    bias = module.dt_proj.bias
    past = STATE.take("recurrent", (x.shape[0], *module.A_log.shape), contract.MAMBA_OP)
    y, present = torch.ops.fuselm_trace.mamba(x, dt, module.A_log.float(), B.float(), C.float(), module.D.float(),
                                              bias.float() if bias is not None else torch.zeros(x.shape[2]), past)
    STATE.give("recurrent", present)
    return (y * F.silu(gate.transpose(1, 2).float())).to(hidden_states.dtype).transpose(1, 2)


def _selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                    return_last_state=False, **kwargs):
    """transformers' mamba_selective_scan on one head of a multi-head Mamba-1 (Zamba): x / dt / z [B,Dh,S], A [Dh,N]
    (-exp(A_log)), B / C [B,N,S] -> y [B,Dh,S] (D skip, SiLU(z) gate after it), through fuselm::Mamba on the head's
    rows of the layer's state (heads in the order the mixer scans them)."""
    if STATE.heads is None or not delta_softplus or len(STATE.head_presents) >= len(STATE.heads):
        raise FuselmError("mamba_selective_scan called outside a multi-head Mamba mixer, more than once per head or "
                          "without softplus on dt; not supported by the traced exporter")
    past = STATE.heads[len(STATE.head_presents)]
    x, step = hidden_states.transpose(1, 2).float(), dt.transpose(1, 2).float()
    zeros = torch.zeros(x.shape[2])
    y, present = torch.ops.fuselm_trace.mamba(x, step, torch.log(-A.float()), B.transpose(1, 2).float(),
                                              C.transpose(1, 2).float(), zeros if D is None else D.float(),
                                              zeros if delta_bias is None else delta_bias.float(), past)
    STATE.head_presents.append(present)
    if z is not None:
        y = y * F.silu(z.transpose(1, 2).float())
    y = y.to(hidden_states.dtype).transpose(1, 2)
    return (y, present) if return_last_state else y


def _heads_mixer(forward):
    """A multi-head Mamba-1 mixer's forward (Zamba's: a scan per head of `mamba_head_dim` channels): its layer state
    is one [B, heads · head_dim, N] fuselm::Mamba state, each head's scan reading and writing its rows."""
    def run(self, hidden_states, *args, **kwargs):
        heads, width, n = self.n_mamba_heads, self.mamba_head_dim, self.ssm_state_size
        past = STATE.take("recurrent", (hidden_states.shape[0], heads * width, n), contract.MAMBA_OP)
        STATE.heads, STATE.head_presents = list(past.split(width, dim=1)), []
        try:
            out = forward(self, hidden_states, *args, **kwargs)
            if len(STATE.head_presents) != heads:
                raise FuselmError(f"{type(self).__name__} scanned {len(STATE.head_presents)} of its {heads} heads; not "
                                  "supported by the traced exporter")
            STATE.give("recurrent", torch.cat(STATE.head_presents, dim=1))
        finally:
            STATE.heads = None
        return out
    return run


def _heads_mixers(module) -> list[type]:
    """The modeling module's multi-head Mamba-1 mixers: classes that scan with `mamba_selective_scan` per head (a
    module with `mamba_scan_forward` calls it from there, on all channels at once)."""
    if "mamba_selective_scan" not in vars(module) or "mamba_scan_forward" in vars(module):
        return []
    return [c for n, c in vars(module).items() if n.endswith("MambaMixer") and isinstance(c, type)]


RGLRU_DT = (1e-20, 80.0)  # the dt range of the RG-LRU as fuselm::Mamba2: x = u / dt stays finite, exp(-80) is 0


def _rnn_scan(self, hidden_states, recurrent_gate, reset=None, recurrent_states=None, acc_dtype=torch.float32):
    """Griffin's RG-LRU recurrence (RecurrentGemma's `_rnn_scan`: per channel h = a·h + u) through fuselm::Mamba2 with
    a head per channel (P = N = 1), A_log = 0, dt = softplus⁻¹(−log a) in RGLRU_DT, x = u / dt, B = C = 1, D = 0: the
    state decays by exp(−dt) = a and gains dt·x = u. The reset at position 0 is the zero state a run starts from."""
    b, s, width = hidden_states.shape
    lo, hi = RGLRU_DT
    delta = (-torch.log(recurrent_gate.float())).clamp(max=hi)  # -log a
    dt = torch.log(torch.exp(delta) - 1.0)  # softplus⁻¹: the op's softplus(dt) gives delta back
    step = F.softplus(dt).clamp(lo, hi)  # the dt the op uses
    past = STATE.take("recurrent", (b, width, 1, 1), contract.MAMBA2_OP)
    zeros, ones = torch.zeros(width), torch.ones(b, s, 1, 1)
    y, present = torch.ops.fuselm_trace.mamba2((hidden_states.float() / step)[..., None], dt, zeros, ones, ones, zeros,
                                               zeros, past, lo, hi)
    STATE.give("recurrent", present)
    return y[..., 0].to(hidden_states.dtype), present[..., 0, 0]


def _recurrent_block_forward(self, input_states, position_ids, attention_mask=None, use_cache=True, **kwargs):
    """Griffin's recurrent block (RecurrentGemma): its causal convolution through fuselm::CausalConv1D on the layer's
    conv state (transformers' block keeps it in the module), then its RG-LRU (`_rnn_scan`) and projections as written."""
    y_branch = self.act_fn(self.linear_y(input_states))
    x = self.linear_x(input_states)
    conv = self.conv_1d
    past = STATE.take("conv", (x.shape[0], conv.kernel_size[0] - 1, x.shape[2]), contract.CONV_OP)
    x, present = torch.ops.fuselm_trace.causal_conv1d(x.float(), past, conv.weight.float())
    STATE.give("conv", present)
    x = self.rg_lru((x + conv.bias).to(input_states.dtype), position_ids)
    return self.linear_out(x * y_branch), None


def griffin_classes(module) -> dict[type, tuple[str, object]]:
    """The modeling module's Griffin classes -> (method, its tracing version): the RG-LRU's `_rnn_scan`, the recurrent
    block's `forward`."""
    found = {}
    for name, c in vars(module).items():
        if isinstance(c, type) and name.endswith("Rglru") and hasattr(c, "_rnn_scan"):
            found[c] = ("_rnn_scan", _rnn_scan)
        elif isinstance(c, type) and name.endswith("RecurrentBlock") and hasattr(c, "_setup_cache"):
            found[c] = ("forward", _recurrent_block_forward)
    return found if len(found) == 2 else {}


def _lightning_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
    """Lightning attention (MiniMax: per head a state decaying by exp(−slope) a token, S = S·exp(−slope) + v ⊗ k,
    y = S q) through fuselm::Mamba2 with dt = 1 (dt_min = dt_max = 1), A_log = log(slope), B = k, C = q, D = 0;
    then its norm, output gate and projection as written."""
    b, s, _ = hidden_states.shape
    h, d = self.num_attention_heads, self.head_dim
    qkv = self.act_fn(self.qkv_proj(hidden_states))
    if attention_mask is not None and attention_mask.dim() == 2:  # transformers' padding mask
        qkv = qkv * attention_mask[:, -s:, None].to(qkv.dtype)
    q, k, v = torch.split(qkv.reshape(b, s, h, 3 * d), d, dim=3)
    past = STATE.take("recurrent", (b, h, d, d), contract.MAMBA2_OP)
    zeros = torch.zeros(h)
    y, present = torch.ops.fuselm_trace.mamba2(v.float(), torch.zeros(b, s, h), torch.log(self.slope_rate.reshape(h).float()),
                                               k.float(), q.float(), zeros, zeros, past, 1.0, 1.0)
    STATE.give("recurrent", present)
    out = self.norm(y.reshape(b, s, h * d).to(hidden_states.dtype))
    out = torch.sigmoid(self.output_gate(hidden_states)) * out
    return self.out_proj(out), None


def _lightning_classes(module) -> list[type]:
    return [c for n, c in vars(module).items() if n.endswith("LightningAttention") and isinstance(c, type)]


class Installed:
    """While active, the modeling module's state kernels (SWAPPED) are the tracing versions above, and its lightning
    attention classes' forward `_lightning_forward`."""

    def __init__(self, module):
        self.module = module
        self.saved = {name: getattr(module, name) for name in SWAPPED if hasattr(module, name)}
        self.classes = {c: c.forward for c in _lightning_classes(module)}
        self.mixers = {c: c.forward for c in _heads_mixers(module)}
        self.griffin = {c: (method, getattr(c, method), ours) for c, (method, ours) in griffin_classes(module).items()}

    def __enter__(self):
        ours = {"causal_conv1d_forward": _conv_forward, "mamba2_scan_forward": _mamba2_scan,
                "mamba_scan_forward": _mamba_scan, "mamba_selective_scan": _selective_scan if self.mixers else None}
        for name in self.saved:
            fn = ours[name] if name in ours else _delta_rule(self.module.l2norm)  # the gated delta rules
            if fn is not None:
                setattr(self.module, name, fn)
        for c in self.classes:
            c.forward = _lightning_forward
        for c, forward in self.mixers.items():
            c.forward = _heads_mixer(forward)
        for c, (method, _, ours) in self.griffin.items():
            setattr(c, method, ours)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(self.module, name, fn)
        for c, fn in {**self.classes, **self.mixers}.items():
            c.forward = fn
        for c, (method, theirs, _) in self.griffin.items():
            setattr(c, method, theirs)
        return False


# --- the family's own functions against the references -------------------------------------------------
class _FakeCache:
    """The cache methods a family's scan function or lightning attention calls, holding one recurrent state."""

    def __init__(self, state):
        self.state = state

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self.state

    def update_recurrent_state(self, state, layer_idx, state_idx=0, **kwargs):
        self.state = state if isinstance(state, torch.Tensor) else state[-1]
        return self.state

    def get_recurrent_states_to_keep(self, layer_idx):
        return 0

    def get_linear_cache(self, layer_idx):
        return self.state

    def set_linear_cache(self, layer_idx, state):
        self.state = state


def _small(cls, config, gen, scale: float, **sizes):
    """`cls(config, 0)` on the CPU at the small `sizes` (config fields), its parameters random (times `scale`)."""
    import copy

    cfg = copy.deepcopy(config)
    for k, v in sizes.items():
        setattr(cfg, k, v)
    with torch.device("cpu"):
        layer = cls(cfg, 0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return layer


def _verify_lightning(cls, config, model_type: str, close) -> None:
    """The class's own forward at a small size (2 heads of 8, blocks of 4), several tokens from zeros and one from a
    random state, against `_lightning_forward`."""
    gen = torch.Generator().manual_seed(0)
    layer = _small(cls, config, gen, 0.3, hidden_size=16, num_attention_heads=2, head_dim=8, block_size=4)
    with torch.no_grad():
        for seq, s0 in ((6, None), (1, torch.randn(2, 2, 8, 8, generator=gen) * 0.3)):
            x = torch.randn(2, seq, 16, generator=gen)
            cache = _FakeCache(None if s0 is None else s0.clone())
            want = cls.forward(layer, x, None, None, cache=cache)[0]
            STATE.reset({"recurrent": torch.zeros(2, 2, 8, 8) if s0 is None else s0.transpose(-1, -2)})
            try:
                got = _lightning_forward(layer, x)[0]
                state = STATE.presents["recurrent"].transpose(-1, -2)
            finally:
                STATE.reset({})
            close([got, state], [want, cache.state], f"lightning attention ({cls.__name__})")


def _verify_griffin(module, config, close) -> None:
    """The recurrent block's own forward (module-held states, as transformers runs it) at a small size, several tokens
    from zeros and one from random states, against its tracing version (Installed)."""
    block = next(c for c, (method, _) in griffin_classes(module).items() if method == "forward")
    gen = torch.Generator().manual_seed(0)
    layer = _small(block, config, gen, 0.5, hidden_size=8, lru_width=8, num_attention_heads=2, conv1d_width=4)
    with torch.no_grad():
        for seq, start in ((6, 0), (1, 9)):
            x, positions = torch.randn(2, seq, 8, generator=gen), torch.arange(start, start + seq)[None].repeat(2, 1)
            layer._setup_cache(2, "cpu", torch.float32)
            if start:
                layer.conv1d_state = torch.randn(2, 8, 3, generator=gen)
                layer.rg_lru.recurrent_states = torch.randn(2, 8, generator=gen)
            conv, h = layer.conv1d_state.transpose(1, 2).clone(), layer.rg_lru.recurrent_states[..., None, None].clone()
            want = block.forward(layer, x, positions, None, use_cache=True)[0]
            states = [layer.conv1d_state.transpose(1, 2), layer.rg_lru.recurrent_states[..., None, None]]
            STATE.reset({"conv": conv, "recurrent": h})
            try:
                with Installed(module):
                    got = layer(x, positions, None)[0]
                got = [got, STATE.presents["conv"], STATE.presents["recurrent"]]
            finally:
                STATE.reset({})
            close(got, [want, *states], f"recurrent block ({block.__name__})")


def verify(module, model_type: str, config=None) -> None:
    """Run the modeling module's own state functions (those Installed swaps) on random tensors, one token and
    several, from a random state, against the references; refuses the family if they differ."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its kernels' "falling back to the PyTorch implementation" notes
    try:
        _verify(module, model_type, config)
    finally:
        hf_logging.set_verbosity(level)


def _verify(module, model_type: str, config=None) -> None:
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    def close(got, want, what):
        if not all(torch.allclose(g.float(), w.float(), atol=2e-4, rtol=2e-4) for g, w in zip(got, want, strict=True)):
            raise FuselmError(f"model_type {model_type!r}: its {what} does not compute what fuselm's {what} op does "
                              "(checked on random inputs); not supported by the traced exporter")

    for cls in _lightning_classes(module) if config is not None else ():
        _verify_lightning(cls, config, model_type, close)
    if config is not None and griffin_classes(module):
        _verify_griffin(module, config, close)
    fn = getattr(module, "causal_conv1d_fn", None)
    if fn is not None:
        x, w = rnd(2, 6, 5), rnd(6, 1, 4)
        want = fn(x, w.squeeze(1), None, activation=None)
        close([causal_conv1d_reference(x.transpose(1, 2), torch.zeros(2, 3, 6), w)[0].transpose(1, 2)], [want],
              "causal_conv1d_fn")
    rules = [(1, "torch_recurrent_gated_delta_rule", 2, ()), (5, "torch_chunk_gated_delta_rule", 2, ()),  # GQA
             (1, "recurrent_kimi_delta_attention", 4, (8,)), (5, "chunk_kimi_delta_attention", 4, (8,))]  # per channel
    for seq, name, k_heads, channels in rules:
        if name in vars(module):
            rule = _delta_rule(module.l2norm)
            q, k, v = rnd(2, seq, k_heads, 8), rnd(2, seq, k_heads, 8), rnd(2, seq, 4, 6)
            g, beta, s0 = -rnd(2, seq, 4, *channels).abs(), rnd(2, seq, 4).sigmoid(), rnd(2, 4, 8, 6, scale=0.3)
            want = getattr(module, name)(q, k, v, g=g, beta=beta, initial_state=s0.clone(), output_final_state=True,
                                         use_qk_l2norm_in_kernel=True)
            STATE.reset({"recurrent": s0.transpose(-1, -2)})
            try:
                got = rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
            finally:
                STATE.reset({})
            close(got, want, name)
    if "mamba2_scan_forward" in vars(module):
        mixer = SimpleNamespace(num_heads=4, head_dim=3, n_groups=2, ssm_state_size=5, time_step_limit=(0.0, float("inf")),
                                chunk_size=4, layer_idx=0, intermediate_size=12, A_log=rnd(4, scale=0.5), D=rnd(4),
                                dt_bias=rnd(4))
        for seq in (1, 6):
            x, b, c, dt, s0 = rnd(2, seq, 12), rnd(2, seq, 10), rnd(2, seq, 10), rnd(2, seq, 4), rnd(2, 4, 3, 5, scale=0.3)
            cache = _FakeCache(s0.clone())
            want = module.mamba2_scan_forward(mixer, x, b, c, dt, cache)
            ref = mamba2_reference(x.reshape(2, seq, 4, 3), dt, mixer.A_log, b.reshape(2, seq, 2, 5),
                                   c.reshape(2, seq, 2, 5), mixer.D, mixer.dt_bias, s0)
            close([ref[0].reshape(2, seq, 12), ref[1]], [want, cache.state], "mamba2_scan_forward")
    if _heads_mixers(module):  # one head's scan from zeros (transformers' several-token form), and its one-token step
        a_log, d, bias = rnd(6, 4, scale=0.5), rnd(6), rnd(6)
        x, dt, gate, b, c = rnd(2, 6, 5), rnd(2, 6, 5), rnd(2, 6, 5), rnd(2, 4, 5), rnd(2, 4, 5)
        want = module.mamba_selective_scan(x, dt, -a_log.exp(), b, c, D=d, z=gate, delta_bias=bias, delta_softplus=True,
                                           return_last_state=True)
        STATE.reset({})
        STATE.heads = [torch.zeros(2, 6, 4)]
        try:
            got = _selective_scan(x, dt, -a_log.exp(), b, c, D=d, z=gate, delta_bias=bias, delta_softplus=True,
                                  return_last_state=True)
        finally:
            STATE.reset({})
        close(got, want, "mamba_selective_scan")
        s0 = rnd(2, 6, 4, scale=0.3)
        state = s0.clone()
        step = module.mamba_selective_state_update(state, x[..., 0], dt[..., 0], -a_log.exp(), b[..., 0], c[..., 0], d,
                                                   z=gate[..., 0], dt_bias=bias, dt_softplus=True)
        y, ref = mamba_reference(x[..., :1].transpose(1, 2), dt[..., :1].transpose(1, 2), a_log, b[..., :1].transpose(1, 2),
                                 c[..., :1].transpose(1, 2), d, bias, s0)
        close([(y[:, 0] * F.silu(gate[..., 0])), ref], [step, state], "mamba_selective_state_update")
    if "mamba_scan_forward" in vars(module):
        mixer = SimpleNamespace(A_log=rnd(6, 4, scale=0.5), D=rnd(6), dt_proj=SimpleNamespace(bias=rnd(6)), layer_idx=0,
                                use_mambapy=False, use_associative_scan=False)
        # transformers' several-token form starts from zeros whatever its cache holds: compared from zeros
        for seq, s0 in ((1, rnd(2, 6, 4, scale=0.3)), (5, torch.zeros(2, 6, 4))):
            x, dt, gate, b, c = rnd(2, 6, seq), rnd(2, 6, seq), rnd(2, 6, seq), rnd(2, seq, 4), rnd(2, seq, 4)
            cache = _FakeCache(s0.clone())
            want = module.mamba_scan_forward(mixer, x, dt, b, c, gate, cache)
            y, state = mamba_reference(x.transpose(1, 2), dt.transpose(1, 2), mixer.A_log, b, c, mixer.D,
                                       mixer.dt_proj.bias, s0)
            close([(y * F.silu(gate.transpose(1, 2))).transpose(1, 2), state], [want, cache.state], "mamba_scan_forward")
