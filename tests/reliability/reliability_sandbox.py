"""A fork server for the reliability tests: fuselm is imported once, every case runs in a forked child.

    python reliability_sandbox.py        # one JSON request per stdin line, one JSON answer per stdout line

Each case is a real `fuselm` command (`fuselm.cli.main(argv)`, or a Python snippet for API calls) in
its own process, so it can be killed, limited and broken in isolation, for the cost of a fork rather
than an interpreter start that imports torch. The server itself never runs torch, onnxruntime or MLX
work (their thread pools would not survive a fork) and never imports MLX.

Request fields (all optional but one of argv / python):
  argv          the command line after `fuselm`
  python        a snippet to exec instead (e.g. `fuselm.validate(...)`); its exceptions count like the CLI's
  env, cwd      for the child
  memory_gib    RLIMIT_AS: the child's current address space plus this much; an allocation sized by a
                bad value (a hidden size needing terabytes) fails instead of swapping the machine
  timeout       seconds before the child is killed (answer: timed_out)
  kill_after    [seconds, "SIGINT" | "SIGKILL" | "SIGTERM"]: the server signals the child, from outside
  fault         {"at": N, "action": "SIGINT" | "SIGKILL" | "ENOSPC"}: at the child's N-th file-system
                event the child signals itself, or that call fails with ENOSPC (write events only);
                events: opens for writing, renames, mkdir/remove/rmtree, truncate, pwrite/write, fsync
  guard         record and refuse network connections (TCP/UDP, name lookups), opens of pickle files,
                unpickling (the client turns it on for every case)
  group         a list of requests run at once (released together); the answer is a list
Answer: rc (exit status, None if killed), signal, timed_out, stdout, stderr, exception, events
(file-system events seen: {"io": n, "write": n}), blocked (guard records), seconds.
"""

from __future__ import annotations

import errno
import importlib
import itertools
import json
import os
import resource
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback

# What a case may touch: imported here once, inherited by every child.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
import fuselm.exporter.check  # noqa: E402, F401
import fuselm.exporter.convert  # noqa: E402, F401
import fuselm.passes.pipeline  # noqa: E402, F401
import fuselm.runtime_metal.generate  # noqa: E402, F401
import fuselm.runtime_metal.validate  # noqa: E402, F401
import onnxruntime  # noqa: E402, F401
import torch  # noqa: E402, F401
import transformers  # noqa: E402, F401
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402, F401

# the families' modeling modules (the rotary classes convert reads: exporter/rope.py): a child that
# imports one pulls in torch._dynamo and transformers' generation and masking code, ~2 CPU-s a case
for _family in ("qwen3", "qwen2", "llama", "mistral"):
    importlib.import_module(f"transformers.models.{_family}.modeling_{_family}")

import fuselm  # noqa: E402
import fuselm.cli  # noqa: E402

assert "mlx" not in sys.modules, "the fork server must not import MLX (its threads do not survive a fork)"

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_IO_EVENTS = ("os.rename", "os.replace", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.truncate")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


class _Faults:
    """Counts file-system events in the child and acts at the chosen one."""

    def __init__(self, fault: dict | None):
        self.fault = fault or {}
        self.io = self.write = 0
        self.names: list[str] = []  # what each event was, in order (for choosing fault points)

    def event(self, is_write: bool, name: str) -> None:
        self.io += 1
        self.write += is_write
        if len(self.names) < 100_000:
            self.names.append(name)
        action = self.fault.get("action")
        if action is None:
            return
        n = self.write if action == "ENOSPC" else self.io
        if n != self.fault["at"] or (action == "ENOSPC" and not is_write):
            return
        if action == "ENOSPC":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.kill(os.getpid(), getattr(signal, action))


def _install_hooks(faults: _Faults, guard: bool, blocked: list) -> None:
    def audit(event, args):
        if event == "open":
            path, mode, flags = (list(args) + [None, None, None])[:3]
            is_write = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & _WRITE_FLAGS)
            if guard and isinstance(path, (str, bytes, os.PathLike)) and \
                    os.fsdecode(path).endswith(_PICKLE_SUFFIXES):
                blocked.append(f"open {os.fsdecode(path)}")
                raise PermissionError(f"reliability guard: {os.fsdecode(path)} is a pickle file")
            if is_write:
                faults.event(True, "open")
        elif event in _IO_EVENTS:
            faults.event(event == "os.truncate", event)
        elif guard and event in ("socket.connect", "socket.sendto") and \
                getattr(args[0], "family", None) in (socket.AF_INET, socket.AF_INET6):
            blocked.append(f"{event} {args[1]!r}")
            raise ConnectionRefusedError(f"reliability guard: {event} blocked")
        elif guard and event in ("socket.getaddrinfo", "socket.gethostbyname"):
            blocked.append(f"{event} {args[0]!r}")
            raise ConnectionRefusedError(f"reliability guard: {event} blocked")
        elif guard and event == "pickle.find_class":
            blocked.append(f"unpickle {args[0]}.{args[1]}")
            raise RuntimeError("reliability guard: unpickling blocked")

    sys.addaudithook(audit)
    for name in ("pwrite", "write"):  # the convert writer's pwrite and low-level writes: not audited
        real = getattr(os, name)

        def wrapped(fd, *a, _real=real, _name=name):
            if fd > 2:
                faults.event(True, _name)
            return _real(fd, *a)
        setattr(os, name, wrapped)
    real_fsync = os.fsync

    def fsync(fd):
        faults.event(False, "fsync")
        return real_fsync(fd)
    os.fsync = fsync


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def _child(req: dict, out_path: str, err_path: str, result_path: str, go_fd: int | None) -> None:
    """Runs in the forked child; never returns."""
    rc = 1
    result: dict = {}
    try:
        fd_out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        fd_err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # never the protocol pipe (transformers may prompt)
        os.dup2(fd_out, 1)
        os.dup2(fd_err, 2)
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        os.environ.update(req.get("env") or {})
        if req.get("cwd"):
            os.chdir(req["cwd"])
        if go_fd is not None:  # a group: start together
            os.read(go_fd, 1)
        faults, blocked = _Faults(req.get("fault")), []
        if req.get("memory_gib"):
            limit = _vm_size() + int(req["memory_gib"] * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
        _install_hooks(faults, bool(req.get("guard")), blocked)
        result.update(events=faults, blocked=blocked)
        try:
            # Signals were ignored while the harness set up (the server forks with them ignored): a
            # signal now reaches the command, as it would a fresh `fuselm` process.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if "python" in req:
                exec(req["python"], {"fuselm": fuselm, "__name__": "__case__"})  # noqa: S102
                rc = 0
            else:
                rc = fuselm.cli.main(req["argv"])
        except SystemExit as e:  # argparse
            rc = e.code if isinstance(e.code, int) else 2
        except BaseException as e:  # what a user would see as a traceback
            traceback.print_exc()
            result["exception"] = f"{type(e).__name__}: {str(e)[:500]}"
            rc = 1
    except BaseException as e:  # the harness itself failed
        result["exception"] = f"harness: {type(e).__name__}: {e}"
        rc = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness's own bookkeeping is not interruptible
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            events = result.get("events")
            if events:
                events.fault = {}  # writing the result below is not a fault point
            result["events"] = {"io": events.io, "write": events.write, "names": list(events.names)} if events else None
            with open(result_path, "w") as f:
                json.dump(result, f)
        finally:
            os._exit(rc if isinstance(rc, int) else 1)


_case_ids = itertools.count()


def _start(req: dict, work: str, go_fd: int | None):
    case = next(_case_ids)
    paths = [os.path.join(work, f"{case}-{n}") for n in ("out", "err", "result")]
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    pid = os.fork()
    if pid == 0:
        _child(req, *paths, go_fd)
    for s, handler in saved.items():
        signal.signal(s, handler)
    return {"pid": pid, "req": req, "paths": paths, "t0": time.monotonic(), "status": None, "timed_out": False,
            "signalled_at": None}


def _wait(cases: list[dict]) -> None:
    """Wait for every child, sending the requested signals and enforcing timeouts."""
    while any(c["status"] is None for c in cases):
        for c in cases:
            if c["status"] is not None:
                continue
            pid, status = os.waitpid(c["pid"], os.WNOHANG)
            if pid:
                c["status"], c["seconds"] = status, time.monotonic() - c["t0"]
                continue
            elapsed = time.monotonic() - c["t0"]
            kill = c["req"].get("kill_after")
            if kill and c["signalled_at"] is None and elapsed >= kill[0]:
                os.kill(c["pid"], getattr(signal, kill[1]))
                c["signalled_at"] = elapsed
            if elapsed > c["req"].get("timeout", 120):
                c["timed_out"] = True
                os.kill(c["pid"], signal.SIGKILL)
        time.sleep(0.002)


def _answer(c: dict) -> dict:
    out_path, err_path, result_path = c["paths"]
    status = c["status"]
    answer = {"rc": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
              "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
              "timed_out": c["timed_out"], "seconds": c["seconds"], "signalled_at": c["signalled_at"]}
    for key, path in (("stdout", out_path), ("stderr", err_path)):
        try:
            with open(path, errors="replace") as f:
                answer[key] = f.read()
        except FileNotFoundError:
            answer[key] = ""
    try:
        with open(result_path) as f:
            answer.update(json.load(f))
    except (FileNotFoundError, json.JSONDecodeError):
        answer.update(exception=None, events=None, blocked=None)
    for path in c["paths"]:
        if os.path.exists(path):
            os.unlink(path)
    return answer


def main() -> None:
    work = tempfile.mkdtemp(prefix="fuselm-sandbox-")
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # stray prints must not corrupt the protocol
    proto.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    proto.flush()
    try:
        _serve(work, proto)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # (the cases' files are gone already: the folder itself)


def _serve(work: str, proto) -> None:
    for line in sys.stdin:
        req = json.loads(line)
        if "group" in req:
            r, w = os.pipe()
            cases = [_start(sub, work, r) for sub in req["group"]]
            os.close(r)
            time.sleep(0.05)
            os.write(w, b"x" * len(cases))
            os.close(w)
            _wait(cases)
            answer = [_answer(c) for c in cases]
        else:
            cases = [_start(req, work, None)]
            _wait(cases)
            answer = _answer(cases[0])
        proto.write(json.dumps(answer) + "\n")
        proto.flush()


if __name__ == "__main__":
    main()
