"""The CLI surface: a thin layer over the Python API, with DESIGN.md's exit codes."""

import pytest

from fuselm import cli


def test_help_lists_every_command(capsys):
    try:
        cli.main(["--help"])
    except SystemExit as e:
        assert e.code == 0
    out = capsys.readouterr().out
    for command in ("convert", "optimize", "diff", "run", "validate"):
        assert command in out


def test_bad_usage_exits_2(capsys):
    """(A real process's exit status: tests/test_runtime_errors.py, tests/test_convert_inputs.py.)"""
    with pytest.raises(SystemExit) as e:
        cli.main(["convert"])
    assert e.value.code == 2
    assert "required" in capsys.readouterr().err
