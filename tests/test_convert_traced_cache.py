"""The traced exporter's on-disk cache (exporter/traced/cache.py): a later convert of the same
architecture stamps the stored templates and writes the same model, byte for byte; a damaged entry,
or one that has not seen a tensor name of the checkpoint, is traced again."""

from __future__ import annotations

import shutil

import pytest
from fuselm.exporter import traced as traced_pkg
from fuselm.exporter.traced import cache

import fuselm

FILES = ("model.onnx", "model.onnx.data", "fuselm.json")


class Traced(Exception):
    pass


def _no_trace(*args):
    raise Traced


@pytest.fixture(scope="module")
def first(make_ckpt, tmp_path_factory):
    """One traced q4 convert with the cache on: (hf dir, its output, the cache directory it filled)."""
    tmp = tmp_path_factory.mktemp("trace-cache")
    hf = make_ckpt("qwen3")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FUSELM_TRACE_CACHE", "1")
        mp.setenv("FUSELM_TRACE_CACHE_DIR", str(tmp / "cache"))
        mp.setattr(traced_pkg, "_TRACED", {})
        out = fuselm.convert(hf, tmp / "first", quant="q4", exporter="torch", quiet=True)
    return hf, out, tmp / "cache"


@pytest.fixture
def store(first, tmp_path, monkeypatch):
    """A copy of the filled cache, on; nothing traced in this process (a new process)."""
    shutil.copytree(first[2], tmp_path / "cache")
    monkeypatch.setenv("FUSELM_TRACE_CACHE", "1")
    monkeypatch.setenv("FUSELM_TRACE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(traced_pkg, "_TRACED", {})
    monkeypatch.setattr(traced_pkg, "_traced", _no_trace)
    entries = [p for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1
    return entries[0]


def test_second_convert_stamps_the_cached_trace(first, store, tmp_path):
    hf, out, _ = first
    second = fuselm.convert(hf, tmp_path / "second", quant="q4", exporter="torch", quiet=True)
    for name in FILES:
        assert (out / name).read_bytes() == (second / name).read_bytes(), name


def test_damaged_entry_is_not_used(first, store, tmp_path):
    (store / "layer_kind_0.pb").write_bytes(b"\x08\x99 truncated")
    assert cache.load(store.name) is None
    with pytest.raises(Traced):
        fuselm.convert(first[0], tmp_path / "out", exporter="torch", quiet=True)


def test_entry_without_a_tensor_name_is_not_used(first, store, tmp_path, monkeypatch):
    entry = cache.load(store.name)
    entry.names.pop(next(iter(entry.names)))
    monkeypatch.setattr(cache, "load", lambda k: entry)
    with pytest.raises(Traced):
        fuselm.convert(first[0], tmp_path / "out", exporter="torch", quiet=True)


def test_a_second_writer_leaves_the_stored_entry_in_place(store):
    """Two processes that traced one architecture at once both store it: the later one keeps the entry the
    other wrote (a reader may be in it); an entry without one of its tensor names is still replaced, whole."""
    entry = cache.load(store.name)
    manifest = (store / "traced.json").stat().st_ino
    cache.store(store.name, entry)
    assert (store / "traced.json").stat().st_ino == manifest
    entry.names["model.extra.weight"] = "model.extra.weight"
    cache.store(store.name, entry)
    assert "model.extra.weight" in cache.load(store.name).names
    assert [p.name for p in store.parent.iterdir()] == [store.name]  # nothing left aside


def test_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSELM_TRACE_CACHE", "0")
    monkeypatch.setenv("FUSELM_TRACE_CACHE_DIR", str(tmp_path / "cache"))
    assert cache.folder() is None and cache.load("k") is None
    cache.store("k", None)  # off: never touches the disk
    assert not (tmp_path / "cache").exists()


def test_key_follows_the_config_not_its_bookkeeping():
    config = {"model_type": "qwen3", "hidden_size": 64, "_name_or_path": "a", "transformers_version": "5.0"}
    assert cache.key(config) == cache.key({**config, "_name_or_path": "b", "transformers_version": "5.1"})
    assert cache.key(config) != cache.key({**config, "hidden_size": 128})
