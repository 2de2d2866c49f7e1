"""FuseRoPENorm: a per-head RMSNormalization feeding FusedRoPE -> FusedRoPE with a norm weight (Qwen3's q/k norms)."""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from fuselm import contract

from .base import Pass, Reject, Stats, attach_functions, attr, fail, input_at, producer, rank, static_shape


@dataclass
class _Match:
    rope: ir.Node
    norm: ir.Node
    epsilon: float


def _match(rope: ir.Node) -> _Match:
    """FusedRoPE(RMSNormalization(x [B,S,H,D], w [D], axis -1), positions), the norm read by the rope alone."""
    if attr(rope, "num_heads", 0):
        fail("FusedRoPE takes [B, S, H·D]: a norm before it is over every head at once, not per head")
    x = rope.inputs[0]
    norm = producer(x, "RMSNormalization")
    if norm is None:
        fail("its input is not an RMSNormalization")
    r = rank(norm.inputs[0])
    if attr(norm, "axis", -1) != -1 and (r is None or attr(norm, "axis") != r - 1):
        fail(f"the RMSNormalization is over axis {attr(norm, 'axis')}, not the head dim alone")
    if attr(norm, "stash_type", 1) != 1:
        fail("the RMSNormalization computes in another type than float32 (stash_type)")
    w = norm.inputs[1]
    if w is None or w.const_value is None or w.shape is None or w.shape.rank() != 1:
        fail("the norm weight is not a constant [head_dim]")
    d = static_shape(norm.inputs[0])
    if d and d[-1] is not None and w.shape[0] != d[-1]:
        fail(f"the norm weight has {w.shape[0]} entries for a head dim of {d[-1]}")
    if w.dtype != norm.inputs[0].dtype and norm.inputs[0].dtype is not None:
        fail(f"the norm weight is {w.dtype}, its input {norm.inputs[0].dtype} (FusedRoPE takes one type)")
    if len(x.uses()) != 1 or x.is_graph_output():
        fail("the normalized heads are read by more than the FusedRoPE")
    return _Match(rope, norm, float(attr(norm, "epsilon", contract.RMS_EPSILON)))


class FuseRoPENorm(Pass):
    """FusedRoPE(RMSNormalization(x, w, axis=-1), positions)  ->  FusedRoPE(x, positions, w, epsilon).

    The q/k norms of Qwen3 / Gemma-style attention normalize each head over head_dim just before the
    rotation; FusedRoPE's optional third input (fuselm/contract.py) does both, and its model-local
    function is the same RMSNormalization followed by the rotation. A runtime runs its rms_norm and
    rope kernels back to back (MLX: mx.fast.rms_norm then mx.fast.rope).
    All or none: one function body per model, so the pass fires only when every FusedRoPE of the
    graph takes such a norm (Llama-style graphs, without q/k norms, are left as they are).
    Must not fire (and says why): a FusedRoPE already taking [B, S, H·D] or a norm weight; a norm
    over another axis or computed in another type (stash_type); a weight that is not a constant
    [head_dim] of the input's type; the normalized heads read by anything else; and then, for every
    FusedRoPE, any one of them failing.
    """

    aliases = ("fuse-rope-norm", "rope-norm", "qk-norm")

    def apply(self, model: ir.Model, stats: Stats) -> bool:
        ropes = [n for n in model.graph if n.domain == contract.DOMAIN and n.op_type == contract.ROPE_OP]
        if not ropes:
            return False
        matches, failed = [], []
        for rope in ropes:
            if input_at(rope, 2) is not None:
                failed.append((rope, "it takes a norm weight already"))
                continue
            try:
                matches.append(_match(rope))
            except Reject as r:
                failed.append((rope, str(r)))
        if failed:
            first = failed[0]
            for rope, reason in failed:
                stats.skip(rope.name or rope.op_type, reason)
            for m in matches:
                stats.skip(m.rope.name or m.rope.op_type, f"not every FusedRoPE can take its norm ({first[0].name}: "
                           f"{first[1]}); one function body per model")
            return False
        for m in matches:
            m.rope.replace_input_with(0, m.norm.inputs[0])
            m.rope.resize_inputs(3)
            m.rope.replace_input_with(2, m.norm.inputs[1])
            m.rope.attributes["epsilon"] = ir.AttrFloat32("epsilon", m.epsilon)
            stats.fire(m.rope.name or m.rope.op_type)
        attach_functions(model)
        return True
