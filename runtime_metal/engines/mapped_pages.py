"""Resident pages of a model's data file that onnxruntime maps and never reads again, given back.

onnxruntime maps each external initializer of a model on its own. MatMulNBits packs its weights, scales and
zero points at load and drops the weights' mappings, but keeps the scales' and zero points' mapped and resident
though no kernel reads them again; a gather of embedding rows faults in their neighbours too (`while_loading` sets
MADV_RANDOM on the mappings). `release(path)` drops this process's pages
of every clean mapping of `path` (MADV_DONTNEED). A clean page of a file mapping that is touched
again is read back from the file (the page cache), so no result changes; a mapping with a written
page (copied on write, counted as anonymous) is left alone. Call it only while onnxruntime is idle:
between the scan of /proc/self/smaps and the madvise, no mapping of the file may be unmapped and
its range reused.

While a session loads, MatMulNBits reads every weight to pack it, and onnxruntime drops the weights'
mappings only once all are packed: their pages pile up over the packed copies (the load's peak).
`while_loading(path)` pages them out as the load goes (MADV_PAGEOUT, every 10 ms from a daemon
thread). Page-out never loses data (a clean file page is read back, an anonymous one would go to
swap), so a mapping unmapped and reused between the scan and the madvise costs at most a re-read.
Linux only (elsewhere both are no-ops; MADV_PAGEOUT needs Linux 5.4, older kernels refuse it).
"""

from __future__ import annotations

import ctypes
import functools
import re
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

MADV_RANDOM = 1
MADV_DONTNEED = 4
MADV_PAGEOUT = 21
LOAD_INTERVAL_S = 0.01
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$")


def mappings(path: Path, clean: bool = True) -> list[tuple[int, int]]:
    """(start, end) of this process's mappings of `path`; `clean`: only those with no anonymous (written)
    page, read from /proc/self/smaps (slower), else all of them from /proc/self/maps."""
    target, spans, cur = str(Path(path).resolve()), [], None
    with open("/proc/self/smaps" if clean else "/proc/self/maps") as f:
        for line in f:
            if m := _HEADER.match(line):
                cur = [int(m.group(1), 16), int(m.group(2), 16)] if m.group(3) == target else None
                if cur:
                    spans.append(cur)
            elif cur and line.startswith("Anonymous:") and int(line.split()[1]):
                spans.remove(cur)
                cur = None
    return [tuple(s) for s in spans]


def release(path: Path) -> int:
    """Drop the resident pages of `path`'s clean mappings; the number of mappings released (0 off Linux)."""
    return advise(path, MADV_DONTNEED)


def advise(path: Path, advice: int) -> int:
    """madvise `advice` over `path`'s mappings (only the clean ones for MADV_DONTNEED, the one advice here
    that can lose a write); the number of mappings it took (0 off Linux)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        spans = mappings(path, clean=advice == MADV_DONTNEED)
    except OSError:
        return 0
    madvise = _libc().madvise
    return sum(madvise(start, end - start, advice) == 0 for start, end in spans)


@functools.cache
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


@contextmanager
def while_loading(path: Path):
    """Page out `path`'s mapped pages every LOAD_INTERVAL_S while the body runs (a session's load),
    then release what is left once the body is done."""
    done = threading.Event()

    def page_out():
        while not done.wait(LOAD_INTERVAL_S):
            advise(path, MADV_PAGEOUT)

    thread = threading.Thread(target=page_out, name="fuselm-page-out", daemon=True)
    if sys.platform.startswith("linux"):
        thread.start()
    try:
        yield
    finally:
        done.set()
        if thread.is_alive():
            thread.join()
    release(path)
    advise(path, MADV_RANDOM)  # a gather's row read brings no neighbours (no fault-around) from now on
