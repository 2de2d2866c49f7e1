"""`fuselm run --backend onnxruntime`: generate on onnxruntime's CPU engine.

Through onnxruntime-genai when it is installed (its own loop, its KV cache: one shared past/present
buffer for a `--target onnxruntime` graph, genai_config.json says so), else plain onnxruntime with IO
binding: the cache stays in onnxruntime's OrtValues from step to step, and a graph whose past only
GroupQueryAttention reads gets one preallocated max-length buffer bound as both past and present.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from . import contract, mapped_pages
from .errors import FuselmError
from .genai_config import LOWERED_GRAPH_OPTIMIZATION, shares_buffer
from .genai_config import NAME as GENAI_CONFIG


def lowered_for_onnxruntime(model_dir) -> bool:
    """Whether the directory is fuselm's and its graph holds onnxruntime contrib ops (`fuselm optimize
    --target onnxruntime`; read without weights). onnxruntime-genai's own directories are not."""
    import onnx

    from .graphcheck import ORT_DOMAIN

    path = Path(model_dir)
    if not path.is_dir() or not (path / contract.META_NAME).is_file() or not (path / contract.MODEL_NAME).is_file():
        return False
    path = path / contract.MODEL_NAME
    try:
        graph = onnx.load(str(path), load_external_data=False).graph
    except Exception:  # noqa: BLE001 - not ONNX: the backend's own check names the problem
        return False
    return any(n.domain == ORT_DOMAIN for n in graph.node)


RELEASE_EVERY = 64  # decode steps between two releases of the data file's resident pages
# prompt tokens per run (bench/cpu_rss.py: a 512-token prompt in one run held 70 MB more of onnxruntime's arena, at the
# same prefill speed)
PREFILL_CHUNK = 128


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
        # MatMulNBits packs its weights on the session's threads: load 1.01 -> 0.86 s (0.6B q4, 2 cores, medians of 3),
        # peak after a 512-token prompt 720 -> 723 MB; the weights' pages it reads pile up faster, and while_loading
        # pages them out (the load's peak: 1021 MB without it)
        so.add_session_config_entry("session.prepack.enable_parallel", "1")
        self.ort = ort
        self.data = model_dir / contract.DATA_NAME
        with mapped_pages.while_loading(self.data):  # the load's peak, and what MatMulNBits copied (mapped_pages.py)
            self.sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        self.inputs = {i.name: i for i in self.sess.get_inputs()}
        self.pasts = sorted((n for n in self.inputs if contract.is_past(n)), key=contract.cache_order)
        self.shared = _shares_buffer(config, model_dir)
        self.what = f"onnxruntime {ort.__version__} (IO binding{', one shared KV buffer' if self.shared else ''}), CPU"

    def _value(self, a: np.ndarray):
        """An OrtValue owning a copy of `a` (one made from numpy would point at memory Python may free)."""
        a = np.ascontiguousarray(a)
        v = self.ort.OrtValue.ortvalue_from_shape_and_type(a.shape, a.dtype, "cpu")
        v.update_inplace(a)
        return v

    def generate(self, ids: list[int], max_tokens: int, temperature: float, top_k: int, top_p: float, seed,
                 ignore_eos: bool = False, logits: list | None = None):
        """Yields each token (the caller stops at eos); `logits`, when given, gets the logits each was picked from."""
        from .runtime_metal.sampling import sample

        rng = np.random.default_rng(seed)
        total = len(ids) + max_tokens
        shape = [(self.inputs[n].shape[1], self.inputs[n].shape[3]) for n in self.pasts]
        cache = {n: self._value(np.zeros((1, kv, total if self.shared else 0, d), np.float32))
                 for n, (kv, d) in zip(self.pasts, shape, strict=True)}
        done, step = 0, list(ids)
        while len(step) > PREFILL_CHUNK:  # a long prompt in pieces: the arena holds one piece's activations
            _, cache = self._step(step[:PREFILL_CHUNK], done, cache)
            done, step = done + PREFILL_CHUNK, step[PREFILL_CHUNK:]
        for _ in range(max_tokens):
            last, cache = self._step(step, done, cache)
            if logits is not None:
                logits.append(np.array(last, np.float32))
            token = sample(last, temperature, top_k, top_p, rng)
            if done + len(step) == len(ids) or (done + 1) % RELEASE_EVERY == 0:
                mapped_pages.release(self.data)  # the embedding rows the gather read, and their neighbours
            done += len(step)
            step = [token]
            yield token

    def _step(self, step: list[int], done: int, cache: dict) -> tuple[np.ndarray, dict]:
        """Run `step`'s tokens after `done` cached ones: the last position's logits and the cache after them
        (the same buffers when they are shared, else the presents)."""
        io = self.sess.io_binding()
        s = len(step)
        feeds = {contract.INPUT_IDS: np.array([step], np.int64),
                 contract.ATTENTION_MASK: np.ones((1, done + s), np.int64),
                 contract.POSITION_IDS: np.arange(done, done + s, dtype=np.int64)[None]}
        for name, a in feeds.items():
            if name in self.inputs:
                io.bind_ortvalue_input(name, self._value(a))
        bound = [contract.LOGITS]
        io.bind_output(contract.LOGITS, "cpu")
        for name in self.pasts:
            io.bind_ortvalue_input(name, cache[name])
            if self.shared:  # GQA writes the new rows into the same buffer
                io.bind_ortvalue_output(contract.present_of(name), cache[name])
            else:
                io.bind_output(contract.present_of(name), "cpu")
                bound.append(contract.present_of(name))
        self.sess.run_with_iobinding(io)
        outs = dict(zip(bound, io.get_outputs(), strict=False))
        if not self.shared:
            cache = {n: outs[contract.present_of(n)] for n in self.pasts}
        return outs[contract.LOGITS].numpy()[0, -1], cache


# run's / validate's keywords that only runtime_metal's backends honour
RUNTIME_ONLY = ("device", "no_fused_kernels", "compile", "dtype", "kv_bits", "kv_bits_k", "kv_bits_v", "kv_group_size",
                "profile")


def unhonoured(options: dict) -> list[str]:
    """The flags among `options` (run's / validate's keywords) that onnxruntime's CPU engine cannot honour: a
    device other than cpu, --compile, --kv-bits, --no-fused-kernels, ... (unset: None, False or "auto")."""
    return ["--" + k.replace("_", "-") for k, v in options.items() if k in RUNTIME_ONLY
            and v not in (None, False, "auto") and not (k == "device" and v == "cpu") and not (k == "dtype" and v == "f32")]


def refuse_options(options: dict) -> None:
    """A FuselmError naming the flags `unhonoured` finds; a keyword no backend takes is a TypeError."""
    if unknown := set(options) - set(RUNTIME_ONLY):
        raise TypeError(f"unexpected keyword arguments {sorted(unknown)}")
    if flags := unhonoured(options):
        raise FuselmError(f"--backend onnxruntime does not take {', '.join(flags)}; drop them or use --backend torch")


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


def make_loop(path: Path, engine: str = "auto", threads: int | None = None, checked: bool = False):
    """The generation loop: `engine` "genai" (onnxruntime-genai), "ort" (IO binding) or "auto" (genai when
    installed and the directory has its genai_config.json). `checked`: the graph was checked when it was
    written and is known unchanged (auto's prepared copy, its stamp verified), so it is not checked again."""
    if not (path / contract.MODEL_NAME).is_file():
        raise FuselmError(f"{path} has no {contract.MODEL_NAME}; pass a model directory from `fuselm optimize`")
    if not checked:
        from .graphcheck import check_graph_file

        check_graph_file(path / contract.MODEL_NAME)
    if engine == "auto":
        engine = "genai" if genai_installed() and (path / GENAI_CONFIG).is_file() else "ort"
    if engine == "genai" and not genai_installed():
        raise FuselmError("engine genai needs onnxruntime-genai (`pip install onnxruntime-genai`); or use engine ort")
    return GenaiLoop(path, threads) if engine == "genai" else BoundLoop(path, threads)


def run(model_dir, prompt=None, prompt_ids=None, max_tokens=64, ignore_eos=False, chat=False, temperature=0.0,
        top_k=0, top_p=1.0, seed=None, threads=None, stream=None, quiet=False, engine: str = "auto", why=None,
        checked: bool = False, **ignored) -> dict:
    """Generate on onnxruntime: `engine` "genai" (onnxruntime-genai), "ort" (IO binding) or "auto" (genai when
    installed and the directory has its genai_config.json). Options of the other backends are refused. `why`:
    why this backend runs (`--backend auto`'s reason), printed in the header; `checked`: see `make_loop`."""
    from rich.console import Console

    from .tokenizer import Detokenizer, encode_prompt, eos_ids, load_tokenizer

    refuse_options(ignored)
    if max_tokens < 1:
        raise FuselmError(f"--max-tokens must be at least 1, got {max_tokens}")
    path = Path(model_dir)
    loop = make_loop(path, engine, threads, checked)
    tok = load_tokenizer(path, required=prompt is not None, chat=chat)
    ids = encode_prompt(tok, prompt, prompt_ids, chat)
    meta = {}
    if (path / contract.META_NAME).is_file():
        from .modeldir import read_meta

        meta = read_meta(path)
    stops = set() if ignore_eos else eos_ids(path, meta, tok)
    out, console = stream or sys.stdout, Console(stderr=True, quiet=quiet)
    console.print(f"[dim]fuselm run: {loop.what}{f' · {why}' if why else ''}[/dim]")
    detok, tokens = Detokenizer(tok), []
    t0 = time.perf_counter()
    t_first = None
    for token in loop.generate(ids, max_tokens, temperature, top_k, top_p, seed, ignore_eos):
        t_first = t_first or time.perf_counter()
        tokens.append(token)
        out.write(detok.add(token))
        out.flush()
        if token in stops:
            break
    out.write("\n")
    t_end = time.perf_counter()
    decode_n = len(tokens) - 1
    result = {"tokens": tokens, "text": tok.decode(tokens, skip_special_tokens=True) if tok is not None else None,
              "prompt_tokens": len(ids), "backend": "onnxruntime-genai" if isinstance(loop, GenaiLoop) else "onnxruntime",
              "device": "cpu", "prefill_tok_s": len(ids) / max(t_first - t0, 1e-9),
              "decode_tok_s": decode_n / max(t_end - t_first, 1e-9) if decode_n else None,
              "stopped_at_eos": bool(tokens) and tokens[-1] in stops, "what": loop.what, "why": why}
    decode = f"{result['decode_tok_s']:.1f} tok/s" if decode_n else "n/a (one token)"
    console.print(f"[dim]prefill {len(ids)} tokens: {result['prefill_tok_s']:.1f} tok/s · decode {decode_n} tokens: "
                  f"{decode} · {loop.what}[/dim]")
    return result
