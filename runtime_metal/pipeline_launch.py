"""`fuselm run SPLIT` on one machine: fuselm starts one process per stage itself.

    fuselm run SPLIT --prompt "..."          # no mlx.launch: N local ranks over MLX's ring backend on loopback

mlx.launch relays its ranks' output from threads that select on each child's stdin pipe, which is
always writable (mlx/_distributed_utils/launch.py, `_thread_fn`): the launcher keeps a core busy for
the whole run, and on one host that is a core the ranks need. Here the ranks are started the way MLX
documents for running without its launcher (MLX_RANK and MLX_HOSTFILE: per rank a list of
"ip:port"), and nothing polls: stderr is inherited, the last rank's stdout (the tokens) is read with
blocking reads and written on, one thread per rank blocks in its wait and, when a rank fails, ends
the others. Each rank writes its result (or its FuselmError) to a file; the caller gets the last
rank's result with every rank's memory report, or the failing rank's error. Across machines use
mlx.launch with a hostfile: this starts local processes only.
"""

from __future__ import annotations

import codecs
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from fuselm.errors import FuselmError

RANK_MAIN = "from fuselm.runtime_metal.pipeline_run import rank_main; rank_main()"
LAUNCHED = "FUSELM_PIPE_LAUNCHED"  # set in each rank this module starts (pipeline_run.Bells: no launcher spins)


def loopback_ports(n: int) -> list[int]:
    """n distinct free ports on 127.0.0.1 (held together while chosen, so no two are the same)."""
    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(n)]
    try:
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def launch(n: int, kwargs: dict, stream=None) -> dict:
    """Run `pipeline_run.run` with `kwargs` (JSON: rank_main reads them) in n local ranks; the last rank's result, with "ranks": each rank's
    memory report. Tokens go to `stream` (default stdout) as the last rank prints them."""
    stream = stream or sys.stdout
    with tempfile.TemporaryDirectory(prefix="fuselm-pipe-") as tmp:
        tmp = Path(tmp)
        (tmp / "hosts.json").write_text(json.dumps([[f"127.0.0.1:{p}"] for p in loopback_ports(n)]))
        (tmp / "run.json").write_text(json.dumps(kwargs))
        ranks = []
        for r in range(n):
            env = {**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(tmp / "hosts.json"), LAUNCHED: "1"}
            ranks.append(subprocess.Popen([sys.executable, "-c", RANK_MAIN, str(tmp / "run.json"),
                                           str(tmp / f"rank{r}.json")], env=env, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.PIPE if r == n - 1 else None))
        failed: list[int] = []  # the first rank that failed (the others are ended because of it)
        lock = threading.Lock()

        def watch(r: int) -> None:
            if ranks[r].wait() == 0:
                return
            with lock:
                if failed:
                    return
                failed.append(r)
                for p in ranks:
                    if p.poll() is None:
                        p.terminate()

        watchers = [threading.Thread(target=watch, args=(r,), daemon=True) for r in range(n)]
        for w in watchers:
            w.start()
        try:
            decoder = codecs.getincrementaldecoder("utf-8")("replace")
            for chunk in iter(lambda: os.read(ranks[-1].stdout.fileno(), 1 << 16), b""):
                stream.write(decoder.decode(chunk))
                stream.flush()
            for w in watchers:
                w.join()
        finally:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            ranks[-1].stdout.close()
        results = [json.loads(f.read_text()) if f.is_file() else None for f in (tmp / f"rank{r}.json" for r in range(n))]
    if failed:
        r = cause(results, failed[0])
        error = (results[r] or {}).get("error")
        if error and not error.startswith(f"rank {r}"):
            error = f"rank {r}: {error}"
        raise FuselmError(error or
                          f"rank {r} of {n} ended with status {ranks[r].returncode} (its output is above)")
    return {**results[-1], "ranks": [res["memory"] for res in results]}


def cause(results: list, first: int) -> int:
    """The rank to blame: the lowest that wrote an error of its own (not the PeerLost of a rank whose peer
    went away: that rank's watcher may wake first, CI saw it), else `first`, the first seen to end."""
    return next((r for r, res in enumerate(results) if res and res.get("error") and not res.get("peer_lost")),
                first)
