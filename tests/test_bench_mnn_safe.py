"""bench/mnn_safe.py, the wrapper every MNN process of the benchmarks runs through: checked here with
the main environment's Python and no MNN at all (the suite never runs MNN's code: its tools phone home)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SAFE = Path(__file__).resolve().parents[1] / "bench" / "mnn_safe.py"
PROBE = """
import socket
try:
    import MNN.tools.utils.log
    print("log: imported")
except ImportError:
    print("log: blocked")
# a UDP socket: its connect() sends no packet even if the guard failed, so this probe never reaches out
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    s.connect(("192.0.2.1", 443))
    print("net: connected")
except ConnectionRefusedError as e:
    print("net:", e)
finally:
    s.close()
"""


def _run(tmp_path, stub_dir: str):
    bin_dir = tmp_path / stub_dir
    bin_dir.mkdir()
    (bin_dir / "pip").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "pip").chmod(0o755)
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    return subprocess.run([sys.executable, str(SAFE), str(probe)], capture_output=True, text=True, env=env,
                          timeout=60)


def test_safe_wrapper_blocks_mnn_telemetry_and_outbound_sockets(tmp_path):
    proc = _run(tmp_path, "safe-bin")
    assert proc.returncode == 0, proc.stderr
    assert "log: blocked" in proc.stdout
    assert "net: bench/mnn_safe.py: outbound connection to ('192.0.2.1', 443) blocked" in proc.stdout


def test_safe_wrapper_refuses_a_real_pip_first_on_path(tmp_path):
    proc = _run(tmp_path, "bin")
    assert proc.returncode == 1
    assert "not the stub in .venv-mnn/safe-bin" in proc.stderr
    assert "log:" not in proc.stdout
