"""Converting a mixture of experts streams: peak RSS against the number of experts.

    python bench/moe_convert.py                # 4, 32, 64 experts; f32 and q4
    python bench/moe_convert.py 8 128          # these expert counts

An OLMoE-shaped random checkpoint (fuselm.synth: 2 layers, hidden 1024, experts 1024 -> 512 -> 1024,
top-2) per expert count, made in one child, converted (`fuselm.convert(..., exporter="torch")`) in
another: its ru_maxrss is the convert's peak. Streaming holds one block of experts (exporter/weights.py's
BLOCK_ELEMENTS, at least two experts) whatever their number, so the peak stops growing with the
checkpoint once an expert block is full. Writes bench/results/moe-convert.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

RESULT = Path(__file__).resolve().parent / "results" / "moe-convert.json"
SHAPE = dict(hidden_size=1024, intermediate_size=512, num_attention_heads=8, num_key_value_heads=8, head_dim=128,
             num_experts_per_tok=2)

MAKE = r"""
import sys, json
import fuselm.synth as synth
e = int(sys.argv[2])
synth.make_checkpoint(sys.argv[1], "olmoe", generic=True, num_local_experts=e, num_experts=e, **json.loads(sys.argv[3]))
"""
CONVERT = r"""
import sys, json, resource, time
from pathlib import Path
import fuselm
hf, out, quant = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
t = time.perf_counter()
fuselm.convert(hf, out, exporter="torch", quant=quant, quiet=True, force=True)
print(json.dumps({"convert_s": round(time.perf_counter() - t, 1),
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
                  "checkpoint_mb": sum(p.stat().st_size for p in hf.glob("*.safetensors")) // 2**20}))
"""


def main(argv=None) -> int:
    counts = [int(a) for a in (argv if argv is not None else sys.argv[1:])] or [4, 32, 64]
    rows = []
    for experts in counts:
        with tempfile.TemporaryDirectory() as work:
            hf = Path(work) / "hf"
            subprocess.run([sys.executable, "-c", MAKE, str(hf), str(experts), json.dumps(SHAPE)], check=True,
                           capture_output=True)
            for quant in ("f32", "q4"):
                p = subprocess.run([sys.executable, "-c", CONVERT, str(hf), str(Path(work) / quant), quant], check=True,
                                   capture_output=True, text=True)
                row = {"experts": experts, "quant": quant, **json.loads(p.stdout.strip().splitlines()[-1])}
                print(json.dumps(row), flush=True)
                rows.append(row)
    RESULT.write_text(json.dumps({"shape": SHAPE, "layers": 2, "results": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
