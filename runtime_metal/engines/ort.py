"""onnxruntime's CPU engine (`--backend onnxruntime`, and `--backend auto`'s choice on a CPU for a 4-/8-bit graph).

Through onnxruntime-genai for a directory lowered by `fuselm optimize --target onnxruntime` when it is installed
(its own loop, its KV cache: one shared past/present buffer, genai_config.json says so), else plain onnxruntime
with IO binding (BoundLoop): the cache stays in onnxruntime's OrtValues from step to step, and a graph whose past
only GroupQueryAttention reads gets one preallocated max-length buffer bound as both past and present.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from fuselm import contract
from fuselm.errors import FuselmError
from fuselm.genai_config import LOWERED_GRAPH_OPTIMIZATION, shares_buffer
from fuselm.genai_config import NAME as GENAI_CONFIG
from fuselm.options import GENERATION, Options

from ..state import NO_ROLLBACK
from . import mapped_pages
from .base import Engine


def int8_activations(model_dir: Path) -> bool:
    """Whether onnxruntime runs the graph's quantized matmuls on int8 activations: a lowered graph's
    MatMulNBits at level 4, or a standard graph's DequantizeLinear -> MatMul (onnxruntime fuses it at
    its default level, 4)."""
    import onnx

    graph = onnx.load(str(model_dir / contract.MODEL_NAME), load_external_data=False).graph
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    if nbits:
        return any(a.name == "accuracy_level" and a.i >= contract.ORT_ACCURACY_LEVEL for n in nbits for a in n.attribute)
    return any(n.op_type == "DequantizeLinear" for n in graph.node)


RELEASE_EVERY = 64  # decode steps between two releases of the data file's resident pages
PREFILL_CHUNK = 128  # prompt tokens per run: a whole long prompt grows onnxruntime's arena, no faster
KEPT_LOGIT_ROWS = 16  # logit rows whose buffer the IO-binding loop keeps from step to step (decode, verification)


class GenaiLoop:
    """onnxruntime-genai's generator on the directory (its genai_config.json)."""

    def __init__(self, model_dir: Path, threads: int | None):
        import json

        import onnxruntime_genai as og

        self.og = og
        config = og.Config(str(model_dir))
        if threads:
            config.overlay(json.dumps({"model": {"decoder": {"session_options": {
                "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
        self.model = og.Model(config)
        self.what = f"onnxruntime-genai {og.__version__}, CPU"

    def generate(self, ids: list[int], max_tokens: int, temperature: float, top_k: int, top_p: float, seed,
                 ignore_eos: bool = False, logits: list | None = None):
        """Yields each token; `logits`, when given, gets the logits [vocab] each token was picked from."""
        params = self.og.GeneratorParams(self.model)
        total = len(ids) + max_tokens
        options = {"max_length": total, "min_length": total if ignore_eos else 0, "do_sample": temperature > 0}
        if temperature > 0:
            options.update(temperature=temperature, top_k=top_k or 0, top_p=top_p)
            if seed is not None:
                options["random_seed"] = int(seed)
        params.set_search_options(**options)
        gen = self.og.Generator(self.model, params)
        gen.append_tokens(np.array([ids], dtype=np.int32))
        for _ in range(max_tokens):
            if logits is not None:  # read before the pick: after it, genai 0.18 already holds the next step's
                logits.append(np.asarray(gen.get_logits(), np.float32).reshape(-1))
            gen.generate_next_token()
            yield int(gen.get_next_tokens()[0])


class BoundLoop:
    """Plain onnxruntime with IO binding (batch 1): presents stay OrtValues and become the next pasts;
    with a GroupQueryAttention cache, one [1, KV, max_length, D] buffer per cache is past and present."""

    def __init__(self, model_dir: Path, threads: int | None):
        import onnxruntime as ort

        path = model_dir / contract.MODEL_NAME
        config = _genai_config(model_dir)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if _graph_optimization(config) == LOWERED_GRAPH_OPTIMIZATION:  # genai_config.json's choice (a lowered graph)
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        if threads:
            so.intra_op_num_threads = threads
        # MatMulNBits packs its weights on the session's threads (a faster load; while_loading pages out what it reads)
        so.add_session_config_entry("session.prepack.enable_parallel", "1")
        self.ort = ort
        self.data = model_dir / contract.DATA_NAME
        with mapped_pages.while_loading(self.data):  # the load's peak, and what MatMulNBits copied (mapped_pages.py)
            self.sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        # an input with a default (logits_to_keep) is one of onnxruntime's overridable initializers
        self.inputs = {i.name: i for i in [*self.sess.get_inputs(), *self.sess.get_overridable_initializers()]}
        self.pasts = sorted((n for n in self.inputs if contract.is_past(n)), key=contract.cache_order)
        self.states = sorted((n for n in self.inputs if contract.is_state_past(n)), key=contract.step_order)
        self.shared = _shares_buffer(config, model_dir)
        self.what = f"onnxruntime {ort.__version__} (IO binding{', one shared KV buffer' if self.shared else ''}), CPU"
        self.cache, self.done, self.max_len = {}, 0, 0
        self.present = {n: contract.step_present_of(n) for n in [*self.pasts, *self.states]}
        vocab = next(o.shape[-1] for o in self.sess.get_outputs() if o.name == contract.LOGITS)
        # logits [1, keep, vocab] written into buffers of ours (logits_to_keep says the rows; no get_outputs, which
        # wraps every output): else onnxruntime allocates them
        self.vocab = vocab if isinstance(vocab, int) and contract.LOGITS_TO_KEEP in self.inputs else None
        self.logits: dict[int, tuple] = {}  # keep -> `_logits` answer for a few rows, kept
        self.io = None  # the binding of shared KV buffers, kept from step to step (they are the same OrtValues)
        self.bound: list[str] = []  # the outputs onnxruntime allocates in the last binding, in binding order

    def _value(self, a: np.ndarray):
        """An OrtValue owning a copy of `a` (one made from numpy would point at memory Python may free)."""
        a = np.ascontiguousarray(a)
        v = self.ort.OrtValue.ortvalue_from_shape_and_type(a.shape, a.dtype, "cpu")
        v.update_inplace(a)
        return v

    def reset(self, max_len: int) -> None:
        shape = [(self.inputs[n].shape[1], self.inputs[n].shape[3]) for n in self.pasts]
        self.cache = {n: self._value(np.zeros((1, kv, max_len if self.shared else 0, d), np.float32))
                      for n, (kv, d) in zip(self.pasts, shape, strict=True)}
        self.cache.update({n: self._value(contract.zero_state(self.inputs[n].shape)) for n in self.states})
        self.done, self.max_len, self.io = 0, max_len, None

    def forward(self, ids: list[int], rows: int = 1) -> np.ndarray:
        """A long run in pieces (the arena holds one piece's activations); the logits of its last `rows`."""
        if self.done + len(ids) > self.max_len:
            raise FuselmError(f"{self.done + len(ids)} tokens exceed the cache ({self.max_len}); reset with more")
        out = []
        for start in range(0, len(ids), PREFILL_CHUNK):
            part = ids[start:start + PREFILL_CHUNK]
            want = min(len(part), rows - (len(ids) - start - len(part)))
            logits = self._step(part, max(want, 1))
            if want > 0:
                if logits.shape[0] < want:
                    raise FuselmError(f"this graph gives the logits of its last {logits.shape[0]} position(s) only "
                                      f"(passes/last_logits.py), {want} were asked for; run the model directory "
                                      "`fuselm optimize` wrote")
                out.append(logits[-want:])
        return np.concatenate(out)

    def checkpoint(self):
        """(position, the cache's OrtValues): each step binds new presents and states, and a shared KV buffer's
        rows after the position are written over, so references suffice (`restore` puts them back)."""
        return self.done, dict(self.cache)

    def restore(self, saved) -> None:
        self.done, cache = saved
        self.cache, self.io = dict(cache), None

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self.done:
            raise ValueError(f"cannot roll back {n} of {self.done} cached tokens")
        if n and self.states:
            raise FuselmError(NO_ROLLBACK)
        self.done -= n
        if n and not self.shared:  # the presents hold exactly the cached rows: cut them
            self.cache = {k: self._value(v.numpy()[:, :, :self.done]) for k, v in self.cache.items()}

    def _step(self, step: list[int], keep: int = 1) -> np.ndarray:
        """Run `step`'s tokens after the cached ones: the logits [rows, vocab] the graph gives (all of the step's,
        or its last `keep` where it takes logits_to_keep), the cache after them (the same buffers when they are
        shared, else the presents)."""
        s, done = len(step), self.done
        io = self._binding()
        feeds = {contract.INPUT_IDS: np.array([step], np.int64),
                 contract.ATTENTION_MASK: np.ones((1, done + s), np.int64),
                 contract.POSITION_IDS: np.arange(done, done + s, dtype=np.int64)[None],
                 contract.LOGITS_TO_KEEP: np.array([keep], np.int64)}
        for name, a in feeds.items():
            if name in self.inputs:
                io.bind_ortvalue_input(name, self._value(a))
        logits = self._logits(keep)
        if logits is None:
            io.bind_output(contract.LOGITS, "cpu")
        else:
            io.bind_ortvalue_output(contract.LOGITS, logits[1])
        for name in self.states:  # recurrent states: the present replaces the past
            io.bind_ortvalue_input(name, self.cache[name])
            io.bind_output(self.present[name], "cpu")
        self.sess.run_with_iobinding(io)
        self.done += s
        if logits is None or self.io is None:  # outputs onnxruntime allocated: presents, states, logits
            outs = dict(zip(self.bound, io.get_outputs(), strict=False))
            if not self.shared:
                self.cache = {n: outs[self.present[n]] for n in self.pasts}
            self.cache.update({n: outs[self.present[n]] for n in self.states})
            if logits is None:
                return outs[contract.LOGITS].numpy()[0]
        rows, _, owned = logits
        return rows[0] if owned else rows[0].copy()

    def _binding(self):
        """An IOBinding with the KV caches bound: shared buffers (GQA writes the new rows into them) are the same
        OrtValues every step, so without recurrent states one binding serves until the cache is reset or restored;
        else a fresh one, the presents bound to be read back (`bound`: its outputs' names in binding order)."""
        if self.io is not None:
            return self.io
        io = self.sess.io_binding()
        io.bind_output(contract.LOGITS, "cpu")
        self.bound = [contract.LOGITS]
        for name in self.pasts:
            io.bind_ortvalue_input(name, self.cache[name])
            if self.shared:
                io.bind_ortvalue_output(self.present[name], self.cache[name])
            else:
                io.bind_output(self.present[name], "cpu")
                self.bound.append(self.present[name])
        self.bound += [self.present[n] for n in self.states]
        if self.shared and not self.states:
            self.io = io
        return io

    def _logits(self, keep: int) -> tuple | None:
        """(a [1, keep, vocab] float32 array, the OrtValue over it, whether the array is the caller's) where the
        graph's logit rows are `keep`: kept from step to step for a few rows (decode, verification), copied out;
        made for the step for more (a prompt scored), and handed over."""
        if self.vocab is None:
            return None
        if keep > KEPT_LOGIT_ROWS:
            a = np.empty((1, keep, self.vocab), np.float32)
            return a, self.ort.OrtValue.ortvalue_from_numpy(a), True
        if keep not in self.logits:
            a = np.empty((1, keep, self.vocab), np.float32)
            self.logits[keep] = (a, self.ort.OrtValue.ortvalue_from_numpy(a), False)
        return self.logits[keep]


def genai_installed() -> bool:
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return False
    return True


def _genai_config(model_dir: Path) -> dict:
    """The directory's genai_config.json, {} when it has none (or none that parses)."""
    import json

    try:
        data = json.loads((model_dir / GENAI_CONFIG).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _graph_optimization(config: dict) -> str | None:
    """genai_config.json's decoder session option graph_optimization_level, if it sets one."""
    try:
        return config["model"]["decoder"]["session_options"].get("graph_optimization_level")
    except (KeyError, TypeError, AttributeError):
        return None


def _shares_buffer(config: dict, model_dir: Path) -> bool:
    """genai_config.json's past_present_share_buffer (written from the graph: genai_config.shares_buffer),
    else the graph's own answer (read without weights)."""
    try:
        return bool(config["search"]["past_present_share_buffer"])
    except (KeyError, TypeError):
        import onnx

        return shares_buffer(onnx.load(str(model_dir / contract.MODEL_NAME), load_external_data=False).graph)


class OrtEngine(Engine):
    """A model directory on onnxruntime's CPU engine: onnxruntime-genai's loop where the directory was lowered for
    it and it is installed (`loop="genai"`), else the IO-binding loop (`loop="ort"`). `checked`: the graph was
    checked when it was written and is known unchanged (auto's prepared copy, its stamp verified)."""

    HONOURS = {**GENERATION, "threads": None, "device": ("cpu",), "dtype": ("f32",)}

    def __init__(self, source: Path, path: Path, options: Options, why: str | None = None, loop: str = "auto",
                 checked: bool = False):
        super().__init__(source, path, options, why)
        if not (self.path / contract.MODEL_NAME).is_file():
            raise FuselmError(f"{self.path} has no {contract.MODEL_NAME}; pass a model directory from `fuselm optimize`")
        if not checked:
            from fuselm.graphcheck import check_graph_file

            check_graph_file(self.path / contract.MODEL_NAME)
        if loop == "auto":
            loop = "genai" if genai_installed() and (self.path / GENAI_CONFIG).is_file() else "ort"
        if loop == "genai" and not genai_installed():
            raise FuselmError("the genai loop needs onnxruntime-genai (`pip install onnxruntime-genai`); or use loop ort")
        self.loop = GenaiLoop(self.path, options.threads) if loop == "genai" else BoundLoop(self.path, options.threads)
        self.name = "onnxruntime-genai" if loop == "genai" else "onnxruntime"

    def describe(self) -> str:
        return self.loop.what

    def inexact(self, rows: int) -> str | None:
        """onnxruntime's GroupQueryAttention sums a multi-token step in another order than a one-token step (~1e-7
        in a layer's output; its MatMulNBits gives each row the same numbers), and int8 activations (MatMulNBits
        accuracy level 4) turn that into other roundings layer after layer: up to ~0.7 of a logit on SmolLM2-135M
        q8. With f32 activations the rows stay within ~3e-5 of a logit (SmolLM2-135M f32; torch's CPU kernels alike).
        The order comes from its CPU kernel: probabilities · V is one GEMM of M = the step's rows, and MLAS takes a
        one-row product on its own kernel (onnxruntime 1.32, gqa_attention_base.h). A verification as a chain of
        one-row GroupQueryAttention nodes, every present bound to the one cache buffer, gives plain decode's numbers
        exactly: 7.4-8.1 ms against 2.4-2.7 ms for 30 layers of a 1024-row cache on a 2-core Xeon, and a second
        session holding the weights again; not taken."""
        if not hasattr(self, "_int8"):
            self._int8 = int8_activations(self.path)
        return ("onnxruntime's attention sums a several-token step in another order, which its int8 activations "
                "amplify (up to ~0.7 of a logit)") if self._int8 and rows > 1 else None

    def _bound(self) -> BoundLoop:
        if not isinstance(self.loop, BoundLoop):
            raise FuselmError("onnxruntime-genai runs whole generations only; step by step, use the IO-binding loop")
        return self.loop

    def reset(self, max_len: int) -> None:
        self._bound().reset(max_len)

    def forward(self, ids: list[int], rows: int = 1) -> np.ndarray:
        return self._bound().forward(ids, rows)

    def rollback(self, n: int) -> None:
        self._bound().rollback(n)

    @property
    def trimmable(self) -> bool:
        return not self._bound().states

    def checkpoint(self):
        return self._bound().checkpoint()

    def restore(self, saved) -> None:
        self._bound().restore(saved)

    def generate(self, ids: list[int], max_new: int, sampler) -> Iterator[int]:
        if isinstance(self.loop, GenaiLoop):
            yield from self.loop.generate(ids, max_new, sampler.temperature, sampler.top_k, sampler.top_p,
                                          sampler.seed, ignore_eos=True)
            return
        data = self.loop.data
        for n, token in enumerate(super().generate(ids, max_new, sampler)):
            if n == 0 or n % RELEASE_EVERY == 0:  # the embedding rows the gather read, and their neighbours
                mapped_pages.release(data)
            yield token

    def score(self, ids: list[int]) -> np.ndarray:
        if isinstance(self.loop, BoundLoop):
            return super().score(ids)
        # onnxruntime-genai has no teacher-forced step: the same graph on the IO-binding loop scores it
        return OrtEngine(self.source, self.path, self.options, loop="ort", checked=True).score(ids)

    def trace(self, ids: list[int], n: int, force: list[int] | None = None):
        if isinstance(self.loop, BoundLoop):
            return super().trace(ids, n, force)
        from fuselm.reference import Trace

        if force is not None:
            raise FuselmError("onnxruntime-genai cannot be teacher-forced; use the IO-binding loop")
        logits: list = []
        tokens = list(self.loop.generate(ids, n, 0.0, 0, 1.0, None, ignore_eos=True, logits=logits))
        return Trace(tokens=tokens, logits=logits)

    def close(self) -> None:
        self.loop = None
