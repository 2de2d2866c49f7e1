"""One child process, measured: what every benchmark here reports of a process it starts.

    from _child import run_child
    c = run_child(cmd)                      # c.returncode, c.stdout, c.stderr, c.wall_s, c.cpu_s, c.peak_rss_mb
    c = run_child(cmd, capture=False)       # the child's output goes to ours
    c = run_child(cmd, merge=True)          # its stderr into c.stdout, in order
    c = run_child(cmd, on_line=stamp)       # each stdout line handed to `stamp` as it comes (a first token's time)

Peak RSS is the child's ru_maxrss from os.wait4 (the largest of it and the children it waited for; KiB on Linux);
CPU time is its user + system time; wall time from the start to its exit; the 1-minute load average before it
started (a shared box's load is in every row). stderr is read on a thread while stdout streams, so a child that
writes a lot to both never blocks on a full pipe.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass


@dataclass
class Child:
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    cpu_s: float
    peak_rss_mb: float
    load_before: float
    started: float  # time.time() at the start (a child's own time stamps are on the same clock)

    def tail(self, lines: int = 3) -> str:
        """The last lines of its stderr (else stdout), for a row's "error"."""
        return " | ".join((self.stderr or self.stdout).strip().splitlines()[-lines:])[:500]


def run_child(cmd: list[str], env: dict | None = None, cwd=None, capture: bool = True, merge: bool = False,
              on_line=None) -> Child:
    load = os.getloadavg()[0]
    pipe = subprocess.PIPE if capture else None
    started, t0 = time.time(), time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, text=True, stdin=subprocess.DEVNULL, stdout=pipe,
                            stderr=(subprocess.STDOUT if merge else pipe) if capture else None)
    out, err = [], []
    drain = None
    if capture and not merge:
        drain = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
        drain.start()
    if capture:
        for line in proc.stdout:
            if on_line is not None:
                on_line(line)
            out.append(line)
    if drain is not None:
        drain.join()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return Child(proc.returncode, "".join(out), "".join(err), round(time.perf_counter() - t0, 2),
                 round(usage.ru_utime + usage.ru_stime, 2), round(usage.ru_maxrss / 1024, 1), round(load, 2), started)
