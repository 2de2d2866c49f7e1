"""A model ready to generate: graph + backend + preallocated KV cache, prefill and decode steps.

    sess = Session("qwen3-opt", backend="auto")
    sess.reset(max_len=256)
    logits = sess.prefill([1, 2, 3])      # chunked; logits of the last prompt token
    logits = sess.decode(next_token)      # one token; static shapes, one plan reused every step

The graph contract (DESIGN.md) is checked at load: input_ids, attention_mask, position_ids,
past_key_values.{i}.key/.value in; logits and present.{i}.key/.value out.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np
import psutil
from onnx import TensorProto

from fuselm.errors import FuselmError

from . import graph as graph_mod
from . import loader
from .backends import make_backend
from .compiled import CompiledDecode, agrees
from .executor import Executor, Profiler
from . import kvcache
from .kvcache import CacheView

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
PREFILL_CHUNK = 512


@dataclass
class CacheSpec:
    name: str  # graph input
    present: str  # graph output
    heads: int
    head_dim: int
    dtype: int


class Session:
    """Loads a model directory or .onnx file onto a backend and runs prefill / decode steps."""

    def __init__(self, path: str | os.PathLike, backend: str = "auto", device: str | None = None,
                 fused: bool = True, static_decode: bool = True, compile: bool | None = None,
                 threads: int | None = None, kv_bits: int | None = None, kv_bits_k: int | None = None,
                 kv_bits_v: int | None = None, kv_group_size: int | None = None):
        self.kv_formats = kvcache.formats(kv_bits, kv_bits_k, kv_bits_v, kv_group_size)  # (key, value)
        self.lm = loader.load(path)
        self.meta = self.lm.meta or {}
        self.backend = make_backend(backend, device)
        self.caches = self._check_contract()
        try:
            self.graph = graph_mod.build(self.lm, self.backend, fused=fused)
        except Exception as e:  # load-time rewrites on attributes the checker lets through (a negative block size)
            if isinstance(e, FuselmError):
                raise
            raise FuselmError(f"{self.lm.path} cannot be prepared for the runtime ({type(e).__name__}: {str(e)[:300]}); "
                              "the graph is invalid, or uses an op in a form the runtime does not support") from e
        self.executor = Executor(self.graph, self.backend)
        self.fused = fused
        self.in_place = self._in_place_ok()
        kvcache.check_formats(self.backend, self.kv_formats, [c.head_dim for c in self.caches], self.in_place,
                              self.lm.path)
        window = self.meta.get("sliding_window")
        self.window = int(window) if window else None
        self.static_decode = static_decode and self.in_place
        self.static_checked = False
        self.profiler = Profiler()
        self.executor.profiler = self.profiler
        self.max_len = 0
        self.pos = 0
        self.compile = _compile_default(self.backend) if compile is None else bool(compile)
        self.compiled: CompiledDecode | None = None
        self.compile_failed: str | None = None
        self.threads = None
        if self.backend.name == "torch" and self.backend.device == "cpu":
            import torch

            from .backends.torch_quant import set_kernel_threads

            self.threads = threads or int(os.environ.get("FUSELM_THREADS", "0") or 0) or torch.get_num_threads()
            set_kernel_threads(self.threads)

    # --- contract ------------------------------------------------------------------------------
    def _check_contract(self) -> list[CacheSpec]:
        ins, outs = self.lm.input_types, set(self.lm.output_names)
        missing = [n for n in ("input_ids", "attention_mask", "position_ids") if n not in ins]
        missing += [n for n in ("logits",) if n not in outs]
        specs = []
        for name, (elem, dims) in sorted(ins.items(), key=lambda kv: _cache_order(kv[0])):
            m = _PAST.match(name)
            if not m:
                continue
            present = f"present.{m.group(1)}.{m.group(2)}"
            if present not in outs:
                missing.append(present)
            if len(dims) != 4 or not isinstance(dims[1], int) or not isinstance(dims[3], int):
                raise FuselmError(f"graph input {name} has shape {dims}; the contract needs [batch, kv_heads, past, "
                                  "head_dim] with fixed kv_heads and head_dim")
            specs.append(CacheSpec(name, present, dims[1], dims[3], elem))
        if not specs:
            missing.append("past_key_values.{i}.key/.value")
        unknown = [n for n in ins if n not in ("input_ids", "attention_mask", "position_ids") and not _PAST.match(n)]
        if missing or unknown:
            what = (f"missing {', '.join(missing)}" if missing else "") + \
                   ("; " if missing and unknown else "") + (f"unexpected inputs {unknown}" if unknown else "")
            raise FuselmError(f"{self.lm.path} does not follow the fuselm graph contract ({what}); inputs must be "
                              "input_ids, attention_mask, position_ids, past_key_values.{i}.key/.value and outputs "
                              "logits, present.{i}.key/.value (DESIGN.md); re-export with `fuselm convert`")
        _check_declared(ins)
        return specs

    def _in_place_ok(self) -> bool:
        """The cache can live in preallocated buffers when the graph only appends to it."""
        names = {c.name for c in self.caches}
        for n in self.graph.nodes:
            for pos, x in enumerate(n.inputs):
                if x not in names:
                    continue
                ok = (n.op_type == "KVAppend" and pos == 0) or n.op_type == "Shape" or \
                    (n.op_type == "Attention" and not n.domain and pos in (4, 5))
                if not ok:
                    return False
        return True

    # --- state -----------------------------------------------------------------------------
    def reset(self, max_len: int) -> None:
        """Empty the cache and preallocate room for `max_len` tokens."""
        b = self.backend
        self.max_len, self.pos = int(max_len), 0
        need = sum(kvcache.cache_bytes((1, c.heads, self.max_len, c.head_dim), c.dtype, self._kv_format(c))
                   for c in self.caches) if self.in_place else 0
        free = psutil.virtual_memory().available
        if need > free:  # refuse before allocating (a huge --max-tokens, or absurd cache dims in the graph)
            raise FuselmError(f"the KV cache for {self.max_len:,} tokens needs {need / 2**30:,.1f} GiB, more than the "
                              f"{free / 2**30:.1f} GiB of free memory; lower --max-tokens (or --tokens)")
        if self.in_place:
            self.buffers = {c.name: kvcache.make_cache(b, (1, c.heads, self.max_len, c.head_dim), c.dtype,
                                                       self._kv_format(c)) for c in self.caches}
        else:
            self.buffers = {c.name: b.full((1, c.heads, 0, c.head_dim), 0, c.dtype) for c in self.caches}
        self._static_mask = None

    def _kv_format(self, c: CacheSpec) -> kvcache.KVFormat:
        return self.kv_formats[c.name.endswith(".value")]

    def _ids(self, ids, dtype=np.int64):
        return self.backend.asarray(np.asarray(ids, dtype).reshape(1, -1))

    def _run(self, ids: list[int], pos, mask, positions, views: dict, static: bool) -> object:
        feeds = {"input_ids": self._ids(ids), "attention_mask": mask, "position_ids": positions, **views}
        self.executor.ctx["rope_offset"] = pos
        out = self.executor.run(feeds)
        if self.in_place:
            for name, view in views.items():
                self.buffers[name] = view.buffer
        else:
            for c in self.caches:
                self.buffers[c.name] = out[c.present]
        return out["logits"]

    def _cpu_threads(self, n: int) -> None:
        # decode on CPU: torch's pool at one thread (tiny ops lose to fork/join), the matmul kernels
        # keep all cores; prefill: torch's GEMMs get all cores too
        if self.threads is not None:
            import torch

            if torch.get_num_threads() != n:
                torch.set_num_threads(n)

    def prefill(self, ids: list[int], chunk: int = PREFILL_CHUNK):
        """Run the prompt in chunks; returns the logits of its last token (backend array [vocab])."""
        self._cpu_threads(self.threads or 1)
        if not ids:
            raise FuselmError("the prompt is empty; pass --prompt text or --prompt-ids")
        if self.pos + len(ids) > self.max_len:
            raise FuselmError(f"{self.pos + len(ids)} tokens exceed the cache ({self.max_len}); call reset with more")
        logits = None
        for start in range(0, len(ids), chunk):
            part = ids[start:start + chunk]
            logits = self._step_dynamic(part)
        return logits

    def _step_dynamic(self, part: list[int]):
        b, s, pos = self.backend, len(part), self.pos
        mask = self._ids(np.ones(pos + s))
        positions = self._ids(np.arange(pos, pos + s))
        if self.in_place:
            views = {c.name: CacheView(self.buffers[c.name], pos, s) for c in self.caches}
        else:
            views = dict(self.buffers)
        logits = self._run(part, pos, mask, positions, views, static=False)
        self.pos += s
        return b.slice(logits, (0, s - 1))

    def decode(self, token: int):
        """One decode step; returns the logits of the new token (backend array [vocab])."""
        if self.pos + 1 > self.max_len:
            raise FuselmError(f"the cache is full ({self.max_len} tokens); reset with a larger max_len")
        self._cpu_threads(1)
        if not self._use_static():
            return self._step_dynamic([token])
        if not self.static_checked:
            return self._checked_static(token)
        return self._step_static(token)

    def _use_static(self) -> bool:
        # a sliding-window mask is computed from the cache index: static shapes would move the query
        # to the end of the buffer, so the window only stays right while the buffer fits in it
        return self.static_decode and (self.window is None or self.max_len <= self.window)

    def _step_static(self, token: int):
        b, pos = self.backend, self.pos
        if self._static_mask is None:
            self._static_mask = np.zeros((1, self.max_len), np.int64)
        self._static_mask[0, : pos + 1] = 1
        pos_dev = b.asarray(np.array(pos, np.int64))
        args = (self._ids([token]), b.asarray(self._static_mask), self._ids([pos]), pos_dev)
        if self.compiled is not None and self.compiled.fn is not None and not self.profiler.enabled:
            logits, bufs = self.compiled(*args, [self.buffers[c.name] for c in self.caches])
            self.buffers = {c.name: buf for c, buf in zip(self.caches, bufs, strict=True)}
        else:
            views = {c.name: CacheView(self.buffers[c.name], pos_dev, 1, static=True) for c in self.caches}
            logits = self._run([token], pos_dev, args[1], args[2], views, static=True)
            if self.compile and self.compiled is None and self.static_checked and self.compile_failed is None:
                self._build_compiled(args, logits)
        self.pos += 1
        return b.slice(logits, (0, 0))

    def _build_compiled(self, args: tuple, eager_logits) -> None:
        """Compile the static step with this step's inputs; keep it only if it reproduces the eager logits.

        Re-running the step is harmless: it writes the same keys and values into the same cache rows."""
        plan = self.executor.plan_for({"input_ids": args[0], "attention_mask": args[1], "position_ids": args[2],
                                       **{c.name: CacheView(self.buffers[c.name], args[3], 1, static=True)
                                          for c in self.caches}})
        compiled = CompiledDecode(self, plan)
        try:
            compiled.build(args + tuple(self.buffers[c.name] for c in self.caches))
            logits, _ = compiled(*args, [self.buffers[c.name] for c in self.caches])
        except Exception as e:  # noqa: BLE001 - a compiler failure must not stop generation
            self.compile_failed = f"{type(e).__name__}: {e}"[:300]
            return
        if not agrees(self.backend, eager_logits, logits, tol=self._tolerance()):
            d = np.abs(np.asarray(self.backend.to_numpy(eager_logits), np.float64)
                       - np.asarray(self.backend.to_numpy(logits), np.float64)).max()
            self.compile_failed = f"compiled logits differ from the eager step by {d:.3g}"
            return
        self.compiled = compiled

    def _tolerance(self) -> float:
        """How far two orders of the same float work may drift, as a share of the largest logit: bf16
        activations (CUDA tinygemm / bf16 weights) round at every matmul, and a last-bit difference
        upstream (attention over a padded static buffer vs the exact length) flips roundings that
        grow over the layers (4B-shaped, 36 layers: beyond 1e-3); f32 paths stay within 1e-3."""
        bf16 = any(n.attrs["weight"].kind in ("tinygemm", "dequant-bf16") for n in self.graph.nodes
                   if n.op_type == "QMatMul")
        return 3e-2 if bf16 else 1e-3

    def _checked_static(self, token: int):
        """First decode step: run it dynamic and static; keep static decode only if both agree.

        This proves, for each model, that its mask logic survives static shapes (graphs from other
        exporters may derive positions from shapes in ways that do not)."""
        b = self.backend
        pos = self.pos
        saved = {k: kvcache.snapshot(b, v, pos, pos + 1) for k, v in self.buffers.items()}
        dyn = b.to_numpy(self._step_dynamic([token])).astype(np.float64)
        self.buffers = {k: kvcache.restore(b, self.buffers[k], v) for k, v in saved.items()}
        self.pos = pos
        out = self._step_static(token)
        st = b.to_numpy(out).astype(np.float64)
        scale = max(1.0, float(np.abs(dyn).max()))
        self.static_checked = True
        if not np.allclose(dyn, st, atol=self._tolerance() * scale, rtol=0):
            self.static_decode = False
        return out

    def logits_to_numpy(self, logits) -> np.ndarray:
        return np.asarray(self.backend.to_numpy(logits), dtype=np.float32).reshape(-1)

    def describe(self) -> str:
        b = self.backend
        kind = {w.kind for n in self.graph.nodes if n.op_type == "QMatMul" for w in [n.attrs["weight"]]}
        extra = f", quantized matmul: {'/'.join(sorted(kind))}" if kind else ""
        mode = "static-shape decode" if self._use_static() else "dynamic decode"
        if self._use_static() and self.compile:
            mode += (f", compiled: {self.compiled.what}" if self.compiled is not None else ", compiles after the first decode steps") \
                if self.compile_failed is None else f", compile failed ({self.compile_failed})"
        kv = kvcache.describe(self.kv_formats, self.caches[0].dtype, self.caches[0].head_dim) if self.caches else "-"
        return f"{b.name} on {b.device} ({'fused kernels' if self.fused else 'no fused kernels'}, {mode}{extra}, " \
               f"KV cache {kv})"


def kv_options(kv_bits=None, kv_bits_k=None, kv_bits_v=None, kv_group_size=None) -> dict:
    """The KV cache keywords run/validate pass on to Session (any other keyword is a TypeError, as before)."""
    return {"kv_bits": kv_bits, "kv_bits_k": kv_bits_k, "kv_bits_v": kv_bits_v, "kv_group_size": kv_group_size}


def _compile_default(backend) -> bool:
    """mx.compile and CUDA graphs are cheap to build; inductor on CPU takes ~45 s for a 28-layer model,
    so there it is opt-in (FUSELM_COMPILE=1 or compile=True)."""
    env = os.environ.get("FUSELM_COMPILE", "")
    if env:
        return env not in ("0", "false", "no")
    return backend.name == "mlx" or backend.device.startswith("cuda")


def _check_declared(ins: dict) -> None:
    """The inputs' declared types and static dims must admit what the session feeds: int64 ids [1, n],
    float caches [1, kv_heads, past, head_dim] (dims without a size, `[]`, admit anything)."""
    for name, (elem, dims) in ins.items():
        ids = not _PAST.match(name)
        growing = (1,) if ids else (2,)  # seq / past length: different at every step
        if (elem != TensorProto.INT64) if ids else elem not in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16):
            problem = f"element type {TensorProto.DataType.Name(elem) if elem in TensorProto.DataType.values() else elem}"
        elif dims and (len(dims) != (2 if ids else 4) or dims[0] not in (1, None) and isinstance(dims[0], int)
                       or any(isinstance(dims[i], int) for i in growing)):
            problem = f"shape {dims}"
        else:
            continue
        raise FuselmError(f"graph input {name} is declared with {problem}, which the runtime cannot feed: the "
                          "contract is input_ids / attention_mask / position_ids int64 [batch, sequence] and "
                          "past_key_values float [batch, kv_heads, past, head_dim], batch 1 or free, sequence and "
                          "past free (DESIGN.md); re-export with `fuselm convert`")


def _cache_order(name: str):
    m = _PAST.match(name)
    return (int(m.group(1)), m.group(2)) if m else (-1, name)
