"""Attention as a torch custom op that torch.onnx writes as one ONNX `Attention`-23 node.

transformers routes every attention module through its attention interface; `fuselm_trace` is
registered there. While a layer is traced the module's cache is None, so the function receives
the NEW keys/values only; it takes the layer's past from the trace context and calls
`fuselm_trace::attention(q, k, v, mask, past_key, past_value)`, whose ONNX form is
`Attention(q, k, v, mask, past_key, past_value) -> (y, present_key, present_value)` with
q/kv heads (GQA), `scale`, `softcap`, `is_causal=0`: the mask is the graph's additive
[B,1,S,T] mask (causal, padding and sliding window in it), as in the builder's optimized graph.

A layer whose cache holds something else than the keys and values attention reads (multi-head latent
attention: the compressed latent and the rotary key, expanded to K/V after the cache) updates its cache
itself, through `TraceCache` (the past input concatenated with the new rows, the layer's present); its
attention then gets the whole K/V and is `fuselm_trace::attention_kv` -> `Attention(q, k, v, mask)`.
Which way a layer uses its cache is read from one dry run with `ProbeCache` (trace.py).
"""

from __future__ import annotations

import torch

from fuselm.errors import FuselmError

NAME = "fuselm_trace"


@torch.library.custom_op("fuselm_trace::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, past_key: torch.Tensor,
              past_value: torch.Tensor, scale: float, softcap: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B,H,S,D], k/v [B,KV,S,D], mask [B,1,S,T] additive, past [B,KV,P,D] -> (y [B,H,S,Dv], present k, v)."""
    key = torch.cat((past_key, k), dim=2)
    value = torch.cat((past_value, v), dim=2)
    rep = q.shape[1] // k.shape[1]
    scores = q @ key.repeat_interleave(rep, dim=1).transpose(2, 3) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores + mask, dim=-1)
    return probs @ value.repeat_interleave(rep, dim=1), key, value


@attention.register_fake
def _(q, k, v, mask, past_key, past_value, scale, softcap):
    b, h, s, _ = q.shape
    t = past_key.shape[2] + k.shape[2]
    return (q.new_empty(b, h, s, v.shape[3]), k.new_empty(b, k.shape[1], t, k.shape[3]),
            v.new_empty(b, v.shape[1], t, v.shape[3]))


@torch.library.custom_op("fuselm_trace::attention_kv", mutates_args=())
def attention_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                 softcap: float) -> torch.Tensor:
    """Attention over complete keys/values (the layer read its own cache): q [B,H,S,D], k/v [B,KV,T,D] -> y."""
    y, _, _ = attention(q, k, v, mask, k[:, :, :0], v[:, :, :0], scale, softcap)
    return y


@attention_kv.register_fake
def _(q, k, v, mask, scale, softcap):
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2], v.shape[3])


@torch.library.custom_op("fuselm_trace::latent_attention", mutates_args=())
def latent_attention(q: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor,
                     scale: float, heads: int, nope: int, v_dim: int) -> torch.Tensor:
    """fuselm::LatentAttention (fuselm/contract.py): q [B,H,S,n+R], latent [B,1,T,r], k_rot [B,1,T,R], weight
    [r, H(n+v)] -> y [B,H,S,v]."""
    return attention_kv(q, *_expanded(latent, k_rot, weight, heads, nope, v_dim), mask, scale, 0.0)


@latent_attention.register_fake
def _(q, latent, k_rot, weight, mask, scale, heads, nope, v_dim):
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2], v_dim)


def _expanded(latent, k_rot, weight, heads: int, nope: int, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) [B,H,T,n+R] / [B,H,T,v] of LatentAttention from latent [B,1,T,r], k_rot [B,1,T,R], weight [r, H(n+v)]."""
    b, _, t, _ = latent.shape
    k_nope, v = (latent[:, 0] @ weight).view(b, t, heads, nope + v_dim).transpose(1, 2).split([nope, v_dim], dim=-1)
    return torch.cat((k_nope, k_rot.expand(-1, heads, -1, -1)), dim=-1), v


def latent_expansion(layer: torch.nn.Module, key, value, latent, k_rot) -> tuple[torch.nn.Module, int, int, int] | None:
    """(the Linear, heads, nope, v) when `key` / `value` (what the layer gave attention) are LatentAttention's expansion
    of `latent` / `k_rot` by the one Linear of `layer` that read `latent` (its `seen`, set by `watch_linears`); None
    for any other expansion (the layer then keeps attention over its own K/V)."""
    seen = [m for m in layer.modules() if getattr(m, "_fuselm_read_latent", False)]
    if len(seen) != 1 or key.dim() != 4 or value.dim() != 4:
        return None
    heads, rot = key.shape[1], k_rot.shape[-1]
    nope, v_dim = key.shape[-1] - rot, value.shape[-1]
    w = seen[0].weight
    if nope <= 0 or getattr(seen[0], "bias", None) is not None or w.shape != (heads * (nope + v_dim), latent.shape[-1]):
        return None
    with torch.no_grad():
        k, v = _expanded(latent, k_rot, w.t(), heads, nope, v_dim)
    if k.shape == key.shape and v.shape == value.shape and torch.allclose(k, key, atol=1e-5) and \
            torch.allclose(v, value, atol=1e-5):
        return seen[0], heads, nope, v_dim
    return None


def translation():
    """{torch op: onnxscript callable} for torch.onnx.export's custom_translation_table."""
    from onnxscript import opset23 as op
    from onnxscript import values

    from fuselm import contract

    latent_op = values.Op(values.Opset(contract.DOMAIN, contract.DOMAIN_VERSION), contract.LATENT_OP,
                          contract.latent_attention_schema())

    def to_onnx_latent(q, latent, k_rot, weight, mask, scale, heads, nope, v_dim):
        return latent_op(q, latent, k_rot, weight, mask, num_heads=int(heads), qk_nope_head_dim=int(nope),
                         v_head_dim=int(v_dim), scale=float(scale))

    def to_onnx(q, k, v, mask, past_key, past_value, scale, softcap):
        y, present_k, present_v, _ = op.Attention(q, k, v, mask, past_key, past_value, scale=float(scale),
                                                  softcap=float(softcap), is_causal=0)
        return y, present_k, present_v

    def to_onnx_kv(q, k, v, mask, scale, softcap):
        y, _, _, _ = op.Attention(q, k, v, mask, scale=float(scale), softcap=float(softcap), is_causal=0)
        return y

    return {torch.ops.fuselm_trace.attention.default: to_onnx, torch.ops.fuselm_trace.attention_kv.default: to_onnx_kv,
            torch.ops.fuselm_trace.latent_attention.default: to_onnx_latent}


class Context:
    """What the attention function needs during one layer trace, and what it leaves behind."""

    def __init__(self):
        self.past: tuple[torch.Tensor, torch.Tensor] | str | None = None  # "empty": a dry run
        self.mask: torch.Tensor | None = None  # the layer's mask input: attention must receive it as is
        self.present: tuple[torch.Tensor, torch.Tensor] | None = None
        self.sliding_window: int | None = None
        self.calls = 0
        self.read: tuple[torch.Tensor, torch.Tensor] | None = None  # the keys/values attention got (a dry run)
        self.latent: tuple | None = None  # (weight, heads, nope, v): attention is LatentAttention over the presents
        self.positions: torch.Tensor | None = None  # the layer's position_ids
        # a sparse-attention layer's indexer keys [B, 1, P, D]: the past given (or "empty"), the present it made
        self.index_past: torch.Tensor | str | None = None
        self.index_present: torch.Tensor | None = None
        self.derived: torch.Tensor | None = None  # the layer's mask with the keys a block indexer left out masked


CONTEXT = Context()


class NotOneAttention(FuselmError):
    """The layer's attention is not one ONNX Attention (two calls, sinks, its own mask): exporter/traced/trace.py
    then traces the model's eager attention instead, with the cache update through TraceCache."""
_IGNORED_KWARGS = {"dropout", "scaling", "sliding_window", "softcap", "position_ids", "cache_position",
                   "output_attentions", "use_cache", "is_causal", "past_key_values", "past_key_value"}
SELECTED = "indices"  # DeepSeek sparse attention hands a kernel that reads it the indexer's top-k keys per query
BIAS = "position_bias"  # a bias [B,H,S,T] the eager path adds to the scores (Inkling's relative positions)


def fuselm_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention-interface function: (attn_output [B,S,H,D], None)."""
    ctx = CONTEXT
    if ctx.past is None:
        raise FuselmError("fuselm_trace attention called outside a layer trace")
    if ctx.past == "empty":  # a dry run: no past, of the shapes the layer's own keys and values have
        ctx.past = (key[:, :, :0], value[:, :, :0])
    if ctx.calls:
        raise NotOneAttention(f"{type(module).__name__}: a decoder layer with more than one attention call "
                          "(cross-attention, parallel heads) is not supported by the traced exporter")
    if attention_mask is not None and attention_mask is not ctx.mask and attention_mask is not ctx.derived:
        raise NotOneAttention(f"{type(module).__name__}: the layer changes the attention mask before attention (a "
                          "learned or per-head mask); the traced exporter supports the causal / sliding-window mask only")
    selected = kwargs.get(SELECTED)
    if attention_mask is not None and isinstance(selected, torch.Tensor) and not selected.is_floating_point() and \
            selected.dim() == 3:
        attention_mask = selected_mask(attention_mask, selected, query.dtype)
        kwargs = {k: v for k, v in kwargs.items() if k != SELECTED}
    bias = kwargs.get(BIAS)
    if attention_mask is not None and isinstance(bias, torch.Tensor) and bias.is_floating_point() and \
            not kwargs.get("softcap"):  # added to the scores before the mask, as the eager path adds it
        attention_mask = attention_mask + bias
        kwargs = {k: v for k, v in kwargs.items() if k != BIAS}
    extra = sorted(k for k, v in kwargs.items() if k not in _IGNORED_KWARGS and isinstance(v, torch.Tensor))
    if extra:
        raise NotOneAttention(f"{type(module).__name__}: attention takes {', '.join(extra)} (e.g. attention sinks), "
                          "which ONNX Attention cannot express; this model_type is not supported")
    if attention_mask is None:
        raise NotOneAttention(f"{type(module).__name__}: attention was called without a mask; not supported")
    ctx.calls += 1
    ctx.sliding_window = kwargs.get("sliding_window")
    ctx.read = (key, value)
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    softcap = float(kwargs.get("softcap") or 0.0)
    if ctx.present is not None and ctx.latent is not None and not softcap:  # MLA over its latent cache
        weight, heads, nope, v_dim = ctx.latent
        y = torch.ops.fuselm_trace.latent_attention(query, *ctx.present, weight.t(), attention_mask, scale, heads,
                                                    nope, v_dim)
    elif ctx.present is not None:  # the layer updated its own cache (TraceCache): key/value are whole
        y = torch.ops.fuselm_trace.attention_kv(query, key, value, attention_mask, scale, softcap)
    else:
        y, present_k, present_v = torch.ops.fuselm_trace.attention(query, key, value, attention_mask, *ctx.past,
                                                                    scale, softcap)
        ctx.present = (present_k, present_v)
    return y.transpose(1, 2).contiguous(), None


def selected_mask(mask: torch.Tensor, selected: torch.Tensor, dtype) -> torch.Tensor:
    """The additive mask [B,1,S,T] with every key outside a query's `selected` [B,S,k] at the dtype's minimum, as
    transformers' eager path of DeepSeek sparse attention writes it (the selection scattered into a boolean mask)."""
    b, s, _ = selected.shape
    outside = torch.ones(b, s, mask.shape[-1], dtype=torch.bool).scatter(-1, selected.long(), False).unsqueeze(1)
    return mask.masked_fill(outside, torch.finfo(dtype).min)


class LengthCache:
    """The cache of a layer that reads its length (Llama 4's attention temperature: positions from the cache's
    length; Inkling's relative positions: the mask's sizes and the first query's offset) or keeps indexer keys:
    `update` hands the new rows back (attention appends them to the past); the length is the position
    of the first query (batch row 0). Under plain feeds that is the past's length; unlike the past's shape, it stays
    right where a runtime feeds a preallocated past of static shape."""

    def update(self, key, value, *args, **kwargs):
        return key, value

    def update_indexer(self, keys, *args, **kwargs):
        """A sparse-attention layer's indexer keys [B,S,D] appended to its past [B,1,P,D] (the layer's `.index`
        cache); the whole [B,T,D] back, as transformers' `update_indexer` returns it."""
        ctx = CONTEXT
        if ctx.index_present is not None:
            raise FuselmError("a decoder layer updated its indexer keys twice; not supported by the traced exporter")
        past = ctx.index_past
        if past is None or isinstance(past, str):
            past = keys[:, None, :0]
        ctx.index_present = torch.cat((past, keys[:, None]), dim=2)
        return ctx.index_present[:, 0]

    def get_seq_length(self, *args, **kwargs):
        return CONTEXT.positions[0, 0]

    def get_mask_sizes(self, q_length: int, *args, **kwargs) -> tuple:
        """The keys the layer's mask covers (the whole cache, from 0)."""
        mask = CONTEXT.mask
        return (q_length if mask is None else mask.shape[-1]), 0

    def get_query_offset(self, *args, **kwargs):
        """The position of the first query: the cache index of its first new row under plain feeds, and under a
        static-shape past too."""
        return CONTEXT.positions[0, 0]


class TraceCache(LengthCache):
    """The cache a layer that computes attention itself (Falcon) gets while traced: `update` appends
    the new keys/values to the layer's past input and keeps the result as the layer's present; the indexer keys, the
    mask's sizes and the first query's position as LengthCache gives them."""

    def update(self, key, value, *args, **kwargs):
        ctx = CONTEXT
        if ctx.present is not None:
            raise FuselmError("a decoder layer updated its cache twice; not supported by the traced exporter")
        if ctx.past == "empty":
            ctx.past = (key[:, :, :0], value[:, :, :0])
        ctx.present = (torch.cat((ctx.past[0], key), dim=2), torch.cat((ctx.past[1], value), dim=2))
        return ctx.present

    def get_seq_length(self, *args, **kwargs) -> int:
        return 0 if CONTEXT.past == "empty" else CONTEXT.past[0].shape[2]


class LatentProbe:
    """The cache of a latent-mode layer in its check run: `update` hands back random rows of the stored shapes, so the
    expansion after the cache is seen on known values (trace.py `_latent_check`)."""

    def __init__(self):
        self.rows: tuple | None = None

    def update(self, key, value, *args, **kwargs):
        self.rows = (torch.randn_like(key), torch.randn_like(value))
        return self.rows

    def update_indexer(self, keys, *args, **kwargs):
        return keys

    def get_seq_length(self, *args, **kwargs):
        return 0


class ProbeCache:
    """The cache a layer gets in its dry run: records what the layer does with it (trace.py's cache modes)."""

    def __init__(self):
        self.updated: tuple | None = None
        self.asked_length = False
        self.indexed = False  # the layer keeps indexer keys (DeepSeek sparse attention)

    def update(self, key, value, *args, **kwargs):
        self.updated = (key, value)
        return key, value

    def update_indexer(self, keys, *args, **kwargs):
        self.indexed = True
        return keys

    def get_mask_sizes(self, q_length, *args, **kwargs):
        self.asked_length = True
        return q_length, 0

    def get_query_offset(self, *args, **kwargs):
        self.asked_length = True
        return 0

    def get_seq_length(self, *args, **kwargs):
        self.asked_length = True
        return 0


def register(masks: bool = True) -> None:
    """Make `attn_implementation="fuselm_trace"` known to transformers. `masks`: the model builds its
    masks as eager attention does (the probe reads them); False: a zero placeholder no node reads (the
    outer trace, where the layers are markers and the graph's mask is the builder's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(NAME, fuselm_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, eager_mask if masks else _placeholder_mask)


def _placeholder_mask(batch_size, q_length, kv_length, *args, dtype=torch.float32, **kwargs):
    return torch.zeros(batch_size, 1, q_length, kv_length, dtype=dtype)
