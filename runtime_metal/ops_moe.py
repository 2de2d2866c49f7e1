"""fuselm::MoE in the op table: each token through its top_k experts only (the function body runs all).

    x2 = x as [T, H]; logits = x2 @ router^T (+ router_bias), in the router's dtype (the graph's)
    softmax, normalize: (top, experts) = select_experts(logits, k); w = softmax(top) (= the renormalised top_k)
    softmax:            (w, experts) = select_experts(softmax(logits), k)
    softmax + bias:     experts chosen on softmax(logits) + `bias`, w = their probabilities (Ernie-4.5-MoE)
    sigmoid:            experts chosen on sigmoid(logits) (+ `bias`), w = their sigmoids (renormalised: normalize)
    sparsemixer:        PhiMoE's: the sorted top_k logits, slot j a softmax over the experts within 2·jitter_eps
                        (relative) of its logit and not chosen before it (contract.moe_function)
    w *= scaling; y = sum_k (down(w * act(gate, up)) + w * down_bias[experts])   [T, k, H] -> [T, H]
    gate, up = the slot's gate/up projection (+ gate_up_bias[experts]); act: act(gate) * up, or gpt-oss's
    clamped SwiGLU (alpha, limit)

`select_experts` is the backend's top_k in no particular order (MLX: mx.argpartition, as mlx-lm), and the
weights multiply the activation before the down projection (linear, so the same sum; the multiply joins
the activation's elementwise kernel and the combine is one Sum). `expert_mlp` / `expert_matmul` are the
backend's (backends/base.py): MLX `mx.gather_mm` / `mx.gather_qmm` with mlx-lm's SwitchGLU sort for long
prompts, torch and numpy the selected experts' matmuls grouped by expert. At load (`fold_experts`), a MoE
whose stacked weights are blocked DequantizeLinears of constants becomes `QMoE` with the weights prepared
once by `backend.prepare_experts` (MLX: its affine 4/8-bit format, so a 4-bit expert stays 4-bit in
memory), kept in the prepared-weights store beside the model (runtime_metal/prepared.py) so a second load
reads them memory-mapped instead of packing them again.
"""

from __future__ import annotations

from onnx import TensorProto

from fuselm import contract
from fuselm.errors import FuselmError

from .ops import Gelu, _scalar, op
from .ops_nn import RUNTIME


@op(contract.MOE_OP, domain=contract.DOMAIN, fused=True)
def MoE(b, x, router, gate_up, down, bias=None, router_bias=None, gate_up_bias=None, down_bias=None, *, top_k,
        normalize=0, activation="silu", scoring="softmax", scaling=1.0, alpha=1.0, limit=float("inf"), jitter_eps=0.01):
    return _moe(b, x, router, gate_up, down, bias, top_k, normalize, activation, scoring, scaling,
                (router_bias, gate_up_bias, down_bias), alpha, limit, jitter_eps)


@op("QMoE", domain=RUNTIME)
def QMoE(b, x, router, bias=None, router_bias=None, gate_up_bias=None, down_bias=None, *, gate_up, down, top_k,
         normalize=0, activation="silu", scoring="softmax", scaling=1.0, alpha=1.0, limit=float("inf"), jitter_eps=0.01,
         source=""):
    """fuselm::MoE whose stacked expert weights were prepared at load (`fold_experts`)."""
    return _moe(b, x, router, gate_up, down, bias, top_k, normalize, activation, scoring, scaling,
                (router_bias, gate_up_bias, down_bias), alpha, limit, jitter_eps)


def _sparsemixer(b, logits, k: int, jitter_eps: float):
    """(weights [T, k], experts [T, k]) of PhiMoE's sparsemixer (contract._sparsemixer_body's steps)."""
    top, experts = b.topk(logits, k, -1, True, True)
    t, e = b.shape(logits)
    v3, s3 = b.reshape(top, (t, k, 1)), b.reshape(logits, (t, 1, e))
    factor = b.binary("max", b.unary("abs", s3), v3)
    far = b.binary("greater", b.binary("div", b.binary("sub", v3, s3), factor), _scalar(b, logits, 2 * float(jitter_eps)))
    slots = b.arange(0, k, 1, TensorProto.INT64)
    rank = b.scatter_elements(b.full((t, e), k, TensorProto.INT64), b.cast(experts, TensorProto.INT64),
                              b.expand(b.reshape(slots, (1, k)), (t, k)), 1, "none")
    before = b.binary("less", b.reshape(rank, (t, 1, e)), b.reshape(slots, (k, 1)))
    gates = b.where(b.binary("or", far, before), b.full((1, 1, 1), float("-inf"), b.dtype(logits)), s3)
    chosen = b.reshape(b.cast(experts, TensorProto.INT64), (t, k, 1))
    weights = b.reshape(b.gather_elements(b.softmax(gates, -1), chosen, 2), (t, k))
    return weights, experts


def _moe(b, x, router, gate_up, down, bias, top_k: int, normalize: int, activation: str, scoring: str, scaling: float,
         biases=(None, None, None), alpha: float = 1.0, limit: float = float("inf"), jitter_eps: float = 0.01):
    router_bias, gate_up_bias, down_bias = biases
    shape = b.shape(x)
    x2 = b.reshape(x, (-1, shape[-1]))
    logits = b.matmul(x2, b.transpose(router, (1, 0)))
    if router_bias is not None:
        logits = b.binary("add", logits, router_bias)
    k = int(top_k)
    if scoring not in contract.MOE_SCORINGS:
        raise FuselmError(f"fuselm::MoE scoring {scoring!r} is not one of {', '.join(contract.MOE_SCORINGS)}; the graph "
                          "was written by another fuselm: convert the checkpoint again with this one")
    if scoring == "sparsemixer":
        weights, experts = _sparsemixer(b, logits, k, jitter_eps)
    elif scoring == "softmax" and normalize and bias is None:  # renormalised over the top_k = softmax of the top_k logits
        top, experts = b.select_experts(logits, k)
        weights = b.softmax(top, -1)
    elif scoring == "softmax" and bias is None:
        weights, experts = b.select_experts(b.softmax(logits, -1), k)
    else:  # each expert's sigmoid (or softmax), chosen with the selection bias added, weighted without it
        probs = b.unary("sigmoid", logits) if scoring == "sigmoid" else b.softmax(logits, -1)
        if bias is not None:
            bias = b.reshape(bias, (-1,))
        experts = b.select_experts(b.binary("add", probs, bias) if bias is not None else probs, k)[1]
        weights = b.gather_elements(probs, experts, 1)
        if normalize:
            weights = b.binary("div", weights, b.reduce("sum", weights, (-1,), True))
    if scaling != 1.0:
        weights = b.binary("mul", weights, _scalar(b, weights, float(scaling)))

    def act(gate, up):
        if activation == "clamped_swiglu":  # gpt-oss: min(gate, limit) * sigmoid(alpha * ...) * (clip(up) + 1)
            lim = _scalar(b, gate, float(limit))
            gate = b.binary("min", gate, lim)
            up = b.binary("max", b.binary("min", up, lim), _scalar(b, up, -float(limit)))
            g = b.binary("mul", gate, b.unary("sigmoid", b.binary("mul", gate, _scalar(b, gate, float(alpha)))))
            return b.binary("mul", g, b.binary("add", up, _scalar(b, up, 1.0)))
        if activation == "silu":
            return b.silu_gate(gate, up)  # (MLX: one compiled kernel, as mlx-lm's swiglu)
        return b.binary("mul", Gelu(b, gate, approximate="tanh" if activation == "gelu_tanh" else "none"), up)

    # [T, H]: the weighted sum over the k experts
    y = b.expert_mlp(x2, gate_up, down, experts, act, weights, gate_up_bias=gate_up_bias, down_bias=down_bias)
    return b.reshape(y, tuple(shape))


__all__ = ["MoE", "QMoE"]
