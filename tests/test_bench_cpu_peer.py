"""bench/cpu_peer.py --tiny: fuselm and onnxruntime-genai side by side on a tiny config, end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai (the dev extra) is not installed")
BENCH = Path(__file__).resolve().parents[1] / "bench" / "cpu_peer.py"


def test_cpu_peer_tiny(tmp_path):
    out = tmp_path / "cpu-peer.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--tiny", "--work", str(tmp_path / "work"), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
    result = json.loads(out.read_text())
    rows = {r["engine"]: r for r in result["rows"]}
    assert set(rows) == {"fuselm", "genai"}
    for r in rows.values():
        assert "error" not in r, r
        for key in ("decode_16_tok_s", "decode_64_tok_s", "prefill_32_tok_s", "prefill_64_tok_s", "peak_rss_mb"):
            assert r[key] > 0, (r["engine"], key)
        assert r["first_token"]["first_token_s"] > 0 and r["first_token"]["peak_rss_mb"] > 0
        assert isinstance(r["load_before"], float)
    assert "quantized matmul" in rows["fuselm"]["what"] and "onnxruntime-genai" in rows["genai"]["what"]
    assert result["machine"]["onnxruntime_genai"] and "tiny decode_16_tok_s fuselm/genai" in result["summary"]
