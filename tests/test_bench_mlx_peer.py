"""bench/mlx_peer.py at the tiny shape on MLX's CPU backend (its own file: the slowest test, one worker's share)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parent.parent / "bench" / "mlx_peer.py"


def test_mlx_peer_bench_tiny(tmp_path):
    """bench/mlx_peer.py on MLX's CPU backend at the tiny shape: both engines run, ratios are reported."""
    pytest.importorskip("mlx_lm")
    out = tmp_path / "peer.json"
    r = subprocess.run([sys.executable, str(BENCH), "--shapes", "tiny", "--groups", "32", "--contexts", "24",
                        "--prefill", "16", "--runs", "1", "--decode", "6", "--work", str(tmp_path / "work"),
                        "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(out.read_text())
    rows = {row["engine"]: row for row in data["rows"]}
    assert set(rows) == {"mlx-lm", "fuselm"} and not any("error" in row for row in rows.values())
    for row in rows.values():
        assert row["decode_tok_s"]["24"] > 0 and row["prefill_tok_s"]["16"] > 0 and row["per_token"]["kernels"] > 0
    assert "tiny g32 fuselm/mlx-lm decode@24" in data["summary"]
    ours, peer = data["summary"]["tiny g32 fuselm/mlx-lm kernels/token, fused ops as one"]
    assert ours < peer  # (0.79x at 4 layers, ~0.70x at 28: the per-layer part is 13 vs 19)
    assert data["machine"]["mlx_lm"] and data["protocol"]["dtype"] == "f32"
