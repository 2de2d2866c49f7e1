"""ONNX's own node tests against the op table, one test per claimed op and backend.

The torch backend on CPU is the reference the issue names; MLX (its CPU backend here) runs the
same cases, since the same op table drives it.

Each case runs through `FuselmBackend` (tests/onnx_backend.py) and is compared with the
expected outputs ONNX ships with the case, at the case's own tolerances. Exclusions are listed
below, each with its reason; a test checks that every exclusion still matches a case.
"""

import re
import sys
import types
import warnings

import numpy as np
import onnx
import pytest
from fuselm.runtime_metal.loader import tensor_to_array
from fuselm.runtime_metal.ops import OPS
from onnx_backend import FuselmBackend

# (regex on the case name, reason)
EXCLUDED = [
    (r"float8|FLOAT8|e4m3|e5m2|e8m0|FLOAT4E2M1|float4e2m1", "float8/float4 element types: no LLM graph fuselm runs uses them"),
    (r"UINT2|INT2|uint2|int2", "2-bit element types: not in any graph fuselm writes"),
    (r"string", "string tensors: the runtime holds numeric tensors only"),
    (r"cast(like)?_.*(UINT4|INT4)", "4-bit tensors exist in fuselm graphs only as DequantizeLinear weights, unpacked at load; "
                                     "4-bit values are never computed or returned"),
    (r"quantizelinear_(uint4|int4)$", "QuantizeLinear to 4 bits would return a 4-bit tensor: see the 4-bit exclusion"),
    (r"quantizelinear_blocked_symmetric", "the expected output is a 4-bit tensor: see the 4-bit exclusion"),
    (r"uint(16|32|64)|bitwise_not_3d", "torch has no CPU kernels for unsigned 16/32/64-bit arithmetic; LLM graphs use none"),
    (r"attention_.*(bf16|fp16)", "reduced-precision attention: SDPA accumulates in f32 and rounds once, the reference "
                                 "rounds every intermediate; they differ by one bf16/fp16 ulp, above the case's rtol 1e-3"),
    (r"celu_bfloat16_expanded", "the expanded body rounds each intermediate to bf16; one ulp off the reference"),
    (r"if_seq|if_opt", "sequence and optional types: not supported by the runtime"),
]


def _excluded(name: str) -> str | None:
    return next((reason for pattern, reason in EXCLUDED if re.search(pattern, name)), None)


# ONNX's case modules of ops the table does not claim whose cases are slow to make (their numpy references
# are ~3/4 of collect_testcases' time) and never enter `cases`: not imported (stand-ins in sys.modules).
UNCLAIMED_MODULES = {"averagepool": "AveragePool", "lppool": "LpPool", "maxpool": "MaxPool"}


@pytest.fixture(scope="module")
def cases():
    """Node test cases whose every node is an op the table claims, keyed by the op under test."""
    claimed = {name for domain, name in OPS if domain == ""} | {"If"}
    assert not claimed & set(UNCLAIMED_MODULES.values()), "the table claims an op of UNCLAIMED_MODULES: remove it there"
    stand_ins = {f"onnx.backend.test.case.node.{m}": types.ModuleType(m) for m in UNCLAIMED_MODULES}
    assert not stand_ins.keys() & sys.modules.keys()
    sys.modules.update(stand_ins)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from onnx.backend.test.case.node import collect_testcases

            all_cases = collect_testcases()
    finally:
        for name in stand_ins:
            del sys.modules[name]
    by_name = {c.name: c for c in all_cases}
    grouped: dict[str, list] = {}
    for c in all_cases:
        base = by_name.get(c.name.split("_expanded")[0], c)
        op = base.model.graph.node[0].op_type
        if {n.op_type for n in c.model.graph.node} <= claimed and all(n.domain in ("", "ai.onnx") for n in c.model.graph.node):
            grouped.setdefault(op, []).append(c)
    return grouped


CLAIMED = sorted({name for domain, name in OPS if domain == ""} | {"If"})
# Ops of the table with no node test case in ONNX's suite, and why that is fine (none today).
NO_CASES: dict[str, str] = {}


def _expected(v):
    return tensor_to_array(v) if isinstance(v, onnx.TensorProto) else np.asarray(v)


@pytest.mark.parametrize("backend", ["torch", "mlx"])
@pytest.mark.parametrize("op", CLAIMED)
def test_op(op, backend, cases):
    runs = [c for c in cases.get(op, []) if not _excluded(c.name)]
    if not cases.get(op):
        assert op in NO_CASES, f"{op}: no ONNX node test case; list it in NO_CASES with a reason"
        return
    failures = []
    for c in runs:
        try:
            rep = FuselmBackend.prepare(c.model, backend=backend, device="cpu")
            for inputs, outputs in c.data_sets:
                got = rep.run(list(inputs))
                assert len(got) == len(outputs)
                for g, e in zip(got, outputs, strict=True):
                    e = _expected(e)
                    g = np.asarray(g)
                    assert g.shape == e.shape, f"shape {g.shape} != {e.shape}"
                    assert g.dtype == e.dtype, f"dtype {g.dtype} != {e.dtype}"
                    np.testing.assert_allclose(g.astype(np.float64) if g.dtype.kind not in "bOUS" else g,
                                               e.astype(np.float64) if e.dtype.kind not in "bOUS" else e,
                                               rtol=c.rtol, atol=c.atol)
        except Exception as ex:  # noqa: BLE001 - collect every failing case of the op
            failures.append(f"{c.name}: {type(ex).__name__}: {str(ex)[:300]}")
    assert not failures, "\n".join(failures)


def test_every_exclusion_matches_a_case(cases):
    names = [c.name for group in cases.values() for c in group]
    for pattern, reason in EXCLUDED:
        assert any(re.search(pattern, n) for n in names), f"stale exclusion {pattern!r} ({reason})"
