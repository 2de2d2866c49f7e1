"""`fuselm run SPLIT`: one pipeline stage per rank over mx.distributed.

    fuselm split MODEL -o SPLIT --stages 2
    fuselm run SPLIT --prompt "..."                                                     # one machine
    mlx.launch --backend ring --hostfile hosts.json -- fuselm run SPLIT --prompt "..."   # two Macs

Started by no launcher, `run` starts one local rank per stage itself (pipeline_launch.py); under
mlx.launch (or any MLX_RANK + MLX_HOSTFILE) this process is one rank.

Rank r runs SPLIT/stage{r} on the engine `fuselm.load` gives it on the MLX backend (a stage graph takes the
hidden state in place of input_ids, returns it in place of logits: Session reads either). Every rank
gets the same command line, so all know the prompt, its chunks and --max-tokens.

- handshake: rank 0 sends its stage's description [stage, of, first layer, last layer, hidden,
  dtype, split id, doorbell port] to rank 1, which checks it against its own and passes its own on, around the
  ring back to rank 0: stages that are not the same split, not in rank order, or not one per rank
  stop every rank with a message before any work.
- prefill: rank 0 runs the prompt in chunks and sends each chunk's hidden state on while it runs the
  next, so the stages work on different chunks at once; the last rank keeps the last chunk's logits.
- decode: one token per step through the pipe: the last rank picks the token (on the device), prints
  it and sends it to rank 0, which embeds it. Each step is built as one lazy graph (receive ->
  stage -> send) before its message comes and runs when it does. Where the ranks outnumber the
  host's cores, a rank sleeps on a doorbell (`Bells`) until the sender rings: MLX's ring backend
  polls while a receive is pending, which would spin the core the working rank needs. A hidden-state message is [1, s, hidden] plus one column, a
  token message [token, stop]:
  the last rank sets stop on the device when it picks an eos token, and the flag travels down the
  pipe with the step built for it, which every rank ends with.
- every exchange has a deadline (--pipe-timeout, default 60 s: a peer that never started, a wrong
  hostfile, a rank that hangs): the waiting rank prints what it waited for and is ended by its
  watchdog process (SIGKILL, status 137), never hangs; mx.distributed.init gets the same deadline. A
  peer that exits breaks the connection: the ring backend's error becomes a message naming the rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
import zlib
from pathlib import Path

import numpy as np
from onnx import TensorProto

from fuselm import contract, switches
from fuselm.errors import FuselmError
from fuselm.modeldir import read_meta
from fuselm.options import Options
from fuselm.tokenizer import Detokenizer, encode_prompt, eos_ids, load_tokenizer

from . import kvcache
from .engines import load
from .pipeline_launch import LAUNCHED
from .sampling import Sampler

SPLIT_NAME = contract.SPLIT_NAME
DTYPES = {TensorProto.FLOAT: (0, np.float32), TensorProto.FLOAT16: (1, np.float16), TensorProto.BFLOAT16: (2, None)}
HANDSHAKE = ("stage", "of", "first layer", "last layer", "hidden", "dtype", "split id", "bell port")


def is_split(path) -> bool:
    """A `fuselm split` output (run it here); one of its stages alone is refused with the way to run it."""
    path = Path(path)
    if (path / SPLIT_NAME).is_file():
        return True
    if (path / contract.META_NAME).is_file() and (path.parent / SPLIT_NAME).is_file():
        stage = (read_meta(path).get("pipeline") or {}).get("stage")
        if stage is not None:
            raise FuselmError(f"{path} is stage {stage} of the split {path.parent}; one stage cannot generate alone: "
                              f"run `fuselm run {path.parent} ...`")
    return False


# The watchdog runs in its own small process: a blocked mx.distributed call holds the GIL, so no thread
# (and no signal handler) of this process would run while it waits. Arming it is a write into a
# shared page (no system call per exchange): [deadline (monotonic seconds, 0: off), length, message].
_WATCHDOG = """
import mmap, os, signal, struct, sys, time
parent, path = int(sys.argv[1]), sys.argv[2]
with open(path, "r+b") as f:
    page = mmap.mmap(f.fileno(), 4096)
os.unlink(path)
while os.getppid() == parent:
    until, n = struct.unpack_from("dI", page, 0)
    if until and time.monotonic() > until:
        sys.stderr.write(page[16:16 + n].decode(errors="replace") + "\\n")
        sys.stderr.flush()
        os.kill(parent, signal.SIGKILL)
        break
    time.sleep(0.1)
"""


class PeerLost(FuselmError):
    """This rank's connection to another broke: that rank's end, not this one's, is the cause (the launcher
    reports the other rank's error when it has one)."""


class Deadline:
    """While armed (`with deadline("what we wait for"):`), a wait longer than `seconds` prints what was
    awaited and ends this rank (SIGKILL from the watchdog process: a blocked call cannot be interrupted)."""

    def __init__(self, seconds: float, rank: int):
        import mmap
        import struct
        import subprocess
        import tempfile

        self.seconds, self.rank, self.struct = seconds, rank, struct
        fd, path = tempfile.mkstemp(prefix="fuselm-watchdog-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        os.write(fd, bytes(4096))
        self.page = mmap.mmap(fd, 4096)
        os.close(fd)
        self.proc = subprocess.Popen([sys.executable, "-S", "-c", _WATCHDOG, str(os.getpid()), path])
        self.what = ""

    def __call__(self, what: str) -> Deadline:
        self.what = what
        return self

    def __enter__(self):
        message = (f"fuselm run: error: rank {self.rank}: {self.what} did not come within {self.seconds:g} s; a rank "
                   "failed or was not started, or the hostfile does not list these processes (start them with "
                   "`mlx.launch -n N --backend ring -- fuselm run SPLIT ...`; --pipe-timeout sets the wait)")
        data = message.encode()[:4096 - 16]
        self.page[16:16 + len(data)] = data
        self.struct.pack_into("dI", self.page, 0, time.monotonic() + self.seconds, len(data))
        return self

    def __exit__(self, *exc):
        self.struct.pack_into("d", self.page, 0, 0.0)


_GROUP: list = []  # the process's one group: a second mx.distributed.init would open new connections
_DEADLINE: list = []  # and its one watchdog


def deadline(seconds: float, rank: int) -> Deadline:
    if not _DEADLINE:
        _DEADLINE.append(Deadline(seconds, rank))
    _DEADLINE[0].seconds, _DEADLINE[0].rank = seconds, rank
    return _DEADLINE[0]


def init_group(timeout: float):
    """mx.distributed's ring group under a deadline, once per process; (group, rank, size)."""
    import mlx.core as mx

    if not os.environ.get("MLX_RANK") and not os.environ.get("OMPI_COMM_WORLD_RANK"):
        return None, 0, 1
    rank = int(os.environ.get("MLX_RANK", "0"))
    if not _GROUP:
        with deadline(timeout, rank)("the connection to the other ranks (mx.distributed.init)"):
            try:
                _GROUP.append(mx.distributed.init(strict=True, backend=os.environ.get("FUSELM_MLX_BACKEND", "ring")))
            except (RuntimeError, ValueError) as e:
                raise FuselmError(f"rank {rank}: mx.distributed.init failed ({e}); check the hostfile "
                                  f"(MLX_HOSTFILE={os.environ.get('MLX_HOSTFILE')})") from None
    group = _GROUP[0]
    return group, group.rank(), group.size()


class Bells:
    """A doorbell beside the ring's connections, from each rank to the next.

    MLX's ring backend polls its socket while a receive is pending, so a rank waiting for its message keeps a
    core busy, the one the working rank needs where ranks share a host's cores. So a rank sleeps on a blocking
    socket of its own (`wait`) until the rank before it, its send finished, writes one byte (`ring`). The data
    still goes over mx.distributed; a bell carries none. Only for the ring backend, whose hostfile names each
    rank's address."""

    def __init__(self, rank: int, size: int, hosts: list[str]):
        self.rank, self.size, self.hosts = rank, size, hosts
        self.listener = socket.create_server((hosts[rank], 0))
        self.port = self.listener.getsockname()[1]
        self.to_next = self.from_prev = None

    @classmethod
    def open(cls, rank: int, size: int) -> Bells | None:
        """A listening bell for the ring backend when all ranks share this host and, with the launcher,
        outnumber its cores (mlx.launch spins a core of its own; fuselm's launcher does not). Every rank
        decides the same; FUSELM_PIPE_BELLS=on/off, set alike on every rank, overrides the choice."""
        hosts = _ring_hosts()
        if os.environ.get("FUSELM_MLX_BACKEND", "ring") != "ring" or not hosts or len(hosts) != size:
            return None
        wanted = switches.setting("FUSELM_PIPE_BELLS")
        if wanted is None:
            spinning_launcher = 0 if os.environ.get(LAUNCHED) else 1
            wanted = len(set(hosts)) == 1 and size + spinning_launcher > (os.cpu_count() or 1)
        return cls(rank, size, hosts) if wanted else None

    def connect(self, prev_port: int, timeout: float) -> None:
        """Connect to the rank before (its port came in the handshake), then take the next rank's connection."""
        prev = (self.rank - 1) % self.size
        self.from_prev = socket.create_connection((self.hosts[prev], prev_port), timeout=timeout)
        self.listener.settimeout(timeout)
        self.to_next, _ = self.listener.accept()
        self.listener.close()
        for s in (self.from_prev, self.to_next):
            s.settimeout(None)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def ring(self) -> None:
        self.to_next.sendall(b"\1")

    def wait(self) -> None:
        if not self.from_prev.recv(1):
            raise RuntimeError("the doorbell's connection was closed")


def _ring_hosts() -> list[str] | None:
    """Each rank's host in the ring hostfile mlx.launch wrote (MLX_HOSTFILE: per rank a list of "ip:port")."""
    try:
        return [h[0].rsplit(":", 1)[0].strip("[]") for h in _hostfile()]
    except (TypeError, IndexError, KeyError, AttributeError):
        return None


def _hostfile():
    """The parsed MLX_HOSTFILE (None when unset, unreadable or no JSON: mx.distributed.init names that)."""
    path = os.environ.get("MLX_HOSTFILE")
    try:
        return json.loads(Path(path).read_text() or "[]") if path else None
    except (OSError, ValueError):
        return None


class Pipe:
    """One rank's end of the pipe: its stage's Session and its neighbours."""

    def __init__(self, split_dir: Path, group, rank: int, size: int, options: Options):
        import mlx.core as mx

        self.mx, self.group, self.rank, self.size = mx, group, rank, size
        split = json.loads((split_dir / SPLIT_NAME).read_text())
        of = len(split["stages"])
        if size != of:
            raise FuselmError(f"{split_dir} has {of} stages but {size} processes were started; start one per stage "
                              f"(mlx.launch -n {of} or a hostfile of {of} hosts)")
        self.dir = split_dir / f"stage{rank}"
        if not self.dir.is_dir():
            raise FuselmError(f"rank {rank}: {self.dir} is missing; copy the split directory (at least stage{rank}/) "
                              "to this machine at the same path")
        self.info = read_meta(self.dir).get("pipeline") or {}
        if self.info.get("stage") != rank or self.info.get("of") != of:
            raise FuselmError(f"{self.dir}/fuselm.json says stage {self.info.get('stage')} of {self.info.get('of')}; "
                              f"rank {rank} needs stage {rank} of {of}: re-run `fuselm split`")
        self.sess = load(self.dir, options.replace(backend="mlx")).session
        self.first, self.last = rank == 0, rank == size - 1
        self.deadline = deadline(options.pipe_timeout, rank)
        ins = self.sess.lm.input_types
        elem = ins[contract.HIDDEN][0] if contract.HIDDEN in ins else \
            next(v for k, v in ins.items() if contract.is_step_past(k))[0]
        if elem not in DTYPES:
            raise FuselmError(f"{self.dir}: hidden state of type {elem}; the pipe carries float32 / float16 / bfloat16")
        self.dtype_code, np_dtype = DTYPES[elem]
        self.width = int(self.info["hidden"])
        zero = np.zeros((1, 1, 1), np_dtype or np.float32)
        self.msg_dtype = self.sess.backend.asarray(zero).dtype if elem != TensorProto.BFLOAT16 else mx.bfloat16
        self.bells = None  # set up by the handshake

    # --- messages -------------------------------------------------------------------------------
    def _send(self, x, dst):
        with self.waiting(f"sending to rank {dst}", dst):
            self.run(self.mx.distributed.send(x, dst, group=self.group), ring=True)

    def _recv(self, shape, dtype, src, what: str):
        with self.waiting(what, src):
            x = self.mx.distributed.recv(shape, dtype, src, group=self.group)
            self.run(x, wait=True)
        return x

    def run(self, step, wait: bool = False, ring: bool = False) -> None:
        """Evaluate a built step (lazy receive -> stage -> send): `wait`, it receives from the rank before,
        so first sleep until that rank rings (its message is then here); `ring`, it sends to the next rank,
        so ring it once sent."""
        if wait and self.bells is not None:
            self.bells.wait()
        self.mx.eval(step)
        if ring and self.bells is not None:
            self.bells.ring()

    @contextlib.contextmanager
    def waiting(self, what: str, peer: int):
        """Work that may wait for `peer`: under the deadline, a broken connection named."""
        with self.deadline(what):
            try:
                yield
            except RuntimeError as e:  # the ring backend's "connection to a peer was lost"
                raise PeerLost(f"rank {self.rank}: the connection to rank {peer} broke ({e}); that rank exited or "
                               "died (its own output says why)") from None

    def send_hidden(self, h, stop=None):
        """Send the hidden state on with its stop column (`stop`: a device array, lazily, at decode; a
        prefill chunk is sent and waited for). Returns the lazy send at decode."""
        mx = self.mx
        h = h.reshape(1, -1, self.width).astype(self.msg_dtype)
        if stop is None:
            self._send(mx.concatenate([h, mx.zeros((1, h.shape[1], 1), dtype=self.msg_dtype)], axis=-1),
                       self.rank + 1)
            return None
        flag = mx.broadcast_to(stop.reshape(1, 1, 1).astype(self.msg_dtype), (1, h.shape[1], 1))
        return self.send(mx.concatenate([h, flag], axis=-1), self.rank + 1)

    def send(self, x, dst):
        """A lazy send: it runs when the step is evaluated (`run`), after the step that computes x."""
        return self.mx.distributed.send(x, dst, group=self.group)

    def recv_lazy(self, shape, dtype, src):
        """A lazy receive: the step is built on it before the message comes, and run when it is rung."""
        return self.mx.distributed.recv(shape, dtype, src, group=self.group)

    @staticmethod
    def stopped(message) -> bool:
        """The stop flag of a received message (a step already run)."""
        return bool(message.reshape(-1)[-1].item())

    def recv_hidden(self, rows: int, what: str):
        """A prefill chunk's hidden state [1, rows, width] from the rank before (its stop column unread)."""
        return self._recv((1, rows, self.width + 1), self.msg_dtype, self.rank - 1, what)[..., :self.width]

    def handshake(self, split_id: int, timeout: float) -> None:
        bells = Bells.open(self.rank, self.size)
        mine = [self.rank, self.size, *self.info["layers"], self.width, self.dtype_code, split_id,
                bells.port if bells else 0]
        prev = (self.rank - 1) % self.size
        own = self.mx.array(np.asarray(mine, np.int64))
        if self.first:
            self._send(own, 1)
        got = [int(v) for v in np.array(self._recv((len(mine),), self.mx.int64, prev,
                                                   f"the handshake from rank {prev}"))]
        if not self.first:
            self._send(own, (self.rank + 1) % self.size)
        want = {"stage": prev, "of": self.size, "hidden": self.width, "dtype": self.dtype_code, "split id": split_id}
        if not self.first:
            want["last layer"] = self.info["layers"][0] - 1
        theirs = dict(zip(HANDSHAKE, got, strict=True))
        bad = [f"{k} {theirs[k]} (expected {v})" for k, v in want.items() if theirs[k] != v]
        if bad:
            # this rank exits; the ranks after it see the connection break (or their deadline pass)
            raise FuselmError(f"rank {self.rank}: rank {prev} runs a stage that does not fit: {', '.join(bad)}; every "
                              "rank needs the same `fuselm split` output, stage r on rank r, and the same --dtype")
        if bells is not None and theirs["bell port"]:
            with self.deadline(f"the doorbell connections to ranks {prev} and {(self.rank + 1) % self.size}"):
                try:
                    bells.connect(theirs["bell port"], timeout)
                except OSError as e:
                    raise FuselmError(f"rank {self.rank}: the doorbell connection to rank {prev} failed ({e}); every "
                                      "rank needs the same fuselm, and the hosts must reach each other on any TCP "
                                      "port") from None
            self.bells = bells


def _check_hostfile(n_stages: int) -> None:
    """The ring hostfile mlx.launch wrote (MLX_HOSTFILE: one list of addresses per rank) must have one entry
    per stage; a wrong one would otherwise only show as a wait."""
    path, hosts = os.environ.get("MLX_HOSTFILE"), _hostfile()
    if isinstance(hosts, list) and hosts and len(hosts) != n_stages:
        raise FuselmError(f"the hostfile (MLX_HOSTFILE={path}) lists {len(hosts)} ranks but the model is split into "
                          f"{n_stages} stages; give mlx.launch one host per stage")


def run(split_dir, prompt=None, options: Options | None = None, chat: bool = False, stream=None,
        quiet: bool = False) -> dict:
    """Generate with one stage per rank (this process is one rank); the last rank prints the tokens.
    Started by no launcher, it starts the ranks itself on this machine (pipeline_launch.py)."""
    options = options or Options()
    if options.backend not in ("auto", "mlx"):
        raise FuselmError(f"a split model runs on MLX's distributed layer; --backend {options.backend} cannot run it")
    if options.profile:
        raise FuselmError("--profile is not available for a split model; profile one stage's graph by running the "
                          "unsplit model")
    if options.speculative:
        raise FuselmError("--speculative is not available for a split model; run the unsplit model")
    max_tokens = options.max_tokens
    sampler = Sampler(options.temperature, options.top_k, options.top_p, options.seed)
    split_dir = Path(split_dir)
    n_stages = len(json.loads((split_dir / SPLIT_NAME).read_text())["stages"])
    _check_hostfile(n_stages)
    group, rank, size = init_group(options.pipe_timeout)
    if group is None:
        from . import pipeline_launch

        return pipeline_launch.launch(n_stages, {"split_dir": str(split_dir), "prompt": prompt, "chat": chat,
                                                 "quiet": quiet, "options": options.to_dict()}, stream)
    pipe = Pipe(split_dir, group, rank, size, options)
    sess, b = pipe.sess, pipe.sess.backend
    tok = load_tokenizer(pipe.dir, required=isinstance(prompt, str), chat=chat)
    ids = encode_prompt(tok, prompt, chat)
    stops = set() if options.ignore_eos else eos_ids(pipe.dir, sess.meta, tok)
    pipe.handshake(zlib.crc32((split_dir / SPLIT_NAME).read_bytes()) & 0x7FFFFFFF, options.pipe_timeout)
    sess.reset(len(ids) + max_tokens)
    chunk = sess.prefill_chunk
    chunks = [ids[i:i + chunk] for i in range(0, len(ids), chunk)]
    log = (lambda m: None) if quiet else (lambda m: print(f"[rank {rank}] {m}", file=sys.stderr, flush=True))
    log(f"stage {rank} of {size} (layers {pipe.info['layers'][0]}-{pipe.info['layers'][1]}): {sess.describe()}")
    out = stream or sys.stdout
    t0 = time.perf_counter()
    generated: list[int] = []
    stamps: list[float] = []  # when each token was printed (the last rank)
    if pipe.first:
        for part in chunks:
            pipe.send_hidden(sess._step_dynamic(part))
            b.sync(list(sess.buffers.values()))
        last = pipe.size - 1
        for _ in range(max_tokens - 1):
            with pipe.waiting(f"the next token from rank {last}", last):
                # the step is built before its token arrives: the host builds it while the pipe works
                message = pipe.recv_lazy((2,), pipe.mx.int32, last)  # [token, stop]
                h = sess.decode(message[:1].astype(pipe.mx.int64))
                pipe.run(pipe.send_hidden(h, stop=message[1:]), wait=True, ring=True)
                if stops and pipe.stopped(message):
                    break
    else:
        logits = None
        for k, part in enumerate(chunks):
            h = pipe.recv_hidden(len(part), f"prefill chunk {k} from rank {rank - 1}")
            y = sess._step_dynamic(h)
            if pipe.last:
                logits = y
            else:
                pipe.send_hidden(y)
            b.sync(list(sess.buffers.values()))
        detok = Detokenizer(tok)
        stop_ids = pipe.mx.array(sorted(stops) or [-1], dtype=pipe.mx.int32)
        for n in range(max_tokens):
            with pipe.waiting(f"decode step {n} from rank {rank - 1}", rank - 1):
                if n:
                    message = pipe.recv_lazy((1, 1, pipe.width + 1), pipe.msg_dtype, rank - 1)
                    y = sess.decode(message[..., :pipe.width])
                    if not pipe.last:
                        pipe.run(pipe.send_hidden(y, stop=message[..., pipe.width:]), wait=True, ring=True)
                        if stops and pipe.stopped(message):
                            break
                        continue
                    logits = y
                elif not pipe.last:
                    continue
                picked = b.pick_token(logits, sampler).reshape(1).astype(pipe.mx.int32)
                step = picked
                if n + 1 < max_tokens:  # rank 0 embeds it while this rank prints it
                    stop = (picked == stop_ids).any().reshape(1).astype(pipe.mx.int32)
                    step = [picked, pipe.send(pipe.mx.concatenate([picked, stop]), 0)]
                pipe.run(step, wait=n > 0, ring=n + 1 < max_tokens)
                token = b.item(picked)
            if token < 0:
                raise FuselmError(f"the model produced NaN or infinite logits at step {n}")
            stamps.append(time.perf_counter())
            generated.append(token)
            out.write(detok.add(token))
            out.flush()
            if token in stops:
                if n + 1 < max_tokens:  # the step rank 0 queued for the stop token comes round; end with it
                    pipe._recv((1, 1, pipe.width + 1), pipe.msg_dtype, rank - 1, "the end of the pipe")
                break
    now = time.perf_counter()
    import resource

    result = {"rank": rank, "stages": size, "what": sess.describe(), "tokens": generated, "prompt_tokens": len(ids),
              # what this rank held
              "memory": {"mlx_peak_bytes": int(pipe.mx.get_peak_memory()),
                         # what it holds once generating: its weights as MLX holds them (prepared weights are
                         # mapped lazily, so after load it may hold none yet) and the cache
                         "held_bytes": int(pipe.mx.get_active_memory()),
                         "cache_bytes": sum(kvcache.nbytes(b, v) for v in {id(v): v for v in sess.buffers.values()}.values()),
                         "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}}
    if pipe.last:
        out.write("\n")
        out.flush()
        decode_n, t_first = len(generated) - 1, stamps[0]
        result.update(text=tok.decode(generated, skip_special_tokens=True) if tok is not None else None,
                      prefill_tok_s=len(ids) / max(t_first - t0, 1e-9),
                      decode_tok_s=decode_n / (now - t_first) if decode_n else None,
                      token_seconds=[b2 - a2 for a2, b2 in zip(stamps, stamps[1:], strict=False)])
        log(f"prefill {len(ids)} tokens: {result['prefill_tok_s']:.1f} tok/s · decode {decode_n} tokens: "
            + (f"{result['decode_tok_s']:.1f} tok/s" if decode_n else "n/a"))
    return result


def rank_main() -> None:
    """One rank started by pipeline_launch.launch: argv is [run.json, result.json]."""
    run_json, out = sys.argv[1:3]
    args = json.loads(Path(run_json).read_text())
    try:
        result = run(args["split_dir"], args["prompt"], Options.from_dict(args["options"]), args["chat"], None,
                     args["quiet"])
    except FuselmError as e:
        Path(out).write_text(json.dumps({"error": str(e), "peer_lost": isinstance(e, PeerLost)}))
        sys.exit(e.exit_code)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank (one process group); the launcher says it once
        sys.exit(130)
    Path(out).write_text(json.dumps(result))
