"""bench/cpu_peer.py --tiny: fuselm and onnxruntime-genai side by side on a tiny config, end to end."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai (the dev extra) is not installed")
BENCH = Path(__file__).resolve().parents[1] / "bench" / "cpu_peer.py"


def test_cpu_peer_tiny(tmp_path, capsys):
    """The bench's driver runs here (it only orchestrates); every engine runs in its own child process."""
    spec = importlib.util.spec_from_file_location("bench_cpu_peer", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "cpu-peer.json"
    rc = bench.main(["--tiny", "--work", str(tmp_path / "work"), "--out", str(out)])
    assert rc == 0, capsys.readouterr().out[-2000:]
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
