"""A kernel build killed mid-way leaves torch.utils.cpp_extension's lock behind, and torch then waits on
it forever: fuselm removes a lock older than any build, and leaves a fresh one (a build in progress)."""

import os
import time

from fuselm.runtime_metal.backends import kernel_build


def test_stale_build_lock_is_removed_fresh_one_kept(tmp_path):
    stale, fresh = tmp_path / "stale_ext" / "lock", tmp_path / "fresh_ext" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir()
        lock.touch()
    old = time.time() - kernel_build.STALE_BUILD_LOCK_S - 60
    os.utime(stale, (old, old))
    kernel_build.clear_stale_build_lock(stale.parent)
    kernel_build.clear_stale_build_lock(fresh.parent)
    kernel_build.clear_stale_build_lock(tmp_path / "no_such_ext")  # nothing there: nothing happens
    assert not stale.exists() and fresh.exists()
