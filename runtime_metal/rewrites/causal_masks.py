"""CausalMasks: which Attention masks are causal reads of the cache, decided once, at load, on the host.

A graph computes its attention mask from the contract's small inputs (exporter/graph.py: causal by
cache index, padding from attention_mask, an optional sliding window). When the session feeds them
plainly (attention_mask all ones, consecutive positions), such a mask says "query i sees the keys up
to its own index, and at most the last `window` of them". A backend whose fused attention takes no
array mask on every device (MLX: sdpa_vector on CUDA) then reads only the filled rows of the cache:
no mask at decode (the last `window` rows for a sliding window), mask="causal" at prefill.

It evaluates each mask's subgraph (the nodes it depends on) on the host with numpy for probe
shapes and compares it with that band. The Attention node gets the runtime attribute
`causal_rows` = the window (0: none) when every probe matches. A chunked mask (Llama 4's chunked local
attention: query i sees the keys of its own block of `chunk` indices up to itself), checked against the chunk
size fuselm.json names, gets `causal_rows` = 0 and `causal_chunk` = the chunk size: the rows read start at
the block's first index. It must not fire (the op keeps the
graph's array mask) when the subgraph reads anything but input_ids / attention_mask / position_ids
(a cache, a weight-dependent value), fails on the host, holds values other than allowed (True / 0)
and masked (False / below -1e4), or any probe differs from a causal band; nor for Attention nodes
with window attributes of their own or soft-capping.
"""

from __future__ import annotations

import numpy as np
from fuselm.passes.stats import Stats

from fuselm import contract

from ..backends.numpy_backend import NumpyBackend
from ..executor import Executor
from ..graph import Graph, Node, reads
from .base import Load, Rewrite

SMALL = contract.STEP_INPUTS
MASKED_BELOW = -1e4  # an additive mask entry at or below this adds nothing after the softmax
PROBES = ((1, 1), (1, 2), (2, 2), (3, 7), (1, 9), (5, 40), (1, 300), (3, 1500), (1, 4100), (1, 9000))


class CausalMasks(Rewrite):
    """The module docstring's classification: `causal_rows` (and `causal_chunk`) on each Attention whose mask is a
    causal band (or a chunked one) under plain feeds (fuselm.json's sliding window and chunk size probed too)."""

    aliases = ("causal-masks", "mask-kind")

    def apply(self, graph: Graph, load: Load, stats: Stats) -> bool:
        meta = load.meta or {}
        window_hint, chunk_hint = meta.get("sliding_window"), (meta.get("attention") or {}).get("chunk_size")
        producers = {o: n for n in graph.nodes for o in n.outputs}
        probes = list(PROBES)
        for hint in (window_hint, chunk_hint):
            if hint:
                probes += [(1, hint), (1, hint + 1), (1, hint + 2), (2, hint + 3)]
        seen: dict[str, tuple | None] = {}
        for n in graph.nodes:
            if n.key != ("", "Attention"):
                continue
            if n.attrs.get("softcap", 0.0) or n.attrs.get("left_window_size", -1) >= 0 or \
                    n.attrs.get("right_window_size", -1) >= 0:
                stats.skip(n.name, "soft-capping or window attributes of its own")
                continue
            mask = n.inputs[3] if len(n.inputs) > 3 else ""
            if not mask:
                band = (0, None) if n.attrs.get("is_causal", 0) else None
            else:
                if mask not in seen:
                    seen[mask] = _band(graph, producers, mask, probes, chunk_hint)
                band = seen[mask]
            if band is None:
                stats.skip(n.name, "its mask is not a causal band under plain feeds")
                continue
            n.attrs["causal_rows"] = band[0]
            if band[1]:
                n.attrs["causal_chunk"] = band[1]
            stats.fire(n.name)
        return bool(stats.fired)


def causal_reads(backend, graph: Graph, in_place: bool, fused: bool) -> bool:
    """The session reads only the filled rows of its cache: a backend that wants it (`causal_reads`), fused
    kernels, a cache in place, every Attention's mask a causal band (`causal_rows`), no KVAppend."""
    attention = [n for n in graph.nodes if n.key == ("", "Attention")]
    return bool(backend.causal_reads and fused and in_place and attention and all("causal_rows" in n.attrs for n in attention)
                and not any(n.op_type == "KVAppend" for n in graph.nodes))


def _cone(graph: Graph, producers: dict, name: str) -> list[Node] | None:
    """The nodes `name` depends on, in graph order; None when it reads other graph inputs than SMALL."""
    need, stack = set(), [name]
    while stack:
        x = stack.pop()
        if not x or x in graph.constants or x in need:
            continue
        if x in graph.inputs:
            if x not in SMALL:
                return None
            continue
        p = producers.get(x)
        if p is None or p.branches or p.domain:
            return None
        need.add(x)
        stack.extend(reads(p))
    return [n for n in graph.nodes if any(o in need for o in n.outputs)]


def _band(graph: Graph, producers: dict, mask: str, probes, chunk: int | None = None) -> tuple | None:
    """(window, None) of the causal band `mask` is under plain feeds (window 0: none), (0, chunk) of a chunked band
    of `chunk`, or None."""
    cone = _cone(graph, producers, mask)
    if cone is None:
        return None
    sub = Executor(Graph(cone, graph.constants, list(SMALL), [mask], graph.opsets, graph.elem_types),
                   NumpyBackend())
    values = {}
    for s, t in probes:
        feeds = {contract.INPUT_IDS: np.zeros((1, s), np.int64), contract.ATTENTION_MASK: np.ones((1, t), np.int64),
                 contract.POSITION_IDS: np.arange(t - s, t, dtype=np.int64).reshape(1, s)}
        try:
            values[(s, t)] = _allowed(np.asarray(sub.run(feeds)[mask]), s, t)
        except Exception:  # noqa: BLE001 - a subgraph the host cannot run keeps its array mask
            return None
        if values[(s, t)] is None:
            return None
    window = _window(values)
    if window is not None:
        return window, None
    if chunk and all(np.array_equal(a, _chunked(s, t, chunk)) for (s, t), a in values.items()):
        return 0, chunk
    return None


def _chunked(s: int, t: int, chunk: int) -> np.ndarray:
    q = np.arange(t - s, t)[:, None]
    k = np.arange(t)[None, :]
    return (k <= q) & (k // chunk == q // chunk)


def _window(values: dict) -> int | None:
    """The window of the causal band every probe's allowed [S, T] is (0: no window), or None."""
    window = 0
    for (s, t), allowed in sorted(values.items(), key=lambda p: p[0][1]):
        q = np.arange(t - s, t)[:, None]
        k = np.arange(t)[None, :]
        if not window and allowed[-1].sum() < t:  # the last query sees fewer keys than exist: a window
            window = int(allowed[-1].sum())
        band = (k <= q) & ((k > q - window) if window else True)
        if not np.array_equal(allowed, band):
            return None
    return window


def _allowed(value: np.ndarray, s: int, t: int) -> np.ndarray | None:
    """The mask as a bool [S, T] (True: the key is attended), or None when it is not a plain 0/-inf mask."""
    if value.ndim < 2 or value.shape[-2:] not in ((s, t), (1, t)) or any(d != 1 for d in value.shape[:-2]):
        return None
    v = value.reshape(value.shape[-2:])
    v = np.broadcast_to(v, (s, t))
    if v.dtype == np.bool_:
        return v
    if v.dtype.kind != "f":
        return None
    keep, drop = v == 0, v <= MASKED_BELOW
    if not np.all(keep | drop):
        return None
    return keep
