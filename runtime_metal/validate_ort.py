"""`fuselm validate` on the onnxruntime engine (engines/ort.py, what `fuselm run --backend onnxruntime` and auto's
choice on a CPU run): greedy tokens and logits vs the standard graph in plain onnxruntime vs HF transformers.

The standard graph is DIR itself when it holds standard ops; for a graph lowered by `fuselm optimize
--target onnxruntime` it is `standard` when given, else the reference checkpoint converted again with the
quantization DIR's fuselm.json records and optimized without --target, in a temporary directory. It runs with onnxruntime's
optimizations off (fuselm/reference.py: the graph as written, f32 activations). Criteria, as
runtime_metal/validate.py's:
- a float graph: the tokens equal HF's;
- a quantized graph whose matmuls take f32 activations (MatMulNBits accuracy level below 4): the tokens
  equal the standard graph's;
- int8 activations (onnxruntime's CPU default: a lowered graph at level 4, or onnxruntime's own
  DequantizeLinear -> MatMul fusion on a standard graph): the KL divergence from the standard graph on real text
  stays within INT8_KL_FACTOR times that of onnxruntime's fusion of the standard graph at level 4
  (runtime_metal/checks.py).
Exit 1 (CheckFailed) on a mismatch.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import onnx

from fuselm import contract
from fuselm.errors import FuselmError
from fuselm.reference import OrtRunner, hf_model, hf_steps

from .checks import _first_diff, _max_diff, int8_kl, step_table, text_ids, verdict
from .engines.auto import lowered_for_onnxruntime
from .engines.ort import OrtEngine, int8_activations


def _precision(q: dict | None) -> str:
    bits = (q or {}).get("bits", 32)
    return f"q{bits}" if bits in (4, 8) else "f16" if bits == 16 else "f32"


def standard_graph(lowered: Path, reference: Path, work: Path) -> Path:
    """The standard graph a lowered directory was made from: `fuselm convert` of the reference checkpoint with
    the quantization its fuselm.json records (linear layers, block size, lm_head, embedding), then `fuselm
    optimize` without --target (passes/from_genai.py cannot map fuselm's own GroupQueryAttention back yet:
    its query width is not static)."""
    from fuselm.exporter.convert import convert
    from fuselm.passes.pipeline import optimize

    from fuselm.modeldir import read_meta

    q = read_meta(lowered).get("quantization") or {}
    linear = q.get("linear") or {}
    exported = convert(reference, work / "exported", quant=q.get("mode") or _precision(linear),
                              block_size=linear.get("block_size", 32), lm_head=_precision(q.get("lm_head", linear)),
                              embed=_precision(q.get("embed", linear)), quiet=True)
    return optimize(exported, work / "standard", quiet=True)


def validate(engine: OrtEngine, ref: Path, ids: list[int], tokens: int, standard, quiet: bool, tok=None) -> dict:
    """Greedy-generate `tokens` tokens on the onnxruntime engine, the standard graph and HF; compare. `standard`: the
    un-lowered model directory (default: the engine's source when it holds standard ops, else made again from the
    reference: `standard_graph`)."""
    from rich.console import Console

    path, why = engine.path, engine.why
    lowered = lowered_for_onnxruntime(path)
    with tempfile.TemporaryDirectory(prefix="fuselm-standard-") as tmp:
        std = Path(standard) if standard is not None else engine.source
        if lowered_for_onnxruntime(std) and standard is None:
            std = standard_graph(path, ref, Path(tmp))
        if lowered_for_onnxruntime(std):
            raise FuselmError(f"--standard {std} holds onnxruntime contrib ops too; pass the directory `fuselm optimize` "
                              "wrote without --target")
        quantized = any(n.op_type == "DequantizeLinear" for n in
                        onnx.load(str(std / contract.MODEL_NAME), load_external_data=False).graph.node)
        int8 = quantized and int8_activations(path)
        ours = engine.trace(ids, tokens)
        text = text_ids(tok, ids) if int8 else None
        scored = engine.score(text) if int8 else None
        what = engine.describe()
        engine.close()  # one engine's weights in memory at a time
        plain = OrtRunner(std).greedy(ids, tokens)
        kl = int8_kl(scored, std, text) if int8 else None
    hf = hf_steps(hf_model(ref), ids, tokens)
    d_std, d_hf = _max_diff(ours, plain), _max_diff(ours, hf)
    target, target_name = (plain, "the standard graph") if quantized else (hf, "HF transformers")
    first = _first_diff(ours.tokens, target.tokens)
    what = f"{what} on the {'lowered' if lowered else 'standard'} graph{f' ({why})' if why else ''}"
    acts = "int8" if int8 else "f32"
    console = Console(quiet=quiet)
    table = step_table(f"fuselm validate: {what} · {'quantized' if quantized else 'float'} graph, {acts} "
                       f"activations, reference {target_name}",
                       ("fuselm (onnxruntime)", "standard graph", "max|Δlogit| vs standard"), ours, plain, hf, d_std, d_hf)
    console.print(table)
    result = {"tokens": ours.tokens, "standard": plain.tokens, "hf": hf.tokens, "quantized": quantized,
              "lowered": lowered, "activations": acts, "reference": target_name, "first_mismatch": first,
              "hf_first_diff": _first_diff(ours.tokens, hf.tokens), "max_logit_diff_standard": d_std,
              "max_logit_diff_hf": d_hf, "backend": "onnxruntime", "device": "cpu", "describe": what}
    return verdict(console, result, target, d_std if quantized else d_hf, "fuselm (onnxruntime)", kl)
