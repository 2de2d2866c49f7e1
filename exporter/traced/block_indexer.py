"""Block-sparse attention with a block indexer (Qwen4-Exp's QSA), traced.

Its indexer pools the cached indexer keys in blocks of `compress_ratio`, scores each complete block against the query
(ReLU of the dot product, summed over the index heads) and lets the query attend to the tokens of its top
`budget / compress_ratio` blocks and of its own incomplete last block. transformers selects in a Python loop over
the queries (`nonzero`: data-dependent shapes, not traceable) and hands the layer cos/sin of every cached position
(the model keeps the positions' history in its cache). While a layer is traced, `installed(layer)` swaps the
attention module's forward for `_forward`: transformers' projections, norms, rotaries and output gate as written on
the step's positions, the indexer's keys through the layer's cache (`update_indexer`: the `.index` cache), and
`select`, the same selection vectorized over cache indices (a prompt without padding: the visible keys are
0..position), each block rotated at its first key's position (in standard ops). `verify` runs transformers'
`_select_tokens` against `select` on random inputs, single-token and several, before a family is traced.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import types

import torch

from fuselm.errors import FuselmError

from . import attention_op, rope_op


def _indexed(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention modules of `layer` whose indexer selects by blocks (`_select_tokens`)."""
    return [m for m in layer.modules() if hasattr(type(getattr(m, "indexer", None)), "_select_tokens")]


def select(indexer, q: torch.Tensor, keys: torch.Tensor, rotate, mask: torch.Tensor) -> torch.Tensor:
    """transformers' `_select_tokens` over cache indices: q [B,S,H,D] (normed, rotated), keys [B,T,D] (the indexer's
    raw keys), `rotate(blocks [B,n,D], starts [n]) -> [B,n,D]`, mask [B,1,S,T] (additive or boolean) -> the selected
    keys, boolean [B,1,S,T]."""
    b, s, _, d = q.shape
    t, c = keys.shape[1], indexer.compress_ratio
    n = t // c
    blocks = keys[:, :n * c].reshape(b, n, c, d).float().mean(dim=2).to(keys.dtype)
    starts = torch.arange(n) * c
    blocks = rotate(indexer.k_layernorm(blocks), starts)
    scores = torch.relu(q.float() @ blocks.float().transpose(1, 2)[:, None]).sum(dim=2) / math.sqrt(d)  # [B,S,n]
    visible = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0  # [B,S,T]
    seen = visible.sum(dim=-1, keepdim=True)  # the keys each query sees: 0..its position
    complete = (torch.arange(n) + 1) * c <= seen  # [B,S,n]
    scores = scores.masked_fill(~complete, float("-inf"))
    top = scores.topk(min(indexer.block_topk, n), dim=-1).indices
    chosen = torch.zeros_like(complete).scatter(-1, top, True) & complete
    chosen = torch.cat((chosen, chosen.new_zeros(b, s, 1)), dim=-1)  # a column for keys past the blocks
    block = (torch.arange(t) // c).clamp(max=n)
    in_chosen = chosen.gather(-1, block.expand(b, s, t))
    tail = torch.arange(t) >= seen // c * c  # the query's own incomplete block
    return ((in_chosen | tail) & visible)[:, None]


def _forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
    """The attention's forward as transformers writes it, on the step's positions, its indexer through `select`."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    modeling = rope_op.ACTIVE.module
    ix = self.indexer
    if ix.index_kv_heads != 1:
        raise FuselmError(f"{type(ix).__name__} with {ix.index_kv_heads} key heads: transformers' indexer pools one; "
                          "not supported by the traced exporter")
    cos, sin = position_embeddings
    b, s, _ = hidden_states.shape
    q, keys = torch.split(ix.index_qk_proj(hidden_states), [ix.index_n_heads * ix.index_head_dim, ix.index_head_dim], -1)
    q = modeling.apply_rotary_pos_emb(ix.q_layernorm(q.reshape(b, s, -1, ix.index_head_dim)), cos=cos, sin=sin,
                                      unsqueeze_dim=2)
    if cache is not None:
        keys = cache.update_indexer(keys, ix.layer_idx)

    def rotate(blocks, starts):
        return rope_op.ACTIVE.rotate_at(blocks[:, :, None], starts[None].expand(b, -1))[:, :, 0]

    selected = select(ix, q, keys, rotate, attention_mask)
    attention_mask = attention_op.CONTEXT.derived = attention_mask.masked_fill(~selected, torch.finfo(
        attention_mask.dtype).min)
    shape = (b, s, -1, self.head_dim)
    query, gate = torch.chunk(self.q_proj(hidden_states).view(b, s, -1, self.head_dim * 2), 2, dim=-1)
    query = self.q_norm(query.reshape(shape)).transpose(1, 2)
    key = self.k_norm(self.k_proj(hidden_states).view(shape)).transpose(1, 2)
    value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
    query, key = modeling.apply_rotary_pos_emb(query, key, cos, sin)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, modeling.eager_attention_forward)
    out, weights = attention(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
    out = out.reshape(b, s, -1) * torch.sigmoid(gate.reshape(b, s, -1))
    return self.o_proj(out), weights


@contextlib.contextmanager
def installed(layer: torch.nn.Module):
    """While active, the block-indexed attention modules of `layer` run `_forward`."""
    modules = _indexed(layer)
    for m in modules:
        m.forward = types.MethodType(_forward, m)
    try:
        yield
    finally:
        for m in modules:
            del m.forward


def verify(model: torch.nn.Module, config, model_type: str) -> None:
    """transformers' `_select_tokens` of the model's first block indexer against `select`, on random queries and keys
    (several tokens of a prompt, then one), with blocks rotated by the model's own cos/sin; refuses the family if they
    select other keys."""
    found = next((m.indexer for m in _indexed(model)), None)
    if found is None:
        return
    gen = torch.Generator().manual_seed(0)
    with torch.device("cpu"):
        ix = type(found)(config, found.layer_idx).float()
    with torch.no_grad():
        for p in ix.parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))  # (norm weights; the projections are not run)
        for t, s in ((11, 11), (12, 1)):
            d, h = ix.index_head_dim, ix.index_n_heads
            q, keys = torch.randn(2, s, h, d, generator=gen), torch.randn(2, t, d, generator=gen)
            angles = torch.arange(t)[None, :, None].float() * torch.rand(d // 2, generator=gen)
            cos, sin = (torch.cat((f(angles), f(angles)), -1).expand(2, -1, -1) for f in (torch.cos, torch.sin))
            mask = torch.where(torch.arange(t)[None] <= torch.arange(t - s, t)[:, None], 0.0, float("-inf"))
            mask = mask[None, None].expand(2, 1, -1, -1)
            want = ix._select_tokens(torch.zeros(2, s, 1), q, keys, cos, sin, mask)
            apply = importlib.import_module(type(found).__module__).apply_rotary_pos_emb

            def rotate(blocks, starts, cos=cos, sin=sin, apply=apply):
                return apply(blocks[:, :, None], cos=cos[:, starts], sin=sin[:, starts], unsqueeze_dim=2)[:, :, 0]

            if not torch.equal(select(ix, q, keys, rotate, mask), want):
                raise FuselmError(f"model_type {model_type!r}: its {type(found).__name__} selects other keys than "
                                  "fuselm's vectorized block selection (checked on random inputs); not supported by the "
                                  "traced exporter")

