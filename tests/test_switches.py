"""FUSELM_* on/off switches read one way (fuselm/switches.py): 0/off/false/no are off in any case, unset or empty is
the default, anything else is on; the sites that read them follow it."""

from __future__ import annotations

import pytest

from fuselm import switches


@pytest.mark.parametrize("value, expected", [("0", False), ("off", False), ("False", False), (" no ", False),
                                             ("1", True), ("yes", True), ("on", True), ("", None)])
def test_setting(monkeypatch, value, expected):
    monkeypatch.setenv("FUSELM_X", value)
    assert switches.setting("FUSELM_X") is expected
    assert switches.on("FUSELM_X", default=True) is (True if expected is None else expected)


def test_sites_read_false_as_off(monkeypatch, tmp_path):
    from fuselm.exporter.traced import cache
    from fuselm.runtime_metal import prepared

    monkeypatch.setenv("FUSELM_TRACE_CACHE", "false")
    monkeypatch.setenv("FUSELM_PREPARED", "no")
    assert cache.folder() is None
    assert not prepared.enabled()
    pytest.importorskip("mlx.core")
    from fuselm.runtime_metal.backends import mlx_backend

    monkeypatch.setenv("FUSELM_BUILD_THREAD", "off")  # was: only "0" / "1" were read, "off" meant the default
    assert not mlx_backend._build_thread_wanted("gpu")
    monkeypatch.setenv("FUSELM_BUILD_THREAD", "yes")
    assert mlx_backend._build_thread_wanted("cpu")


def test_counts_name_a_bad_value(monkeypatch):
    """The value-taking switches (FUSELM_THREADS, FUSELM_INFLIGHT, FUSELM_LIMIT) read a
    whole number, take their default when unset, and name a bad value (was: a bare ValueError traceback,
    or FUSELM_LIMIT=abc silently ignored)."""
    from fuselm.errors import FuselmError

    monkeypatch.delenv("FUSELM_X", raising=False)
    assert switches.number("FUSELM_X", 2) == 2
    monkeypatch.setenv("FUSELM_X", " 3 ")
    assert switches.number("FUSELM_X", 2) == 3
    for bad in ("two", "-1", "1.5"):
        monkeypatch.setenv("FUSELM_X", bad)
        with pytest.raises(FuselmError, match=r"FUSELM_X=.* is not a whole number"):
            switches.number("FUSELM_X")


def test_torch_threads_switch(monkeypatch):
    from fuselm.runtime_metal.backends import torch_quant
    from fuselm.runtime_metal.backends.torch_backend import TorchBackend

    from fuselm.errors import FuselmError

    monkeypatch.setitem(torch_quant.KERNEL_THREADS, "n", torch_quant.KERNEL_THREADS["n"])  # restored after
    monkeypatch.setenv("FUSELM_THREADS", "1")
    assert TorchBackend("cpu").threads == 1
    monkeypatch.setenv("FUSELM_THREADS", "all")
    with pytest.raises(FuselmError, match="FUSELM_THREADS"):
        TorchBackend("cpu")


def test_cache_folders_have_one_home(monkeypatch, tmp_path):
    """Every cache folder of fuselm under $XDG_CACHE_HOME/fuselm (else ~/.cache/fuselm), each with its override."""
    from pathlib import Path

    from fuselm.exporter.traced import cache
    from fuselm.runtime_metal.backends import kernel_build

    for name in ("FUSELM_TRACE_CACHE", "FUSELM_TRACE_CACHE_DIR", "FUSELM_KERNEL_DIR", "TORCH_EXTENSIONS_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert switches.cache_folder("mlx") == Path.home() / ".cache" / "fuselm" / "mlx"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.folder() == tmp_path / "fuselm" / "traced"
    assert kernel_build.kernel_dir() == tmp_path / "fuselm" / "kernels"
    monkeypatch.setenv("FUSELM_TRACE_CACHE_DIR", str(tmp_path / "t"))
    monkeypatch.setenv("FUSELM_KERNEL_DIR", str(tmp_path / "k"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))  # FUSELM_KERNEL_DIR wins over it
    assert (cache.folder(), kernel_build.kernel_dir()) == (tmp_path / "t", tmp_path / "k")
    monkeypatch.delenv("FUSELM_KERNEL_DIR")
    assert kernel_build.kernel_dir() == tmp_path / "ext" / "fuselm"
