"""QKVHeads: a layer's q/k norms and RoPE as one rms_norm and one elementwise expression over every head of the
fused QKV output (backends that read the cache causally: MLX).

Pattern (passes/ FuseQKV + FuseRMSNorm + FuseRoPE + AttentionTo3D):
    Split(qkv, [Hq·D, Hkv·D, Hkv·D], axis -1) -> q, k, v
    q -> Reshape [0, 0, Hq, D] -> RMSNormalization(wq) -> FusedRoPE(position_ids) -> Reshape -> Attention.Q
    k -> Reshape [0, 0, Hkv, D] -> RMSNormalization(wk) -> FusedRoPE(position_ids) -> Reshape -> Attention.K
    v -> Attention.V
(the norms of Qwen3 / Gemma; llama, qwen2 and mistral have none: then neither q nor k has one), or as
passes/ FuseRoPENorm + RoPETo3D leave it:
    q -> FusedRoPE(position_ids[, wq], num_heads=Hq) -> Attention.Q     (k alike; the norm is FusedRoPE's input 2)
becomes
    RoPETable(position_ids) -> cos, sin                  (once per rotary table, shared by every layer)
    QKVHeads(qkv, cos, sin, [wq; wk; 1]) -> Q, K, V, KV  (KV: the k and v heads side by side, [B, S, 2Hkv, D])
QKVHeads normalizes every head with one rms_norm (none without q/k norms), then multiplies by the per-head weight, rotates and
puts the raw v heads back in one elementwise expression, which mx.compile fuses into one kernel (the
pieces between attentions, compiled.py): 2 kernels instead of 2 norms and 2 ropes, and the k and v
rows come out as one array, which Attention writes into the cache with one update (kvcache.py).

Must not fire: any intermediate read elsewhere or a graph output, rotary attributes that differ
between q and k, interleaved or partial rotary, RMSNormalization over another axis or with a weight
that is not a constant [D], a Split whose sizes are not those of the heads.
"""

from __future__ import annotations

import numpy as np
from fuselm.passes.stats import Stats

from fuselm import contract

from ..graph import Graph, Node
from ..ops_nn import RUNTIME
from .base import Load, Rewrite


class QKVHeads(Rewrite):
    """The module docstring's pattern, on a backend that offers `qkv_heads` and `rope_table` and reads the cache
    causally (`Backend.causal_reads`: the compiled pieces take the heads first), with fused kernels; elsewhere it
    does not fire (said once)."""

    aliases = ("qkv-heads",)

    def apply(self, graph: Graph, load: Load, stats: Stats) -> bool:
        b = load.backend
        if not (b.offers("qkv_heads") and b.offers("rope_table") and b.causal_reads and load.fused):
            stats.skip("graph", f"the {b.name} backend has no qkv_heads primitive or does not read the cache "
                                "causally (or fused kernels are off): the q/k norms and ropes stay per head")
            return False
        producers = {o: n for n in graph.nodes for o in n.outputs}
        readers: dict[str, int] = {}
        for n in graph.nodes:
            for x in n.inputs:
                readers[x] = readers.get(x, 0) + 1
        drop: set[int] = set()
        tables: dict[tuple, tuple[str, str]] = {}
        new: dict[int, list[Node]] = {}  # node id -> nodes to insert before it
        for att in graph.nodes:
            if att.key != ("", "Attention") or len(att.inputs) < 3:
                continue
            m = _match(graph, producers, readers, att)
            if isinstance(m, str):
                stats.skip(att.name, m)
                continue
            split, chains, rope_attrs, weight, eps, heads, kv_heads = m
            positions = _rope(chains[0]).inputs[1]
            key = (np.asarray(rope_attrs["inv_freq"]).tobytes(), float(rope_attrs.get("attention_scaling", 1.0)), positions)
            if key not in tables:
                t = f"{att.name}/rope_table"
                tables[key] = (t + "/cos", t + "/sin")
                new.setdefault(id(split), []).append(
                    Node("RoPETable", RUNTIME, t, [positions], list(tables[key]),
                         {"inv_freq": np.asarray(rope_attrs["inv_freq"], np.float32), "attention_scaling": key[1]}))
            cos, sin = tables[key]
            w = att.name + "/qk_norm_weight"
            h, d = weight.shape
            graph.constants[w] = weight.reshape(h, 2, d // 2)
            graph.constants[w + "/rotated"] = weight.reshape(h, 2, d // 2)[:, ::-1] * np.array([[-1.0], [1.0]], np.float32)
            kv = att.name + "/kv_rows"
            node = Node("QKVHeads", RUNTIME, att.name + "/QKVHeads", [split.inputs[0], cos, sin, w, w + "/rotated"],
                        [att.inputs[0], att.inputs[1], att.inputs[2], kv],
                        {"heads": heads, "kv_heads": kv_heads, "epsilon": eps})
            new.setdefault(id(split), []).append(node)
            drop.update(id(n) for c in chains for n in c)
            drop.add(id(split))
            att.inputs = list(att.inputs) + [""] * (7 - len(att.inputs)) + [kv]  # the k and v rows as one array
            stats.fire(att.name)
        nodes = []
        for n in graph.nodes:
            nodes += new.get(id(n), [])
            if id(n) not in drop:
                nodes.append(n)
        graph.nodes = nodes
        return bool(stats.fired)


def _match(graph: Graph, producers: dict, readers: dict, att: Node):
    """(split, [q chain, k chain], rope attrs, stacked weight [H, D], eps, Hq, Hkv), or why not."""
    chains = []
    split = None
    for i in (0, 1):
        chain = [producers.get(att.inputs[i])]  # merge Reshape <- FusedRoPE [<- RMSNorm] <- Reshape, or FusedRoPE
        while chain[-1] is not None and chain[-1].op_type != "Split" and len(chain) < 5:
            chain.append(producers.get(chain[-1].inputs[0]))
        chain.pop()
        if None in chain or [n.op_type for n in chain] not in _CHAINS or (chains and len(chain) != len(chains[0])):
            return "q/k are not Split -> [Reshape, RMSNormalization,] FusedRoPE [-> Reshape] chains of one form"
        # a lone FusedRoPE takes [B,S,H·D]; between Reshapes it takes [B,S,H,D]; and one norm at most
        if len(chain) == 1 and not chain[0].attrs.get("num_heads", 0) or \
                len(chain) > 1 and chain[1].attrs.get("num_heads", 0) or len(chain) == 4 and len(chain[1].inputs) > 2:
            return "a FusedRoPE in another layout than its chain's, or two norms"
        sp = producers.get(chain[-1].inputs[0])
        if sp is None or sp.key != ("", "Split") or (split is not None and sp is not split) or \
                sp.outputs.index(chain[-1].inputs[0]) != i or readers.get(chain[-1].inputs[0], 0) != 1:
            return "q and k do not come from one Split of the fused QKV output, read once"
        split = sp
        if any(readers.get(o, 0) != 1 or o in graph.outputs for n in chain for o in n.outputs):
            return "an intermediate of the q/k chain is read elsewhere or is a graph output"
        chains.append(chain[::-1])  # Reshape, [RMSNorm,] FusedRoPE, merge Reshape
    if len(split.outputs) != 3 or split.outputs[2] != att.inputs[2] or readers.get(att.inputs[2], 0) != 1 or \
            split.attrs.get("axis") not in (-1, 2):
        return "v is not the Split's third output read by this Attention only, or the Split is not on the last axis"
    sizes = graph.constants.get(split.inputs[1]) if len(split.inputs) > 1 else None
    ropes = [_rope(c) for c in chains]
    # (node, weight input): the RMSNormalization before the rope, or the rope's own norm weight
    norms = [(c[1], c[1].inputs[1]) for c in chains if len(c) == 4] or \
        [(r, r.inputs[2]) for r in ropes if len(r.inputs) > 2 and r.inputs[2]]
    if len(norms) not in (0, 2):
        return "a norm on q or k but not on both"
    a, b = ({k: v for k, v in r.attrs.items() if k not in ("num_heads", "epsilon")} for r in ropes)
    d = 2 * np.asarray(a.get("inv_freq", [])).size
    weights = [graph.constants.get(w) for _, w in norms] or [np.ones(d, np.float32)] * 2
    if sizes is None or any(w is None or w.shape != (d,) for w in weights):
        return "the Split's sizes or the norm weights are not constants of the heads' shape"
    inv = np.asarray(a.get("inv_freq", []), np.float32)
    if set(a) != set(b) or not np.array_equal(inv, np.asarray(b.get("inv_freq", []), np.float32)) or \
            a.get("attention_scaling", 1.0) != b.get("attention_scaling", 1.0) or a.get("interleaved", 0) or \
            2 * inv.size != d or ropes[0].inputs[1] != ropes[1].inputs[1]:
        return "q and k rotate differently (frequencies, scaling, interleaved or partial rotary, positions)"
    eps = [float(n.attrs.get("epsilon", contract.RMS_EPSILON)) for n, _ in norms] or [0.0, 0.0]
    if eps[0] != eps[1] or any(n.attrs.get("axis", -1) != -1 or n.attrs.get("stash_type", 1) != 1 for n, _ in norms):
        return "the q and k norms differ in epsilon, axis or precision"
    sizes = [int(x) for x in np.asarray(sizes).reshape(-1)]
    if len(sizes) != 3 or sizes[1] != sizes[2] or sizes[0] % d or sizes[1] % d:
        return "the Split's sizes are not whole q, k and v heads"
    heads, kv_heads = sizes[0] // d, sizes[1] // d
    weight = np.concatenate([np.tile(weights[0].astype(np.float32), (heads, 1)),
                             np.tile(weights[1].astype(np.float32), (kv_heads, 1)),
                             np.ones((kv_heads, d), np.float32)])
    return split, chains, a, weight, eps[0] if norms else None, heads, kv_heads


_CHAIN = ["Reshape", contract.ROPE_OP, "RMSNormalization", "Reshape"]  # from the Attention input back to the Split
_CHAINS = (_CHAIN, _CHAIN[:2] + _CHAIN[3:], [contract.ROPE_OP])


def _rope(chain: list[Node]) -> Node:
    """The FusedRoPE of a chain in graph order ([Reshape, [RMSNorm,] FusedRoPE, Reshape] or [FusedRoPE])."""
    return chain[-2] if len(chain) > 1 else chain[0]
