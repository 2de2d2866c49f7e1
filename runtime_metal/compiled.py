"""Compiled static-shape decode: the per-token plan as one compiled function, or in compiled pieces.

Static-shape decode runs the same plan every token (kvcache.py), so it can be captured once. The
step takes the token and its position; the attention mask and position_ids are computed from the
position on the device, so no host array crosses over per token. A model's recurrent states
(state.py) go in as inputs and their presents come out, fixed shapes like the rest. The backend
compiles it (`Backend.compile_step`): MLX mx.compile (KV buffers in and out), torch make_fx + inductor
and a CUDA graph on CUDA (runtime_metal/backends/torch_compile.py; KV buffers written in place).

Where attention reads only the filled rows of the cache (`Backend.causal_reads`, MLX), its shapes
grow every token, so `PiecewiseDecode` runs each Attention eagerly and compiles the runs of steps
between two of them (fixed shapes): mx.compile fuses their elementwise tails (the SiLU gate, residual
adds, casts) and the host calls one function per layer instead of its ops.

The first compiled step is checked against the eager step (same inputs) before it is used.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from operator import itemgetter

import numpy as np

from fuselm import contract

from .executor import Step
from .kvcache import CacheView
from .ops_nn import first_row

N_INPUTS = 2  # token ids [1, 1] and the position (a 0-d integer); the recurrent states, then the KV buffers follow


def static_feeds(b, ids, pos, max_len: int, first: str = contract.INPUT_IDS, rows: int = 1) -> dict:
    """The graph's small inputs for one static step of `rows` tokens at 0-d device position `pos`; `ids` goes to
    `first` (a pipeline stage's hidden state: contract.HIDDEN)."""
    index = b.reshape(b.arange(0, max_len, 1, 7), (1, max_len))
    last = b.cast(pos, 7) if rows == 1 else b.binary("add", b.cast(pos, 7), b.full((), rows - 1, 7))
    mask = b.cast(b.binary("less_equal", index, last), 7)
    return {first: ids, contract.ATTENTION_MASK: mask, contract.POSITION_IDS: positions(b, pos, rows)}


def positions(b, pos, rows: int):
    """position_ids [1, rows] from the 0-d device position `pos`."""
    at = b.cast(pos, 7)
    return b.reshape(at if rows == 1 else b.binary("add", at, b.arange(0, rows, 1, 7)), (1, rows))


class CompiledDecode:
    """The static decode plan of `sess` for one cache length as one compiled step."""

    any_length = False  # its mask and cache views span the buffers: one step per cache length

    def __init__(self, sess, plan, max_len: int):
        self.sess, self.plan, self.max_len = sess, plan, max_len
        self.names = [c.name for c in sess.caches]
        self.states = sess.state.specs
        self.seconds, self.fn, self.what = 0.0, None, ""

    def _step(self, ids, pos, *arrays):
        sess, k = self.sess, len(self.states)
        views = {c.name: CacheView(buf, pos, 1, static=True, head_dim=c.head_dim)
                 for c, buf in zip(sess.caches, arrays[k:], strict=True)}
        sess.executor.ctx.update(rope_offset=pos, logit_rows=1)
        feeds = {**static_feeds(sess.backend, ids, pos, self.max_len, sess.first_input), **views,
                 **{st.name: a for st, a in zip(self.states, arrays[:k], strict=True)}}
        out = sess.executor._execute(self.plan, feeds)
        # the next position, on the device: no host array crosses over per token
        nxt = sess.backend.binary("add", pos, sess.backend.full((), 1, sess.backend.dtype(pos)))
        return (out[sess.output], nxt, *[out[st.present] for st in self.states], *[views[n].buffer for n in self.names])

    def build(self, args: tuple) -> None:
        """`args`: (ids, position, *states, *buffers), as a step takes them."""
        t0 = time.perf_counter()
        self.fn, self.what = self.sess.backend.compile_step(self._step, args, N_INPUTS + len(self.states))
        self.seconds = time.perf_counter() - t0

    def __call__(self, ids, pos, bufs: list, states: list):
        """One decode step; returns (logits, the next position as a device array, new buffers, present states)."""
        k = len(self.states)
        out = self.fn(ids, pos, *states, *bufs)
        return out[0], out[1], list(out[2 + k:]), list(out[2:2 + k])


@dataclass
class Piece:
    steps: list
    inputs: list[str]  # values read from outside the piece
    outputs: list[str]  # values read after it
    fn: object = None  # the compiled run of `steps`; None: one step run eagerly (an Attention)
    fast: object = None  # that Attention as direct backend calls (`_decode_attention`), where it applies
    heads_out: dict = field(default_factory=dict)  # output -> its heads: handed on as [B, H, S, D] (0: transposed)
    heads_in: set = field(default_factory=set)  # inputs that arrive as [B, H, S, D], merged to [B, S, H·D]


class PiecewiseDecode:
    """The static decode plan of `sess` with eager attentions over the filled rows and compiled pieces between.

    The host builds one step as 29 compiled calls and, per Attention of a packed float cache, the four backend
    calls `_decode_attention` makes (the ops the executor's Attention runs for one query at a host position,
    without walking the op: the cache write, the K and V rows, sdpa); the pieces around it hand it Q and the
    new K/V rows with their heads first and take its output that way, so those views are built inside the
    compiled calls. Any other Attention runs through the executor."""

    def __init__(self, sess, plan, max_len: int, rows: int = 1):
        self.sess, self.max_len, self.rows = sess, max_len, rows  # rows: tokens per step (a verification's k + 1)
        self.names = [c.name for c in sess.caches]
        self.states = sess.state.specs  # (their pasts are read and their presents made by the pieces like any value)
        self.pieces = _pieces(plan)
        read = {x for p in self.pieces for x in p.inputs}
        self.mask = contract.ATTENTION_MASK in read  # causal reads hand no piece the mask: not built per token
        stored = any(f.bits is not None for f in sess.kv_formats)  # the cache in its own format: the executor's
        for i, p in enumerate(self.pieces):
            if p.steps[0].node.op_type == "Attention" and not stored and 0 < i < len(self.pieces) - 1:
                p.fast = _decode_attention(sess, p.steps[0], self.pieces[i - 1], self.pieces[i + 1],
                                           {x for o in self.pieces if o is not p for x in o.inputs},
                                           {x for o in self.pieces if o is not p and o is not self.pieces[i + 1]
                                            for x in o.inputs}, rows)
        self.seconds = 0.0
        n = sum(p.steps[0].node.op_type != "Attention" for p in self.pieces)
        direct = sum(p.fast is not None for p in self.pieces)
        # every Attention direct: the cache buffers go into the step as they are, no CacheView per cache and token
        self.direct = direct == len(self.pieces) - n
        # shapes that do not depend on the cache length (its buffers go in as they are; no mask over them): the
        # compiled pieces serve every cache length (Decoding keeps them under None)
        self.any_length = self.direct and not self.mask
        self.what = f"mx.compile of the {n} pieces between the attentions, attention over the filled rows" + \
            (f", {direct} of them as direct backend calls" if direct else "")

    def build(self, args: tuple) -> None:
        t0 = time.perf_counter()
        for p in self.pieces:
            if p.steps[0].node.op_type != "Attention":
                p.fn, _ = self.sess.backend.compile_step(self._piece(p), args, 1)
        # what each call reads, as one C-level lookup (the host builds this loop every token)
        self.calls = [(p.fn, p.fast, p, itemgetter(*p.inputs) if len(p.inputs) > 1 else
                       (lambda env, n=p.inputs[0]: (env[n],)) if p.inputs else (lambda env: ()))
                      for p in self.pieces]
        self.seconds = time.perf_counter() - t0

    def _piece(self, piece: Piece):
        ex, b = self.sess.executor, self.sess.backend

        def run(pos, *values):
            env = dict(zip(piece.inputs, values, strict=True))
            for n in piece.heads_in:
                env[n] = _merged(b, env[n])
            ex.ctx["rope_offset"] = pos
            ex.run_steps(piece.steps, env)
            return tuple(_split(b, env[n], piece.heads_out[n]) if n in piece.heads_out else env[n]
                         for n in piece.outputs)

        return run

    def __call__(self, ids, pos_dev, bufs: list, states: list):
        """One decode step at the session's position; returns (logits, None, the buffers written in place, the
        present states)."""
        sess, b = self.sess, self.sess.backend
        ex, pos = sess.executor, sess.pos
        views = dict(zip(self.names, bufs, strict=True)) if self.direct else \
            {c.name: sess._view(c, pos, 1, static=True) for c in sess.caches}
        views.update((st.name, a) for st, a in zip(self.states, states, strict=True))
        if self.mask:
            env = {**static_feeds(b, ids, pos_dev, self.max_len, sess.first_input, self.rows), **views}
        else:
            env = {sess.first_input: ids, contract.POSITION_IDS: positions(b, pos_dev, self.rows), **views}
        ex.ctx["logit_rows"] = self.rows
        b.new_step()
        for fn, fast, p, inputs in self.calls:
            if fn is not None:
                env.update(zip(p.outputs, fn(pos_dev, *inputs(env)), strict=True))
            elif fast is not None:
                fast(env, pos, pos_dev)
            else:
                ex.ctx["rope_offset"] = pos_dev
                ex.run_steps(p.steps, env)
        return env[sess.output], None, [env[n] if self.direct else views[n].buffer for n in self.names], \
            [env[st.present] for st in self.states]


def _decode_attention(sess, st: Step, before: Piece, after: Piece, others: set, beyond: set, rows: int = 1):
    """One decode query's Attention (ops_nn._attention on its filled-rows path, packed K/V: kvcache.append_both)
    as a closure over what is fixed per layer, with `before` handing it Q and the K/V rows heads first and
    `after` taking its output so; None where that path may not be the one taken, or where another piece
    reads those values (`others`: what the other pieces read, `beyond`: what those besides `after` read). A
    cache not stored in the new rows' dtype (a graph's float16 cache under float32 activations) runs through
    the executor, its inputs and output put back."""
    node, b, ex = st.node, sess.backend, sess.executor
    ins, a = list(node.inputs) + [""] * (8 - len(node.inputs)), node.attrs
    qn, kn, vn, kvn, yn = ins[0], ins[4], ins[5], ins[7], node.outputs[0]
    # several rows under a window or chunk: the band over the rows read is not one causal triangle (the executor's)
    if node.domain or a.get("causal_rows") is None or not kvn or ins[6] or sess.packed.get(vn) != kn or \
            (rows > 1 and (a.get("causal_rows") or a.get("causal_chunk"))) or \
            a.get("softcap") or a.get("softmax_precision") is not None or len(node.outputs) > 3 or \
            any(o in others for o in (qn, kvn, *node.outputs[1:])) or yn in beyond or not a.get("q_num_heads") or \
            not a.get("kv_num_heads") or "Attention" in (before.steps[0].node.op_type, after.steps[0].node.op_type) \
            or qn not in before.outputs or kvn not in before.outputs or yn not in after.inputs:
        return None
    hq, hk, window = int(a["q_num_heads"]), int(a["kv_num_heads"]), a["causal_rows"]
    k3, v3 = ins[1], ins[2]  # the 3-D K and V: read only where the executor runs the op (rebuilt from kv there)
    made = [j for j, s in enumerate(before.steps) if s.node.op_type == "QKVHeads" and s.node.outputs == [qn, k3, v3, kvn]]
    if made and not any(o in others or o in sess.graph.outputs for o in (k3, v3)):
        # QKVHeads hands them over heads first (rewrites/qkv_heads.py): no merge in it and no split after it
        qkv = before.steps[made[0]]
        before.steps[made[0]] = replace(qkv, node=replace(qkv.node, attrs={**qkv.node.attrs, "heads_first": 1}))
    else:
        before.heads_out.update({qn: hq, kvn: 0})
    before.outputs = [o for o in before.outputs if o not in (k3, v3) or o in others or o in sess.graph.outputs]
    after.heads_in.add(yn)
    d = next(c.head_dim for c in sess.caches if c.name == kn)  # q's head size is k's
    scale = float(1.0 / np.sqrt(d)) if a.get("scale") is None else float(a["scale"])

    def run(env, pos: int, pos_dev) -> None:
        q, kv, held = env[qn], env[kvn], env[kn]  # [B, Hq, S, D], [B, 2Hk, S, D], the buffer (or its CacheView)
        view = held if isinstance(held, CacheView) else None
        buf = held if view is None else view.buffer
        if isinstance(buf, tuple) or b.dtype(buf) != b.dtype(kv):
            env[qn], env[kvn] = _merged(b, q), b.transpose(kv, (0, 2, 1, 3))
            env[k3], env[v3] = (_merged(b, b.slice(kv, (slice(None), slice(h0, h0 + hk)))) for h0 in (0, hk))
            views = (view, env[vn]) if view is not None else \
                tuple(CacheView(buf, pos, 1, True, (h0, h0 + hk)) for h0 in (0, hk))
            env[kn], env[vn] = views
            ex.ctx["rope_offset"] = pos_dev
            ex.run_steps([st], env)  # (which drops the views from env after their last reader)
            env[yn] = _split(b, env[yn], hq)
            env[kn], env[vn] = views if view is not None else (views[0].buffer, views[0].buffer)
            return
        s = b.shape(q)[2]
        t1 = pos + s
        t0 = first_row(t1, window, a.get("causal_chunk"))
        buf = b.cache_write(buf, kv, pos)
        if view is None:
            env[kn] = env[vn] = buf
        else:
            view.buffer = env[vn].buffer = buf
        k = b.slice(buf, (slice(None), slice(0, hk), slice(t0, t1)))
        v = b.slice(buf, (slice(None), slice(hk, 2 * hk), slice(t0, t1)))
        env[yn] = b.sdpa(q, k, v, "causal" if s > 1 else None, scale)  # several queries: a verification step

    return run


def _split(b, x, heads: int):
    """[B, S, H·D] -> [B, H, S, D] (heads 0: [B, S, H, D] -> [B, H, S, D]); one reshape for one token (S = 1: the
    same element order), one view fewer in every compiled piece's graph."""
    shape = b.shape(x)
    if shape[1] == 1:
        h = heads or shape[2]
        return b.reshape(x, (shape[0], h, 1, shape[-1] // heads if heads else shape[3]))
    if heads:
        x = b.reshape(x, (shape[0], shape[1], heads, shape[2] // heads))
    return b.transpose(x, (0, 2, 1, 3))


def _merged(b, y):
    """[B, H, S, D] -> [B, S, H·D] (for one token, S = 1, a reshape alone)."""
    bsz, h, s, d = b.shape(y)
    return b.reshape(y if s == 1 else b.transpose(y, (0, 2, 1, 3)), (bsz, s, h * d))


def _pieces(plan) -> list[Piece]:
    """The plan's steps cut at each Attention: the runs between them, and each Attention alone. A causal
    read (`causal_rows`) never reads the mask, so a piece does not hand it on, and the steps that only made it
    (an exporter's Cast of attention_mask) are dropped: no piece then reads a [1, cache length] array."""
    steps, unread = [], set()
    for st in plan.steps:
        if st.node.op_type == "Attention" and "causal_rows" in st.node.attrs and len(st.args) > 3:
            unread.update(x for i, x, _ in st.slots if i == 3)
            st = Step(st.node, st.spec, [None if i == 3 else a for i, a in enumerate(st.args)],
                      [sl for sl in st.slots if sl[0] != 3], st.free)
        steps.append(st)
    steps = _without_unread(steps, unread, {n for n, _ in plan.outputs})
    groups: list[list] = []
    for st in steps:
        alone = st.node.op_type == "Attention"
        if alone or not groups or groups[-1][0].node.op_type == "Attention":
            groups.append([st])
        else:
            groups[-1].append(st)
    wanted = [{n for n, c in plan.outputs if c is None}]  # read after group i (built backwards)
    for g in reversed(groups[1:]):
        after = set(wanted[0])
        for st in g:
            after.update(x for _, x, _ in st.slots)
        wanted.insert(0, after)
    pieces = []
    for g, after in zip(groups, wanted, strict=True):
        made = {o for st in g for o in st.node.outputs if o}
        inputs = list(dict.fromkeys(x for st in g for _, x, _ in st.slots if x not in made))
        pieces.append(Piece(g, inputs, [o for st in g for o in st.node.outputs if o and o in after]))
    return pieces


def _without_unread(steps: list, names: set, outputs: set) -> list:
    """`steps` without those whose every output is unread, starting from the values `names` (no longer read) and
    walking back through what those steps read."""
    while names:
        read = {x for st in steps for _, x, _ in st.slots} | outputs
        dead = {id(st) for st in steps if any(o in names for o in st.node.outputs)
                and not any(o and o in read for o in st.node.outputs)}
        names = {x for st in steps if id(st) in dead for _, x, _ in st.slots}
        steps = [st for st in steps if id(st) not in dead]
    return steps


def agrees(backend, a, b, tol: float = 1e-3) -> bool:
    """Same logits up to `tol` of their largest magnitude (at least 1), and the same argmax."""
    x = np.asarray(backend.to_numpy(a), np.float64).reshape(-1)
    y = np.asarray(backend.to_numpy(b), np.float64).reshape(-1)
    close = np.allclose(x, y, atol=tol * max(1.0, float(np.abs(x).max())), rtol=0)
    return bool(close and np.argmax(x) == np.argmax(y))


__all__ = ["CompiledDecode", "PiecewiseDecode", "agrees", "positions", "static_feeds", "N_INPUTS"]
