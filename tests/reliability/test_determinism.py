"""Deterministic output: the same input and flags give byte-identical model directories.

convert (f32, q4) and optimize run in two fresh interpreters with different PYTHONHASHSEED (set and
dict orders of strings differ between them) and in this test process, at different paths and times;
every file they write (model.onnx, model.onnx.data, fuselm.json, the tokenizer files) must be equal
byte for byte. fuselm.json therefore holds no timestamps, durations or paths.
"""

from __future__ import annotations

import json
import subprocess
import sys

from reliability_helpers import same_files

SCRIPT = """
import sys, fuselm
hf, out = sys.argv[1], sys.argv[2]
for quant in ("f32", "q4"):
    fuselm.convert(hf, f"{out}/exported-{quant}", quant=quant, quiet=True)
    fuselm.optimize(f"{out}/exported-{quant}", f"{out}/optimized-{quant}", quiet=True)
"""


def test_outputs_are_byte_identical_across_processes(make_ckpt, exported, optimized, tally, tmp_path):
    hf = make_ckpt("llama")
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(hf), str(tmp_path / f"run{seed}")],
                              env={**_env(), "PYTHONHASHSEED": str(seed)}, stderr=subprocess.PIPE, text=True)
             for seed in (1, 2)]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read()
    for quant in ("f32", "q4"):
        for stage, here in (("exported", exported("llama", quant)), ("optimized", optimized("llama", quant))):
            runs = [tmp_path / f"run{seed}" / f"{stage}-{quant}" for seed in (1, 2)]
            ok = same_files(runs[0], runs[1]) and same_files(runs[0], here)
            assert tally.record("rerun", f"{stage} {quant}, 3 processes", ok), (stage, quant, _differ(runs[0], here))


def test_fuselm_json_has_no_clock_or_path(exported, optimized):
    for model in (exported("llama", "q4"), optimized("llama", "q4")):
        text = (model / "fuselm.json").read_text()
        assert str(model.parent) not in text and "seconds" not in text and "time" not in json.loads(text)


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}


def _differ(a, b) -> list[str]:
    return [p.name for p in sorted(a.iterdir()) if not (b / p.name).is_file() or (b / p.name).read_bytes() != p.read_bytes()]
