"""Convert a checkpoint with fuselm and run the graph in onnxruntime.

    python examples/convert_example.py                 # builds a tiny random Qwen3 checkpoint first
    python examples/convert_example.py --hf ~/models/Qwen3-0.6B --quant q4

Shows the Python API (`fuselm.convert`), the model directory it writes, and a greedy decode
loop over the graph contract (input_ids, attention_mask, position_ids, past_key_values.* ->
logits, present.*) in plain onnxruntime.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import fuselm
from fuselm.reference import OrtRunner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf", type=Path, default=None, help="HF checkpoint dir (default: build a tiny one)")
    ap.add_argument("--quant", default="q4", choices=["f32", "f16", "q8", "q4"])
    ap.add_argument("--prompt", default="the quick brown fox")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="fuselm-example-"))
    hf = args.hf
    if hf is None:
        from fuselm.synth import make_checkpoint

        hf = make_checkpoint(work / "hf", "qwen3")
    # --check compares onnxruntime with HF transformers (prefill + one decode step).
    out = fuselm.convert(hf, work / f"model-{args.quant}", quant=args.quant, check=True)

    meta = json.loads((out / "fuselm.json").read_text())
    print("files:", sorted(p.name for p in out.iterdir()))
    print("dims:", meta["dims"], "| quantization:", meta["quantization"]["linear"])

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    prompt = tok(args.prompt)["input_ids"]
    tokens = OrtRunner(out).greedy(prompt, 12).tokens
    print(f"{args.prompt!r} -> {tok.decode(tokens)!r}  (random weights: the text is noise)")


if __name__ == "__main__":
    main()
