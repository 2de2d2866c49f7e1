"""`fuselm convert --check`: onnxruntime on the written graph against HF transformers.

HF loads the checkpoint with `from_pretrained` (it is the reference, not the convert path).
Both run a prefill and one decode step with past; the max abs logit difference and greedy
agreement are printed. An f32 export that differs by more than 1e-4 raises CheckFailed (exit 1).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fuselm.errors import CheckFailed
from fuselm.modeldir import MODEL_NAME, read_meta

F32_TOLERANCE = 1e-4


class OrtModel:
    """The graph in onnxruntime CPU with its own graph optimizations off (a plain reference run),
    and quantized matmuls at full float accuracy."""

    def __init__(self, model_dir: str | Path):
        import onnxruntime as ort

        self.meta = read_meta(model_dir)
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
        so.log_severity_level = 3
        self.session = ort.InferenceSession(str(Path(model_dir) / MODEL_NAME), so, providers=["CPUExecutionProvider"])
        d = self.meta["dims"]
        self.layers, self.kv_heads, self.head_dim = d["layers"], d["kv_heads"], d["head_dim"]

    def empty_past(self, batch: int) -> list[np.ndarray]:
        return [np.zeros((batch, self.kv_heads, 0, self.head_dim), np.float32)] * (2 * self.layers)

    def forward(self, input_ids, attention_mask, position_ids, past=None):
        """-> (logits [B,S,V], present list [k0, v0, k1, v1, ...])."""
        input_ids = np.asarray(input_ids, np.int64)
        past = past if past is not None else self.empty_past(input_ids.shape[0])
        feed = {"input_ids": input_ids, "attention_mask": np.asarray(attention_mask, np.int64),
                "position_ids": np.asarray(position_ids, np.int64)}
        for i in range(self.layers):
            feed[f"past_key_values.{i}.key"], feed[f"past_key_values.{i}.value"] = past[2 * i], past[2 * i + 1]
        logits, *present = self.session.run(None, feed)
        return logits, present


def hf_model(hf_dir: str | Path):
    """The HF reference in float32 with eager attention (the math the export mirrors)."""
    import torch
    from transformers import AutoModelForCausalLM

    # Offline, and safetensors only: transformers would otherwise unpickle a pytorch_model.bin.
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager",
                                                 local_files_only=True, use_safetensors=True, trust_remote_code=False)
    return model.eval()


def hf_prefill_decode(model, ids: np.ndarray, positions: np.ndarray | None = None):
    """HF logits for a prefill of `ids` [B,S] and one greedy decode step with the cache."""
    import torch

    batch, seq = ids.shape
    positions = np.arange(seq)[None].repeat(batch, 0) if positions is None else positions
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.ones(batch, seq, dtype=torch.long),
                    position_ids=torch.tensor(positions), use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        step = model(input_ids=nxt, attention_mask=torch.ones(batch, seq + 1, dtype=torch.long),
                     position_ids=torch.tensor(positions[:, -1:] + 1), cache=out.cache,
                     use_cache=True)
    return out.logits.numpy(), nxt.numpy(), step.logits.numpy()


def ort_prefill_decode(ort_model: OrtModel, ids: np.ndarray, nxt: np.ndarray, positions: np.ndarray | None = None):
    batch, seq = ids.shape
    positions = np.arange(seq)[None].repeat(batch, 0) if positions is None else positions
    logits, present = ort_model.forward(ids, np.ones((batch, seq)), positions)
    step, _ = ort_model.forward(nxt, np.ones((batch, seq + 1)), positions[:, -1:] + 1, present)
    return logits, step


def check(model_dir: str | Path, hf_dir: str | Path, seq: int = 16, quiet: bool = False) -> dict:
    """Compare onnxruntime and HF on a seeded random prompt; returns the figures."""
    ort_model = OrtModel(model_dir)
    model = hf_model(hf_dir)
    ids = np.random.default_rng(0).integers(0, ort_model.meta["dims"]["vocab"], size=(1, seq))
    ref_prefill, nxt, ref_step = hf_prefill_decode(model, ids)
    got_prefill, got_step = ort_prefill_decode(ort_model, ids, nxt)
    diff = float(max(np.abs(ref_prefill - got_prefill).max(), np.abs(ref_step - got_step).max()))
    ref_tokens = np.concatenate([ref_prefill.argmax(-1), ref_step.argmax(-1)], axis=1)
    got_tokens = np.concatenate([got_prefill.argmax(-1), got_step.argmax(-1)], axis=1)
    agree = int((ref_tokens == got_tokens).sum())
    result = {"max_abs_logit_diff": diff, "greedy_agreement": agree, "positions": int(ref_tokens.size),
              "quant": ort_model.meta["quantization"]["mode"]}
    if not quiet:
        print(f"check: onnxruntime vs HF transformers ({seq}-token prefill + 1 decode step with past): "
              f"max abs logit diff {diff:.3g}, greedy tokens agree at {agree}/{ref_tokens.size} positions")
    if result["quant"] == "f32" and not diff <= F32_TOLERANCE:
        raise CheckFailed(f"f32 export differs from HF transformers by {diff:.3g} (tolerance {F32_TOLERANCE}); "
                          "the graph does not compute what the checkpoint does")
    return result
