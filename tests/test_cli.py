"""The CLI surface: a thin layer over the Python API, with DESIGN.md's exit codes."""

import subprocess
import sys

from fuselm import cli


def test_help_lists_every_command(capsys):
    try:
        cli.main(["--help"])
    except SystemExit as e:
        assert e.code == 0
    out = capsys.readouterr().out
    for command in ("convert", "optimize", "diff", "run", "validate"):
        assert command in out


def test_bad_usage_exits_2():
    r = subprocess.run([sys.executable, "-m", "fuselm.cli", "convert"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "required" in r.stderr
