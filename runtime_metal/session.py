"""A model ready to generate: graph + backend + preallocated KV cache, prefill and decode steps.

    sess = Session("qwen3-opt", backend="auto")
    sess.reset(max_len=256)
    logits = sess.prefill([1, 2, 3])      # chunked; logits of the last prompt token
    logits = sess.decode(next_token)      # one token; static shapes, one plan reused every step
    for token in sess.generate([1, 2, 3], 32, Sampler()):   # picked on the device, pipelined
        ...

The graph contract (fuselm/contract.py) is checked at load.

Decode runs in one of four modes (`Decode`), which only move forward:
  DYNAMIC  — every step is traced at its own shapes (graphs whose cache cannot live in place, or a
             sliding window shorter than the cache);
  CHECKING — the next decode step runs dynamic and static and compares them: graphs from other
             exporters may derive positions from shapes in ways static shapes break;
  STATIC   — one plan over the whole preallocated cache, the same shapes every token;
  COMPILED — that plan as one compiled function (mx.compile; inductor + CUDA graph), built on the
             first static step and kept only if it reproduces the eager step.
Where the backend reads only the filled rows of the cache (`causal_reads`: MLX) and every Attention's
mask is a causal band (mask_kind.py), the static plan's attentions read rows 0..pos (the window's last
rows) with no array mask, prefill chunks use mask="causal", and COMPILED compiles the pieces between the
attentions (compiled.py PiecewiseDecode): the attention shapes grow with the cache.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import psutil
from onnx import TensorProto

from fuselm import contract
from fuselm.errors import FuselmError

from . import graph as graph_mod
from . import kvcache, loader
from .backends import make_backend
from .compiled import CompiledDecode, PiecewiseDecode, agrees, static_feeds
from .executor import Executor, Profiler
from .kvcache import CacheView


class Decode(enum.Enum):
    DYNAMIC = "dynamic decode"
    CHECKING = "static-shape decode, checked on the first step"
    STATIC = "static-shape decode"
    COMPILED = "static-shape decode, compiled"


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
                 threads: int | None = None, dtype: str = "auto", kv_bits: int | None = None,
                 kv_bits_k: int | None = None, kv_bits_v: int | None = None, kv_group_size: int | None = None):
        self.kv_formats = kvcache.formats(kv_bits, kv_bits_k, kv_bits_v, kv_group_size)  # (key, value)
        self.lm = loader.load(path)
        self.meta = self.lm.meta or {}
        self.backend = make_backend(backend, device, dtype=dtype, threads=threads)
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
        attention = [n for n in self.graph.nodes if n.key == ("", "Attention")]
        self.causal_reads = bool(self.backend.causal_reads and self.in_place and attention and fused
                                 and all("causal_rows" in n.attrs for n in attention)
                                 and not any(n.op_type == "KVAppend" for n in self.graph.nodes))
        self.executor.ctx["causal_reads"] = self.causal_reads  # the session's feeds are plain (mask_kind.py)
        self.packed = self._packed_pairs(attention)  # value cache name -> its key's, sharing one buffer
        self.mode = Decode.CHECKING if static_decode and self.in_place else Decode.DYNAMIC
        self.profiler = Profiler()
        self.executor.profiler = self.profiler
        self.max_len = 0
        self.pos = 0
        env = os.environ.get("FUSELM_COMPILE", "")
        self.compile = (env not in ("0", "false", "no") if env else self.backend.compile_default) \
            if compile is None else bool(compile)
        self.compiled_steps: dict[int, CompiledDecode] = {}  # by cache length: compiled shapes are fixed
        self.compile_failed: str | None = None
        self.threads = getattr(self.backend, "threads", None)

    # --- what ran (validate, bench, describe) ---------------------------------------------------
    @property
    def static_decode(self) -> bool:
        return self.mode is not Decode.DYNAMIC

    @property
    def static_checked(self) -> bool:
        return self.mode in (Decode.STATIC, Decode.COMPILED)

    @property
    def compiled(self) -> CompiledDecode | None:
        return self.compiled_steps.get(self.max_len)

    # --- contract ------------------------------------------------------------------------------
    def _check_contract(self) -> list[CacheSpec]:
        from fuselm.graphcheck import ORT_DOMAIN, ORT_ONNX_DOMAIN_CONTRIB

        genai = next((n for n in self.lm.graph.node if n.domain == ORT_DOMAIN or n.op_type in ORT_ONNX_DOMAIN_CONTRIB),
                     None)
        if genai is not None:  # onnxruntime-genai's builder output: its contrib ops, no position_ids
            raise FuselmError(f"{self.lm.path} uses onnxruntime contrib ops ({genai.op_type}, node {genai.name!r}), "
                              "as onnxruntime-genai's builder writes them; run `fuselm optimize DIR -o OUT` first "
                              "(it maps them to standard ops and the graph contract) and run OUT")
        ins, outs = self.lm.input_types, set(self.lm.output_names)
        # a pipeline stage (`fuselm split`) takes / returns the hidden state in place of input_ids / logits
        self.first_input = contract.HIDDEN if contract.HIDDEN in ins else contract.INPUT_IDS
        self.output = contract.NEXT_HIDDEN if contract.NEXT_HIDDEN in outs else contract.LOGITS
        step_inputs = (self.first_input, contract.ATTENTION_MASK, contract.POSITION_IDS)
        missing = [n for n in step_inputs if n not in ins] + [n for n in (self.output,) if n not in outs]
        specs = []
        for name, (elem, dims) in sorted(ins.items(), key=lambda kv: contract.cache_order(kv[0])):
            if not contract.is_past(name):
                continue
            present = contract.present_of(name)
            if present not in outs:
                missing.append(present)
            if len(dims) != 4 or not isinstance(dims[1], int) or not isinstance(dims[3], int):
                raise FuselmError(f"graph input {name} has shape {dims}; the contract needs [batch, kv_heads, past, "
                                  "head_dim] with fixed kv_heads and head_dim")
            specs.append(CacheSpec(name, present, dims[1], dims[3], elem))
        if not specs:
            missing.append(contract.past_name("{i}", "key/.value"))
        unknown = [n for n in ins if n not in step_inputs and not contract.is_past(n)]
        if missing or unknown:
            what = (f"missing {', '.join(missing)}" if missing else "") + \
                   ("; " if missing and unknown else "") + (f"unexpected inputs {unknown}" if unknown else "")
            raise FuselmError(f"{self.lm.path} does not follow the fuselm graph contract ({what}); it needs "
                              f"{contract.NAMES_TEXT} (DESIGN.md); re-export with `fuselm convert`")
        _check_declared({n: t for n, t in ins.items() if n != contract.HIDDEN})
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

    def _packed_pairs(self, attention) -> dict[str, str]:
        """Layers whose K and V live in one buffer (kvcache.packed): causal reads, every Attention given its
        k and v rows as one array (qkv_heads.py), K and V of the same shape and storage format."""
        specs = {c.name: c for c in self.caches}
        pairs = {}
        for n in attention:
            k, v = (n.inputs[i] if len(n.inputs) > i else "" for i in (4, 5))
            if len(n.inputs) < 8 or not n.inputs[7] or k not in specs or v not in specs or k in pairs or \
                    (specs[k].heads, specs[k].head_dim, specs[k].dtype) != (specs[v].heads, specs[v].head_dim,
                                                                              specs[v].dtype):
                return {}
            pairs[v] = k
        if not self.causal_reads or len(pairs) * 2 != len(specs) or self.kv_formats[0] != self.kv_formats[1]:
            return {}
        return pairs

    def _view(self, c: CacheSpec, pos, seq: int, static: bool = False) -> CacheView:
        heads = None
        if self.packed:
            heads = (c.heads, 2 * c.heads) if c.name in self.packed else (0, c.heads)
        return CacheView(self.buffers[c.name], pos, seq, static, heads)

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
        self._pos_dev = None  # (position, the same as a device array) the compiled step handed back
        length = self.max_len if self.in_place else 0
        self.buffers = {c.name: kvcache.make_cache(b, (1, c.heads, length, c.head_dim), c.dtype, self._kv_format(c))
                        for c in self.caches if c.name not in self.packed}
        for v, k in self.packed.items():  # the keys' heads, then the values'
            c = next(c for c in self.caches if c.name == k)
            self.buffers[k] = self.buffers[v] = kvcache.packed(b, (1, c.heads, length, c.head_dim), c.dtype,
                                                               self._kv_format(c))

    def _kv_format(self, c: CacheSpec) -> kvcache.KVFormat:
        return self.kv_formats[c.name.endswith(".value")]

    def _ids(self, ids):
        """Token ids as the graph's [1, n] int64 input: a list, or a device array (a picked token)."""
        if self.first_input == contract.HIDDEN:  # a stage's hidden state [1, n, hidden], as it came
            return ids
        if isinstance(ids, (list, tuple, np.ndarray)):
            return self.backend.asarray(np.asarray(ids, np.int64).reshape(1, -1))
        return self.backend.reshape(self.backend.cast(ids, TensorProto.INT64), (1, -1))

    def _run(self, ids, pos, mask, positions, views: dict) -> object:
        feeds = {self.first_input: self._ids(ids), contract.ATTENTION_MASK: mask, contract.POSITION_IDS: positions,
                 **views}
        self.executor.ctx["rope_offset"] = pos
        self.executor.ctx["all_logits"] = False
        out = self.executor.run(feeds)
        if self.in_place:
            for name, view in views.items():
                self.buffers[name] = view.buffer
        else:
            for c in self.caches:
                self.buffers[c.name] = out[c.present]
        return out[self.output]

    def prefill(self, ids: list[int], chunk: int | None = None):
        """Run the prompt in chunks; returns the logits of its last token (backend array [vocab]).

        Only the last position of each chunk goes through the lm_head (graph.py's LastRows)."""
        chunk = chunk or self.backend.prefill_chunk
        self.backend.set_threads(decode=False)
        if not ids:
            raise FuselmError("the prompt is empty; pass --prompt text or --prompt-ids")
        if self.pos + len(ids) > self.max_len:
            raise FuselmError(f"{self.pos + len(ids)} tokens exceed the cache ({self.max_len}); call reset with more")
        logits = None
        for start in range(0, len(ids), chunk):
            part = ids[start:start + chunk]
            logits = self._step_dynamic(part)
            if self.backend.lazy and start + chunk < len(ids):  # compute the cache, never these logits
                self.backend.sync(list(self.buffers.values()))
        return logits

    def _step_dynamic(self, part):
        b, pos = self.backend, self.pos
        s = len(part) if isinstance(part, (list, tuple)) else \
            (b.shape(part)[1] if self.first_input == contract.HIDDEN else 1)
        mask = b.asarray(np.ones((1, pos + s), np.int64))
        positions = b.asarray(np.arange(pos, pos + s, dtype=np.int64).reshape(1, -1))
        if self.in_place:
            views = {c.name: self._view(c, pos, s) for c in self.caches}
        else:
            views = dict(self.buffers)
        logits = self._run(part, pos, mask, positions, views)
        self.pos += s
        if self.output == contract.NEXT_HIDDEN:  # every row goes on to the next stage
            return logits
        return b.slice(logits, (0, b.shape(logits)[1] - 1))  # [B, 1, vocab] unless all_logits

    def decode(self, token):
        """One decode step for `token` (an int, or a device array from `pick`); returns the logits of the
        new token (backend array [vocab])."""
        if self.pos + 1 > self.max_len:
            raise FuselmError(f"the cache is full ({self.max_len} tokens); reset with a larger max_len")
        self.backend.set_threads(decode=True)
        token = [int(token)] if isinstance(token, (int, np.integer)) else token
        # a sliding-window mask is computed from the cache index: static shapes would move the query
        # to the end of the buffer, so the window only stays right while the buffer fits in it (causal
        # reads cut the window's rows themselves)
        if self.mode is Decode.DYNAMIC or (self.window is not None and self.max_len > self.window
                                           and not self.causal_reads):
            return self._step_dynamic(token)
        if self.mode is Decode.CHECKING:
            return self._checked_static(token)
        return self._step_static(token)

    def _step_static(self, token):
        b, pos = self.backend, self.pos
        pos_dev = self._pos_dev if self._pos_dev is not None and self._pos_dev[0] == pos else None
        pos_dev = pos_dev[1] if pos_dev is not None else b.asarray(np.array(pos, np.int64))
        ids = self._ids(token)
        step = self.compiled
        if step is not None and not self.profiler.enabled:
            logits, nxt, bufs = step(ids, pos_dev, [self.buffers[c.name] for c in self.caches])
            self.buffers = {c.name: buf for c, buf in zip(self.caches, bufs, strict=True)}
            self._pos_dev = (pos + 1, nxt) if nxt is not None else None
        else:
            feeds = static_feeds(b, ids, pos_dev, self.max_len, self.first_input)
            at = pos if self.causal_reads else pos_dev  # causal reads cut the filled rows at a host position
            views = {c.name: self._view(c, at, 1, static=True) for c in self.caches}
            logits = self._run(ids, pos_dev, feeds[contract.ATTENTION_MASK], feeds[contract.POSITION_IDS], views)
            if step is None and self.compile and self.compile_failed is None:
                self._build_compiled(ids, pos_dev, logits)
        self.pos += 1
        return b.slice(logits, (0, 0))

    def _build_compiled(self, ids, pos_dev, eager_logits) -> None:
        """Compile the static step with this step's inputs; keep it only if it reproduces the eager logits.

        Re-running the step is harmless: it writes the same keys and values into the same cache rows."""
        feeds = static_feeds(self.backend, ids, pos_dev, self.max_len, self.first_input)
        plan = self.executor.plan_for({**feeds, **{c.name: self._view(c, pos_dev, 1, static=True)
                                                   for c in self.caches}})
        if plan is None:
            return
        compiled = (PiecewiseDecode if self.causal_reads else CompiledDecode)(self, plan, self.max_len)
        bufs = [self.buffers[c.name] for c in self.caches]
        try:
            compiled.build((ids, pos_dev, *bufs))
            logits, _, _ = compiled(ids, pos_dev, bufs)
        except Exception as e:  # noqa: BLE001 - a compiler failure must not stop generation
            self.compile_failed = f"{type(e).__name__}: {e}"[:300]
            return
        if not agrees(self.backend, eager_logits, logits, tol=self._tolerance()):
            d = np.abs(np.asarray(self.backend.to_numpy(eager_logits), np.float64)
                       - np.asarray(self.backend.to_numpy(logits), np.float64)).max()
            self.compile_failed = f"compiled logits differ from the eager step by {d:.3g}"
            return
        self.compiled_steps[self.max_len] = compiled
        self.mode = Decode.COMPILED

    def _tolerance(self) -> float:
        """How far two orders of the same float work may drift, as a share of the largest logit: bf16
        activations (MLX half compute, CUDA tinygemm / bf16 weights) round at every matmul, and a last-bit
        difference upstream (attention over a padded static buffer vs the exact length) flips roundings
        that grow over the layers (4B-shaped, 36 layers: beyond 1e-3); so do int8 activations (the CPU
        kernels' *-int8: a last-bit difference moves a value across an int8 rounding step); f32 paths
        stay within 1e-3."""
        half = self.backend.compute != "f32" or any(
            n.attrs["weight"].kind in ("tinygemm", "dequant-bf16") or n.attrs["weight"].kind.endswith("-int8")
            for n in self.graph.nodes if n.op_type == "QMatMul")
        return 3e-2 if half else 1e-3

    def _checked_static(self, token):
        """First decode step: run it dynamic and static; keep static decode only if both agree."""
        b = self.backend
        pos = self.pos
        saved = {k: kvcache.snapshot(b, v, pos, pos + 1) for k, v in self.buffers.items()}
        dyn = np.asarray(b.to_numpy(self._step_dynamic(token)), np.float64)
        self.buffers = {k: kvcache.restore(b, self.buffers[k], v) for k, v in saved.items()}
        self.pos = pos
        self.mode = Decode.STATIC
        out = self._step_static(token)
        st = np.asarray(b.to_numpy(out), np.float64)
        scale = max(1.0, float(np.abs(dyn).max()))
        if not np.allclose(dyn, st, atol=self._tolerance() * scale, rtol=0):
            self.mode = Decode.DYNAMIC
        return out

    # --- generation -------------------------------------------------------------------------------
    def generate(self, ids: list[int], max_new: int, sampler) -> Iterator[int]:
        """Prefill `ids`, then yield up to `max_new` tokens (the caller stops early at eos).

        Tokens are picked on the device and, on a lazy backend (MLX), the next step is queued before
        this token is read (mx.async_eval), so the host builds step n+1 while the device runs step n.
        The cache must have room: reset(len(ids) + max_new) first."""
        b = self.backend
        y = b.pick_token(self.prefill(ids), sampler)
        b.async_eval(y)
        for n in range(max_new):
            nxt = None
            if n + 1 < max_new:
                nxt = b.pick_token(self.decode(y), sampler)
                b.async_eval(nxt)
            token = b.item(y)
            if token < 0:
                raise FuselmError(f"the model produced NaN or infinite logits at step {n}; its weights or graph are "
                                  "broken (`fuselm validate` compares it with the checkpoint)")
            yield token
            y = nxt

    def logits_to_numpy(self, logits) -> np.ndarray:
        return np.asarray(self.backend.to_numpy(logits), dtype=np.float32).reshape(-1)

    def describe(self) -> str:
        b = self.backend
        kind = {w.kind for n in self.graph.nodes if n.op_type == "QMatMul" for w in [n.attrs["weight"]]}
        extra = f", quantized matmul: {'/'.join(sorted(kind))}" if kind else ""
        mode = self.mode.value
        if self.static_decode and self.compile and self.mode is not Decode.COMPILED:
            mode += ", compiles on the first static step" if self.compile_failed is None else \
                f", compile failed ({self.compile_failed})"
        elif self.mode is Decode.COMPILED:
            mode += f": {self.compiled.what}" if self.compiled is not None else ""
        dtype = f", {b.compute} compute" if b.compute != "f32" else ""
        if self.causal_reads and self.mode is not Decode.COMPILED:
            mode += ", attention over the filled rows (no mask at decode, causal at prefill)"
        if self.packed:
            mode += ", K and V in one buffer per layer"
        kv = kvcache.describe(self.kv_formats, self.caches[0].dtype, self.caches[0].head_dim) if self.caches else "-"
        state = self.graph.prepared.split(" ")[0]
        prepared = f", prepared weights {state}" if state in ("read", "written") else ""
        return f"{b.name} on {b.device} ({'fused kernels' if self.fused else 'no fused kernels'}, {mode}{dtype}{extra}, " \
               f"KV cache {kv}{prepared})"


def kv_options(kv_bits=None, kv_bits_k=None, kv_bits_v=None, kv_group_size=None) -> dict:
    """The KV cache keywords run/validate pass on to Session (any other keyword is a TypeError, as before)."""
    return {"kv_bits": kv_bits, "kv_bits_k": kv_bits_k, "kv_bits_v": kv_bits_v, "kv_group_size": kv_group_size}


def _check_declared(ins: dict) -> None:
    """The inputs' declared types and static dims must admit what the session feeds: int64 ids [1, n],
    float caches [1, kv_heads, past, head_dim] (dims without a size, `[]`, admit anything)."""
    for name, (elem, dims) in ins.items():
        ids = not contract.is_past(name)
        growing = (1,) if ids else (2,)  # seq / past length: different at every step
        if (elem != TensorProto.INT64) if ids else elem not in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16):
            problem = f"element type {TensorProto.DataType.Name(elem) if elem in TensorProto.DataType.values() else elem}"
        elif dims and (len(dims) != (2 if ids else 4) or dims[0] not in (1, None) and isinstance(dims[0], int)
                       or any(isinstance(dims[i], int) for i in growing)):
            problem = f"shape {dims}"
        else:
            continue
        raise FuselmError(f"graph input {name} is declared with {problem}, which the runtime cannot feed: the "
                          f"contract is {' / '.join(contract.STEP_INPUTS)} int64 [batch, sequence] and "
                          f"{contract.PAST} float [batch, kv_heads, past, head_dim], batch 1 or free, sequence and "
                          "past free (DESIGN.md); re-export with `fuselm convert`")
