"""Run by the optimum side environment (scripts/setup.sh: .venv-optimum, transformers < 4.58):
a tiny random Qwen3 checkpoint saved by transformers itself, exported by optimum-onnx as users do
(`text-generation-with-past`, its default opset). Usage: python optimum_export.py OUT_DIR"""

import sys
from pathlib import Path

import torch
from optimum.exporters.onnx import main_export
from transformers import Qwen3Config, Qwen3ForCausalLM

out = Path(sys.argv[1])
torch.manual_seed(0)
config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=256,
                     tie_word_embeddings=False)
Qwen3ForCausalLM(config).eval().save_pretrained(out / "hf")
main_export(str(out / "hf"), output=str(out / "onnx"), task="text-generation-with-past", no_post_process=False,
            do_validation=False)
print("exported", sorted(p.name for p in (out / "onnx").iterdir()))
