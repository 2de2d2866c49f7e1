"""What `fuselm validate` compares, whichever engine runs: greedy traces, their logit drift, the int8 criterion.

Where the engine's quantized matmuls take int8 activations (the CPU kernels' default, onnxruntime's MatMulNBits at
accuracy level 4), onnxruntime at level 1 stands for f32 math and onnxruntime's own int8 run beside it is the
yardstick: the engine's logit drift must stay within INT8_DRIFT_FACTOR times the yardstick's, and its tokens must not
leave the reference's earlier than the yardstick's do.
"""

from __future__ import annotations

import numpy as np

from fuselm.errors import CheckFailed
from fuselm.reference import Trace

INT8_DRIFT_FACTOR = 2.0


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def step_table(title: str, names: tuple[str, str, str], ours: Trace, ref: Trace, hf: Trace, d_ref: list[float],
               d_hf: list[float]):
    """The per-step table: our token, the reference's and HF's (red where they differ from ours), and the
    logit drifts; `names` = (our column, the reference's, its drift column)."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("step", names[0], names[1], "HF", names[2], "max|Δlogit| vs HF"):
        table.add_column(col, justify="right")
    mark = lambda t, other: f"[red]{t}[/red]" if t != other else str(t)  # noqa: E731
    for i, t in enumerate(ours.tokens):
        table.add_row(str(i), str(t), mark(ref.tokens[i], t), mark(hf.tokens[i], t), f"{d_ref[i]:.2e}", f"{d_hf[i]:.2e}")
    return table


def _max_diff(a: Trace, b: Trace) -> list[float]:
    return [float(np.abs(x - y).max()) for x, y in zip(a.logits, b.logits, strict=False)]


def _int8_drift(ours: Trace, level1: Trace, level4: Trace) -> dict:
    """Max |Δlogit| from level 1 (f32 activations, ~f64 math) of ours and of level 4, over the steps
    before either's tokens leave level 1's (later logits follow other tokens)."""
    first, first4 = _first_diff(ours.tokens, level1.tokens), _first_diff(level4.tokens, level1.tokens)
    steps = min(x for x in (first, first4, len(level1.tokens)) if x is not None) + 1  # a diverging step's logits count
    return {"drift": max(_max_diff(ours, level1)[:steps]), "ort_level4_drift": max(_max_diff(level4, level1)[:steps]),
            "ort_level4_first_diff": first4, "ort_level4_tokens": level4.tokens}


def check_int8(int8: dict, first: int | None, reference: str, yardstick: str, hint: str = "") -> None:
    """CheckFailed unless the int8-activation drift (`_int8_drift`) stays within INT8_DRIFT_FACTOR times the
    yardstick's and the tokens (first leaving the reference's at `first`) do not leave earlier than its."""
    first4 = int8["ort_level4_first_diff"]
    if int8["drift"] > INT8_DRIFT_FACTOR * int8["ort_level4_drift"] + 1e-6:
        raise CheckFailed(f"int8-activation drift {int8['drift']:.3g} exceeds {INT8_DRIFT_FACTOR}x {yardstick}'s "
                          f"({int8['ort_level4_drift']:.3g}){hint}")
    if first is not None and (first4 is None or first < first4):
        raise CheckFailed(f"int8-activation tokens leave {reference}'s at step {first}, before {yardstick}'s "
                          f"({first4}){hint}")
