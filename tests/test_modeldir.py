"""atomic_output_dir: nothing half-written at OUT, one writer at a time, leftovers cleaned."""

import multiprocessing as mp
import os
import time

import pytest

from fuselm.errors import FuselmError
from fuselm.modeldir import atomic_output_dir, read_meta, write_meta


def test_success_renames_into_place(tmp_path):
    out = tmp_path / "m"
    with atomic_output_dir(out) as tmp:
        (tmp / "a").write_text("x")
        assert not out.exists()
    assert (out / "a").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_error_leaves_nothing(tmp_path):
    out = tmp_path / "m"
    with pytest.raises(RuntimeError), atomic_output_dir(out) as tmp:
        (tmp / "a").write_text("x")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_existing_out_needs_force(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "old").write_text("old")
    with pytest.raises(FuselmError, match="--force"), atomic_output_dir(out):
        pass
    with pytest.raises(FuselmError, match="not a fuselm model directory"), atomic_output_dir(out, force=True):
        pass
    write_meta(out, {"stage": "exported"})  # a model directory: --force replaces it
    with atomic_output_dir(out, force=True) as tmp:
        (tmp / "new").write_text("new")
    assert [p.name for p in out.iterdir()] == ["new"]


def test_stale_leftovers_of_dead_process_are_removed(tmp_path):
    stale = tmp_path / ".fuselm-tmp-m.999999999.deadbeef"
    stale.mkdir()
    with atomic_output_dir(tmp_path / "m"):
        pass
    assert not stale.exists()


def _hold(out, started, release):
    with atomic_output_dir(out) as tmp:
        (tmp / "a").write_text("first")
        started.set()
        release.wait(10)


def test_second_writer_stops_with_clear_error(tmp_path):
    out = tmp_path / "m"
    ctx = mp.get_context("fork")
    started, release = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold, args=(out, started, release))
    p.start()
    assert started.wait(10)
    with pytest.raises(FuselmError, match="another fuselm process"), atomic_output_dir(out):
        pass
    release.set()
    p.join(10)
    assert (out / "a").read_text() == "first"


def test_killed_writer_leaves_no_out_and_next_run_cleans(tmp_path):
    out = tmp_path / "m"
    ctx = mp.get_context("fork")
    started, release = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold, args=(out, started, release))
    p.start()
    assert started.wait(10)
    os.kill(p.pid, 9)
    p.join(10)
    time.sleep(0.1)
    assert not out.exists()
    with atomic_output_dir(out) as tmp:
        (tmp / "b").write_text("second")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_meta_roundtrip_and_errors(tmp_path):
    with pytest.raises(FuselmError, match="fuselm.json is missing"):
        read_meta(tmp_path)
    write_meta(tmp_path, {"stage": "exported"})
    assert read_meta(tmp_path)["stage"] == "exported"
    (tmp_path / "fuselm.json").write_text("{not json")
    with pytest.raises(FuselmError, match="not valid JSON"):
        read_meta(tmp_path)
