"""The reference runs, in one place: onnxruntime on a graph, HF transformers on a checkpoint.

- `ort_session(model, optimize=False, accuracy_level=1)`: one options policy. onnxruntime's own graph
  optimizations are off unless asked (a reference runs the graph as written); when asked, blocked
  DequantizeLinear -> MatMul becomes MatMulNBits, whose activations are f32 at accuracy level 1 and
  int8 at onnxruntime's default level 4 (~0.3% error: DESIGN.md's measured facts).
- `OrtRunner`: a contract graph step by step, each step's presents fed back as the next past.
- `hf_model` / `hf_steps`: HF transformers (eager attention, float32 unless asked), a prefill and
  decode steps with its cache, greedy or teacher-forced; `hf_scores` / `ort_scores`: the logits at every
  position of one teacher-forced window (quality on text, runtime_metal/evaluate.py).
- `Trace`: the tokens a run picked and the logits it picked them from.
convert --check, diff, validate, the benchmarks and the tests all use these.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import contract
from .errors import FuselmError


def ort_session(model, optimize: bool = False, accuracy_level: int = 1, threads: int | None = None):
    """An onnxruntime CPU session on `model` (a path, a model dir, serialized bytes or a ModelProto)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(accuracy_level))
    if threads:
        so.intra_op_num_threads = threads
    if hasattr(model, "SerializeToString"):
        model = model.SerializeToString()
    elif not isinstance(model, bytes):
        path = Path(model)
        model = str(path / contract.MODEL_NAME if path.is_dir() else path)
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


@dataclass
class Trace:
    """Greedy tokens and the logits each step chose from."""

    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)

    def add(self, logits) -> int:
        logits = np.asarray(logits, np.float32).reshape(-1)
        self.logits.append(logits)
        self.tokens.append(int(np.argmax(logits)))
        return self.tokens[-1]


class OrtRunner:
    """A contract graph in onnxruntime: `forward` runs one step with explicit inputs; `step` and `greedy`
    keep the cache between calls (batch 1), each step's presents fed back as the next past."""

    def __init__(self, model, **session_options):
        self.session = ort_session(model, **session_options)
        inputs = self.session.get_inputs()
        self.inputs = [i.name for i in inputs]
        self.outputs = [o.name for o in self.session.get_outputs()]
        self._pasts = sorted((i for i in inputs if contract.is_step_past(i.name)), key=lambda i: contract.step_order(i.name))
        self.reset()

    def empty_past(self, batch: int = 1) -> list[np.ndarray]:
        """Zero-length caches [batch, kv_heads, 0, head_dim] and zero recurrent states, in step order (per layer:
        key, value, conv, recurrent)."""
        return [np.zeros((batch, i.shape[1], 0, i.shape[3]), np.float16 if "float16" in i.type else np.float32)
                if contract.is_past(i.name) else contract.zero_state(i.shape, batch) for i in self._pasts]

    def forward(self, input_ids, attention_mask=None, position_ids=None, past=None, done: int | None = None):
        """One step -> (logits [B, S, V], presents in step order). The mask defaults to ones over past + S and
        the positions to past..past+S-1; `past` is a list in step order (default: empty); `done`: the tokens
        before this step (default: the KV caches' length; a model of recurrent states only holds no length)."""
        ids = np.asarray(input_ids, np.int64)
        batch, s = ids.shape
        past = self.empty_past(batch) if past is None else list(past)
        kv = [p for i, p in zip(self._pasts, past, strict=True) if contract.is_past(i.name)]
        done = done if done is not None else int(kv[0].shape[2]) if kv else 0
        mask = np.ones((batch, done + s), np.int64) if attention_mask is None else attention_mask
        positions = np.arange(done, done + s, dtype=np.int64)[None].repeat(batch, 0) if position_ids is None \
            else position_ids
        feeds = {contract.INPUT_IDS: ids, contract.ATTENTION_MASK: np.asarray(mask, np.int64),
                 contract.POSITION_IDS: np.asarray(positions, np.int64)}
        feeds.update({i.name: p for i, p in zip(self._pasts, past, strict=True)})
        out = dict(zip(self.outputs, self.session.run(None, {k: v for k, v in feeds.items() if k in self.inputs}),
                       strict=True))
        return out[contract.LOGITS], [out[contract.step_present_of(i.name)] for i in self._pasts]

    def reset(self) -> None:
        self.past, self.done = self.empty_past(), 0

    def step(self, ids) -> np.ndarray:
        """Run `ids` (batch 1) after what ran since `reset`; returns the logits [1, S, V]."""
        ids = np.asarray(ids, np.int64).reshape(1, -1)
        logits, self.past = self.forward(ids, past=self.past, done=self.done)
        self.done += ids.shape[1]
        return logits

    def greedy(self, ids: list[int], n: int, force: list[int] | None = None) -> Trace:
        """`n` greedy tokens after the prompt `ids`; with `force`, step i is fed force[i] instead (teacher
        forcing, so two runs see the same context and their logits compare at every step)."""
        self.reset()
        trace, step = Trace(), list(ids)
        for i in range(n):
            token = trace.add(self.step(step)[0, -1])
            step = [force[i] if force is not None and i < len(force) else token]
        return trace


def hf_model(hf_dir: str | os.PathLike, dtype: str = "f32"):
    """HF transformers on a local checkpoint, eager attention (the math the export mirrors); offline and
    safetensors only (transformers would otherwise unpickle a pytorch_model.bin)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    torch_dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dtype]
    try:
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch_dtype, attn_implementation="eager",
                                                     local_files_only=True, use_safetensors=True,
                                                     trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad checkpoint
        raise FuselmError(f"cannot load the reference checkpoint {hf_dir} ({type(e).__name__}: {e}); pass the HF "
                          "checkpoint directory the model was converted from") from None
    return model.eval()


def _hf_run(model, batch: int) -> dict:
    """The cache argument of a run's first call: none (transformers makes the cache and hands it back), or for a model
    whose modules keep their states and hand no cache back (RecurrentGemma: `_setup_cache`), a fresh cache, its
    states reset as its own forward resets them when it makes the cache."""
    setup = getattr(model, "_setup_cache", None)
    if setup is None:
        return {}
    from transformers import DynamicCache

    setup(model.config, batch, model.device, model.dtype)
    return {"cache": DynamicCache(config=model.config)}


def hf_steps(model, ids, n: int, force: list[int] | None = None) -> Trace:
    """HF's logits for a prefill of `ids` (a list or [1, S] array) and `n - 1` decode steps with its cache:
    greedy, or fed force[i] at step i."""
    import torch

    ids = np.asarray(ids, np.int64).reshape(1, -1)
    trace = Trace()
    run = _hf_run(model, 1)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), use_cache=True, **run)
        token = trace.add(out.logits[0, -1].float().numpy())
        for i in range(n - 1):
            step = force[i] if force is not None else token
            out = model(input_ids=torch.tensor([[step]]), cache=run["cache"] if run else out.cache, use_cache=True)
            token = trace.add(out.logits[0, -1].float().numpy())
    return trace


def hf_prefill_decode(model, ids, positions=None):
    """HF's logits at every position of a prefill of `ids` [B, S] (mask of ones; `positions` default
    0..S-1), the greedy next token [B, 1] and the logits of that one decode step with the cache."""
    import torch

    ids = np.asarray(ids, np.int64)
    batch, seq = ids.shape
    positions = np.arange(seq)[None].repeat(batch, 0) if positions is None else np.asarray(positions)
    run = _hf_run(model, batch)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.ones(batch, seq, dtype=torch.long),
                    position_ids=torch.tensor(positions), use_cache=True, **run)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        # no mask on the step (ones over the cache and the token: HF's default): Mamba's layers multiply their
        # input by the whole [B, past + 1] mask they get
        step = model(input_ids=nxt, position_ids=torch.tensor(positions[:, -1:] + 1),
                     cache=run["cache"] if run else out.cache, use_cache=True)
    return out.logits.float().numpy(), nxt.numpy(), step.logits.float().numpy()


def hf_scores(model, ids) -> np.ndarray:
    """HF's logits [n, vocab] at every position of `ids` (one window, no cache): teacher-forced scoring."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor(np.asarray(ids, np.int64).reshape(1, -1)), use_cache=False)
    return out.logits[0].float().numpy()


def ort_scores(runner: OrtRunner, ids) -> np.ndarray:
    """onnxruntime's logits [n, vocab] at every position of `ids` (one window, empty past)."""
    logits, _ = runner.forward(np.asarray(ids, np.int64).reshape(1, -1))
    return np.asarray(logits[0], np.float32)


def ort_prefill_decode(runner: OrtRunner, ids, nxt, positions=None):
    """The same prefill and decode step in onnxruntime (`nxt`: the token HF picked) -> both logits."""
    ids = np.asarray(ids, np.int64)
    batch, seq = ids.shape
    positions = np.arange(seq)[None].repeat(batch, 0) if positions is None else np.asarray(positions)
    logits, present = runner.forward(ids, position_ids=positions)
    step, _ = runner.forward(np.asarray(nxt, np.int64), position_ids=positions[:, -1:] + 1, past=present)
    return logits, step


# --- quality on text: a model's teacher-forced scores against the reference's (eval, diff --reference) ---------
class OrtScorer:
    """onnxruntime on the graph as written (its graph optimizations off, f32 activations)."""

    name = "onnxruntime (the graph as written, f32 activations)"

    def __init__(self, model_dir):
        self.runner = OrtRunner(model_dir)

    def score(self, ids) -> np.ndarray:
        return ort_scores(self.runner, ids)

    def describe(self) -> str:
        return self.name


class Reference:
    """HF transformers (float32, CPU) on a checkpoint; scores of a window are kept, so several models
    measured in one process against the same text run the reference once."""

    def __init__(self, hf_dir):
        self.dir = Path(hf_dir)
        self.model = hf_model(hf_dir)
        self._kept: dict[bytes, np.ndarray] = {}

    def score(self, ids) -> np.ndarray:
        key = np.asarray(ids, np.int64).tobytes()
        if key not in self._kept:
            self._kept[key] = log_softmax(hf_scores(self.model, ids))
        return self._kept[key]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


class Metrics:
    """Per-position figures accumulated window by window."""

    def __init__(self):
        self.nll, self.ref_nll, self.kl, self.top1 = [], [], [], []

    def add(self, ids, logits: np.ndarray, ref_logp: np.ndarray | None = None) -> None:
        ids = np.asarray(ids, np.int64)
        logp = log_softmax(logits)[:-1]
        targets = ids[1:]
        rows = np.arange(len(targets))
        self.nll.append(-logp[rows, targets])
        if ref_logp is not None:
            ref = ref_logp[:-1]
            self.ref_nll.append(-ref[rows, targets])
            self.kl.append((np.exp(ref) * (ref - logp)).sum(-1))
            self.top1.append(ref.argmax(-1) == logp.argmax(-1))

    def summary(self) -> dict:
        nll = np.concatenate(self.nll)
        out = {"positions": int(nll.size), "perplexity": float(np.exp(nll.mean()))}
        if self.kl:
            kl = np.concatenate(self.kl)
            ref_ppl = float(np.exp(np.concatenate(self.ref_nll).mean()))
            out.update(reference_perplexity=ref_ppl, perplexity_change=out["perplexity"] / ref_ppl - 1,
                       kl_mean=float(kl.mean()), kl_p99=float(np.percentile(kl, 99)),
                       top1_agreement=float(np.concatenate(self.top1).mean()))
        return out
