"""Export a plain HF model with `torch.onnx.export(dynamo=True)`: the "other exporter" input.

The passes must work on graphs fuselm's exporter did not write. This helper wraps an HF causal
LM so that the exported graph has the graph contract's inputs and outputs (`input_ids`,
`attention_mask`, `position_ids`, `past_key_values.{i}.key/value` -> `logits`,
`present.{i}.key/value`); everything inside is whatever torch.onnx writes for the HF code.
With `optimize=False` and `attn_implementation="eager"` the graph keeps every decomposed
pattern (rotate_half RoPE, hand-written RMSNorm, eager attention with repeat_kv); with torch's
defaults (`optimize=True`, sdpa) onnxscript already fuses some of them.
"""

from __future__ import annotations

import os
from pathlib import Path

from fuselm import contract


def export_hf(hf_dir: str | os.PathLike, out_path: str | os.PathLike, *, optimize: bool = False,
              attn_implementation: str = "eager", opset: int | None = contract.OPSET, dynamo: bool = True) -> Path:
    """Export the checkpoint at `hf_dir` to `out_path` (an .onnx file, weights in `<name>.data`).

    `opset=None` takes the exporter's default opset; `dynamo=False` uses the TorchScript exporter
    (its graphs carry older patterns: Constant nodes, opset 14-18 ops)."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation=attn_implementation,
                                                 local_files_only=True, use_safetensors=True,
                                                 trust_remote_code=False).eval()
    cfg = model.config
    layers = cfg.num_hidden_layers
    kv_heads = cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    class WithCache(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.m = lm

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache(config=self.m.config)
            for i in range(layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.m(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
            present = []
            for layer in out.past_key_values.layers:
                present += [layer.keys, layer.values]
            return (out.logits, *present)

    batch, seq, past_len = 1, 3, 2
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    mask = torch.ones(batch, past_len + seq, dtype=torch.long)
    pos = torch.arange(past_len, past_len + seq)[None]
    past = tuple(torch.randn(batch, kv_heads, past_len, head_dim) for _ in range(2 * layers))
    b, s, p, t = (torch.export.Dim(n) for n in ("batch", "seq", "past", "total"))
    dynamic = {contract.INPUT_IDS: {0: b, 1: s}, contract.ATTENTION_MASK: {0: b, 1: t}, contract.POSITION_IDS: {0: b, 1: s},
               "past": tuple({0: b, 2: p} for _ in range(2 * layers))}
    names_in = [*contract.STEP_INPUTS, *contract.cache_names(layers)]
    names_out = [contract.LOGITS, *contract.cache_names(layers, contract.PRESENT)]
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    args = (ids, mask, pos, *past)
    if not dynamo:
        axes = {contract.INPUT_IDS: {0: "batch", 1: "seq"}, contract.ATTENTION_MASK: {0: "batch", 1: "total"},
                contract.POSITION_IDS: {0: "batch", 1: "seq"}, contract.LOGITS: {0: "batch", 1: "seq"}}
        axes.update({n: {0: "batch", 2: "past"} for n in names_in[3:]})
        axes.update({n: {0: "batch", 2: "total"} for n in names_out[1:]})
        with torch.no_grad():
            torch.onnx.export(WithCache(model).eval(), args, str(out_path), dynamo=False, opset_version=opset,
                              input_names=names_in, output_names=names_out, dynamic_axes=axes)
        return out_path
    kwargs = {} if opset is None else {"opset_version": opset}
    program = torch.onnx.export(WithCache(model).eval(), args, dynamo=True, dynamic_shapes=dynamic,
                                input_names=names_in, output_names=names_out, optimize=optimize, **kwargs)
    program.save(str(out_path), external_data=True)
    return out_path
