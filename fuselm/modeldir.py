"""The model directory contract (DESIGN.md): fuselm.json, tokenizer files, atomic writes."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

from .contract import META_NAME
from .errors import FuselmError, shown
from .genai_config import write_genai_config

SCHEMA_VERSION = 1
# Copied unchanged from the checkpoint into every model directory.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
_TMP_MARK = ".fuselm-tmp-"
_OLD = ".old."  # an OUT moved aside by a --force run; removed once the new OUT is in place


def read_meta(model_dir: str | os.PathLike) -> dict:
    """Read `fuselm.json` of a model directory; a clear error when it is missing or malformed."""
    path = Path(model_dir) / META_NAME
    if not path.is_file():
        raise FuselmError(f"{model_dir} is not a fuselm model directory: {META_NAME} is missing; "
                          "create one with `fuselm convert`")
    try:
        meta = json.loads(path.read_text())
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, deep nesting
        raise FuselmError(f"{path} is not valid JSON ({e}); re-create the directory with `fuselm convert`") from None
    if not isinstance(meta, dict) or meta.get("schema_version") != SCHEMA_VERSION:
        raise FuselmError(f"{path}: unsupported schema_version {meta.get('schema_version') if isinstance(meta, dict) else None!r}"
                          f" (this fuselm reads {SCHEMA_VERSION}); re-create it with this fuselm's `convert`")
    for key, (kind, ok) in _META_FIELDS.items():
        if key in meta and not ok(meta[key]):
            raise FuselmError(f"{path}: {key} = {shown(meta[key])} is not {kind}; the file is damaged, re-create "
                              "the directory with `fuselm convert`")
    return meta


def _count(v) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0)


def _token_ids(v) -> bool:
    return _count(v) or v == 0 or (isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                                                for i in v))


# The fields of fuselm.json (exporter/README.md) that fuselm reads back, and what they must hold.
_META_FIELDS = {
    "stage": ("a string", lambda v: isinstance(v, str)),
    "family": ("a string or null", lambda v: v is None or isinstance(v, str)),
    "dims": ("an object of positive integers", lambda v: isinstance(v, dict) and all(_count(x) for x in v.values())),
    "sliding_window": ("a positive integer or null", _count),
    "max_position_embeddings": ("a positive integer or null", _count),
    "tie_word_embeddings": ("true or false", lambda v: isinstance(v, bool)),
    "rope": ("an object", lambda v: isinstance(v, dict)),
    "quantization": ("an object with a string mode",
                     lambda v: isinstance(v, dict) and isinstance(v.get("mode", ""), str)),
    "special_tokens": ("an object of token ids", lambda v: isinstance(v, dict) and all(_token_ids(x) for x in v.values())),
    "graph": ("an object", lambda v: isinstance(v, dict)),
    "passes": ("a list", lambda v: isinstance(v, list)),
}


def write_meta(model_dir: str | os.PathLike, meta: dict) -> None:
    """Write fuselm.json and, from the same fields, genai_config.json (fuselm/genai_config.py), so
    onnxruntime-genai runs the directory as it is; model.onnx must be written first."""
    meta = {"schema_version": SCHEMA_VERSION, **meta}
    (Path(model_dir) / META_NAME).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    write_genai_config(model_dir, meta)


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy the tokenizer and generation-config files that exist in `src`, byte for byte.

    A file that links outside `src` is refused: the copy would carry whatever it points at (a key,
    a password file) into a model directory that users then share."""
    copied = []
    for name in TOKENIZER_FILES:
        s = Path(src) / name
        if s.is_file():
            if not within_checkpoint(s, src):
                raise FuselmError(f"{s} links to {s.resolve()}, outside {src}; refusing to copy it (copy the real "
                                  "file into the directory)")
            shutil.copyfile(s, Path(dst) / name)
            copied.append(name)
    return copied


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file, read a MiB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def within_checkpoint(path: str | os.PathLike, root: str | os.PathLike) -> bool:
    """Whether `path` resolves inside `root`, or, for a Hugging Face cache snapshot
    (`models--org--name/snapshots/REV`), inside that repository's `blobs` (where its links point)."""
    real, root = Path(path).resolve(), Path(root).resolve()
    if root in real.parents:
        return True
    return root.parent.name == "snapshots" and (root.parent.parent / "blobs") in real.parents


@contextlib.contextmanager
def atomic_output_dir(out: str | os.PathLike, force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside `out`; rename it to `out` only when the block succeeds.

    Nothing half-written ever appears at `out`: on any error (or interrupt) the temporary
    directory is removed, and leftovers of killed earlier runs (their process is gone) are removed
    first. A lock file beside `out` lets one writer in at a time; a second one stops with a clear
    error. With `force`, an existing `out` is replaced only after the new one is complete; a run
    killed between moving the old `out` aside and moving the new one in is undone by the next run,
    which puts the old `out` back first; `force` replaces only a fuselm model directory (or an
    empty one), never a folder of other files. An OSError (disk full, no permission) becomes a
    FuselmError once the temporary directory is removed. SIGINT / SIGTERM wait while the lock, the
    temporary directory or OUT is half changed; the work in between stays interruptible.
    """
    out = Path(out).absolute()
    _check_target(out, force)
    parent = out.parent
    created = [p for p in (parent, *parent.parents) if not p.exists()]  # removed again if the run fails
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FuselmError(f"Cannot create {parent}: {e.strerror}; choose a writable location") from None
    deferred = _DeferredSignals()
    deferred.start()
    done = False
    try:
        with _as_fuselm_error(out), _exclusive_lock(parent / f"{_TMP_MARK}{out.name}.lock", out):
            _restore_replaced(parent, out)
            _check_target(out, force)  # another writer may have finished while we waited for the lock
            _remove_stale_tmp(parent, out.name)
            tmp = parent / f"{_TMP_MARK}{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
            try:
                deferred.stop()
                yield tmp
                deferred.start()
                _move_in(tmp, out)
                done = True
            except BaseException:
                deferred.start()
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    finally:
        if not done:
            for p in created:  # deepest first; only if nothing else appeared in them
                with contextlib.suppress(OSError):
                    p.rmdir()
        deferred.stop()  # a signal that came meanwhile is delivered now


@contextlib.contextmanager
def _as_fuselm_error(out: Path) -> Iterator[None]:
    """An OSError (disk full, no permission) while writing OUT: exit 2 with a message, not a traceback."""
    try:
        yield
    except OSError as e:
        raise FuselmError(f"writing {out} failed: {e.strerror or e} ({e.filename or 'I/O'}); nothing was written "
                          "there; free disk space or choose another OUT, then run again") from None


class _DeferredSignals:
    """Between start() and stop(), SIGINT and SIGTERM are recorded instead of handled; stop() hands a
    recorded one to the handler that was in place. Main thread only (elsewhere Python cannot set handlers)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.saved: dict | None = None
        self.pending: list[int] = []

    def start(self) -> None:
        if self.saved is None and threading.current_thread() is threading.main_thread():
            self.saved = {s: signal.signal(s, lambda signum, frame: self.pending.append(signum)) for s in self.SIGNALS}

    def stop(self) -> None:
        if self.saved is None:
            return
        for s, handler in self.saved.items():
            signal.signal(s, handler)
        self.saved = None
        if self.pending:
            signum = self.pending[0]
            self.pending.clear()
            handler = signal.getsignal(signum)
            if callable(handler):
                handler(signum, None)  # default_int_handler: KeyboardInterrupt, here
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)


def _move_in(tmp: Path, out: Path) -> None:
    """Rename the finished `tmp` to `out`; an existing `out` is moved aside first and back on failure.

    The files reach the disk before the rename (fsync), so a crash or power loss after it cannot
    leave an OUT whose names are there but whose bytes are not."""
    for p in tmp.iterdir():
        _fsync(p)
    _fsync(tmp)
    if not out.exists():
        os.rename(tmp, out)
        _fsync(out.parent)
        return
    trash = out.parent / f"{_TMP_MARK}{out.name}{_OLD}{uuid.uuid4().hex[:8]}"
    os.rename(out, trash)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(trash, out)
        raise
    _fsync(out.parent)
    shutil.rmtree(trash, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_target(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise FuselmError(f"Cannot write to {out}: it exists; pass --force or choose another directory")
    if out.exists() and not out.is_dir():
        raise FuselmError(f"Cannot write to {out}: it is a file, not a directory; choose another path")
    if out.exists() and not (out / META_NAME).is_file() and any(out.iterdir()):
        raise FuselmError(f"Cannot replace {out}: it is not a fuselm model directory (no {META_NAME}) and not "
                          "empty; --force only replaces fuselm outputs. Choose another OUT or remove it yourself")


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path, out: Path) -> Iterator[None]:
    """flock on a file beside OUT: released by the kernel even when the holder is killed."""
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FuselmError(f"Cannot write to {out}: another fuselm process is writing it now; "
                              "wait for it to finish or choose another directory") from None
        # The holder before us may have unlinked the file: then our lock is on a dead inode.
        try:
            same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock_path)
        os.close(fd)


def _restore_replaced(parent: Path, out: Path) -> None:
    """OUT missing but an old OUT moved aside: a --force run was killed between its two renames."""
    if out.exists() or out.is_symlink():
        return
    old = sorted(parent.glob(f"{_TMP_MARK}{out.name}{_OLD}*"), key=lambda p: p.stat().st_mtime)
    if old:
        os.rename(old[-1], out)


def _remove_stale_tmp(parent: Path, name: str) -> None:
    """Remove temporary directories of earlier runs for the same OUT whose process is gone."""
    for p in parent.glob(f"{_TMP_MARK}{name}.*"):
        if p.name.endswith(".lock"):
            continue
        parts = p.name[len(_TMP_MARK) + len(name) + 1:].split(".")
        pid = int(parts[0]) if parts and parts[0].isdigit() else None
        if pid is not None and pid != os.getpid() and _alive(pid):
            continue
        shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
