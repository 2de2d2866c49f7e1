"""The recurrent-state ops in the op table: fuselm::CausalConv1D, fuselm::GatedDeltaNet, fuselm::Mamba2,
fuselm::Mamba (Mamba-1).

Each is the backend's kernel (backends/base.py: state_kernels.py over the primitives unless the backend has its
own), never its function body: the bodies scan with ONNX Scan, which is for onnxruntime and Netron. The state
input is the session's (state.py), float32; the op returns (y, present state) and the session keeps the present.
"""

from __future__ import annotations

from fuselm import contract

from .ops import op


@op(contract.CONV_OP, domain=contract.DOMAIN)
def CausalConv1D(b, x, past_state, weight):
    return b.causal_conv1d(x, past_state, weight)


@op(contract.GDN_OP, domain=contract.DOMAIN)
def GatedDeltaNet(b, query, key, value, decay, beta, past_state):
    return b.gated_delta(query, key, value, decay, beta, past_state)


@op(contract.MAMBA2_OP, domain=contract.DOMAIN)
def Mamba2(b, x, dt, a_log, bm, cm, d, dt_bias, past_state, *, dt_min=0.0, dt_max=float("inf")):
    return b.ssm_scan(x, dt, a_log, bm, cm, d, dt_bias, past_state, float(dt_min), float(dt_max))


@op(contract.MAMBA_OP, domain=contract.DOMAIN)
def Mamba(b, x, dt, a_log, bm, cm, d, dt_bias, past_state):
    return b.selective_scan(x, dt, a_log, bm, cm, d, dt_bias, past_state)
