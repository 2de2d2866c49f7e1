"""What `fuselm validate` compares, whichever engine runs: greedy traces, their logit drift, the int8 criterion.

Where the engine's quantized matmuls take int8 activations (the CPU kernels' default, onnxruntime's MatMulNBits at
accuracy level 4), greedy tokens may part from f32 math's at any near-tie, which says nothing about quality. The
criterion is what users choose a quantization by: the next-token distributions on real text. Over TEXT_TOKENS
tokens of the bundled text (teacher-forced), the mean KL divergence of the engine's distributions from the standard
graph's in onnxruntime with f32 activations (level 1) must stay within INT8_KL_FACTOR times that of onnxruntime's
own int8 fusion of the same graph (level 4, its CPU default: the yardstick). Where the tokens part is reported.
"""

from __future__ import annotations

import numpy as np

from fuselm.errors import CheckFailed
from fuselm.reference import Trace

INT8_KL_FACTOR = 2.0
TEXT_TOKENS = 256


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


def int8_kl(ours: np.ndarray, standard, ids: list[int]) -> dict:
    """Mean KL divergence from the standard graph's next-token distributions (onnxruntime, f32 activations) of
    `ours` (the engine's teacher-forced logits on `ids`) and of onnxruntime's level-4 fusion of it."""
    from fuselm import contract
    from fuselm.reference import OrtRunner, log_softmax, ort_scores

    ref = log_softmax(ort_scores(OrtRunner(standard), ids))
    yard = ort_scores(OrtRunner(standard, optimize=True, accuracy_level=contract.ORT_ACCURACY_LEVEL), ids)

    def kl(logits) -> float:
        return float((np.exp(ref) * (ref - log_softmax(logits))).sum(-1).mean())

    return {"criterion": f"mean KL divergence from the standard graph (f32 activations) on {len(ids)} tokens of "
                         "text, against onnxruntime's own int8 fusion of it",
            "kl": kl(ours), "ort_level4_kl": kl(yard), "tokens": len(ids)}


def verdict(console, result: dict, target: Trace, drift: list[float], who: str, int8: dict | None = None,
            kinds: str = "", hint: str = "", quantized_as: str = "a quantized graph") -> dict:
    """validate's ending, whichever engine ran: HF's drift reported for a quantized graph; with int8 activations
    (`int8`: int8_kl's) the KL criterion, else `result`'s greedy tokens equal `target`'s; CheckFailed otherwise."""
    first, name, hf_first = result["first_mismatch"], result["reference"], result["hf_first_diff"]
    if result["quantized"] and hf_first is not None:
        console.print(f"HF drift (expected for {quantized_as}): tokens first differ from HF at step {hf_first}")
    if int8 is not None:
        result["int8"] = int8
        console.print(f"int8 activations{kinds}, {int8['criterion']}: {who} {int8['kl']:.3g}, onnxruntime's level-4 "
                      f"fusion {int8['ort_level4_kl']:.3g} (greedy tokens leave {name}'s at step {first})")
        if int8["kl"] > INT8_KL_FACTOR * int8["ort_level4_kl"] + 1e-6:  # beyond INT8_KL_FACTOR times the yardstick's
            raise CheckFailed(f"int8-activation KL divergence {int8['kl']:.3g} from the standard graph on "
                              f"{int8['tokens']} tokens of text exceeds {INT8_KL_FACTOR}x onnxruntime's own int8 "
                              f"fusion's ({int8['ort_level4_kl']:.3g}){hint}")
        console.print("[green]OK[/green]: int8-activation KL divergence within 2x onnxruntime's own int8 fusion's")
        return result
    if first is not None:
        raise CheckFailed(f"greedy tokens differ from {name} at step {first}: {who} {result['tokens'][first]}, {name} "
                          f"{target.tokens[first]} (max |Δlogit| there {drift[first]:.3g})")
    console.print(f"[green]OK[/green]: {len(result['tokens'])} greedy tokens equal {name}'s")
    return result


def text_ids(tok, fallback: list[int]) -> list[int]:
    """TEXT_TOKENS tokens of the bundled text (fuselm/text.py) as the model's tokenizer reads it; without a
    tokenizer, `fallback` repeated to that length."""
    if tok is None:
        return (list(fallback) * (TEXT_TOKENS // max(len(fallback), 1) + 1))[:TEXT_TOKENS]
    from fuselm import text

    return [int(i) for i in tok.encode(text.read_text(None)[0])[:TEXT_TOKENS]]
