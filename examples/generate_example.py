"""Generate text with the fuselm runtime, from Python.

Builds a tiny random-weight Qwen3 checkpoint (nothing is downloaded), converts it to 4-bit,
optimizes the graph, checks the runtime's greedy tokens against onnxruntime and HF transformers,
then streams a few tokens (random weights: the text is gibberish, the pipeline is real).

    python examples/generate_example.py [--backend auto|mlx|torch]
"""

import argparse
import tempfile
from pathlib import Path

import fuselm
from fuselm.synth import make_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="auto", choices=["auto", "mlx", "torch"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = make_checkpoint(tmp / "hf", "qwen3")
        fuselm.convert(ckpt, tmp / "exported", quant="q4", quiet=True)
        fuselm.optimize(tmp / "exported", tmp / "optimized", quiet=True)
        fuselm.validate(tmp / "optimized", ckpt, tokens=8, backend=args.backend)
        result = fuselm.run(tmp / "optimized", prompt="the quick brown fox", max_tokens=16, ignore_eos=True,
                            backend=args.backend, profile=True)
        print(f"{len(result['tokens'])} tokens on {result['backend']} ({result['device']}): "
              f"prefill {result['prefill_tok_s']:.0f} tok/s, decode {result['decode_tok_s']:.0f} tok/s")


if __name__ == "__main__":
    main()
