"""Synthetic checkpoints: tiny HF models with random weights and a trained tokenizer.

Tests, examples and the demo build their checkpoints here (nothing is downloaded), and the
loading code they exercise is the real one: `save_pretrained` output read back from disk.
"""

from __future__ import annotations

import os
from pathlib import Path

# A small corpus for the BPE tokenizer; enough merges for readable demo output.
_CORPUS = """\
fuselm turns a hugging face checkpoint into a fused onnx graph and runs it on apple gpus.
the quick brown fox jumps over the lazy dog. the cat sat on the mat.
rotary position embeddings rotate query and key vectors by an angle that grows with position.
attention reads keys and values from a cache that grows by one token at every decode step.
metal kernels fuse the query key value projections into one matrix multiplication.
rms normalization divides by the root mean square and multiplies by a learned weight.
once upon a time there was a small model that wanted to run fast on a laptop.
hello world! what is the capital of france? paris is the capital of france.
one two three four five six seven eight nine ten eleven twelve.
"""
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Tiny shapes per family; each exercises a trap: head_dim != hidden/heads (qwen3), q/k/v bias
# (qwen2), a single kv head and llama3 rope scaling (llama), sliding-window config (mistral).
TINY = {
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen2": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=1, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 16}),
    "mistral": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, sliding_window=None,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Families only the traced exporter converts (exporter/traced/). Gemma 3: a sliding and a global
    # layer with their own rope (linear scaling on the global one), one kv head, head_dim 32 != 64/4,
    # attention and final logit soft-capping, a window shorter than the tests' prompts.
    "gemma3_text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=32, tie_word_embeddings=True, sliding_window=4,
                        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=32,
                        attn_logit_softcapping=20.0, final_logit_softcapping=15.0,
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                            "rope_theta": 1000000.0}}),
    # Phi-3: fused qkv_proj and gate_up_proj, partial rotary (half of head_dim).
    "phi3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    # OLMo 2: q/k norms over the whole projection, norms after attention and MLP (no pre-norms).
    "olmo2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    # SmolLM3: layer 1 has no rope (no_rope_layers 0), yarn scaling on the others.
    "smollm3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, tie_word_embeddings=True, no_rope_layers=[1, 0],
                    rope_parameters={"rope_type": "yarn", "rope_theta": 2000000.0, "factor": 2.0,
                                     "original_max_position_embeddings": 128}),
    # GLM-4: interleaved rope on half of head_dim, post-norms, fused gate_up.
    "glm4": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    # Granite: embedding, attention, residual multipliers and logits scaling.
    "granite": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, tie_word_embeddings=False, embedding_multiplier=3.0,
                    attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=4.0,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


# Sizes for any other model_type (the names most decoder configs share).
GENERIC_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16)

# Recurrent-state hybrids (exporter/traced/state_ops.py): a state layer then an attention layer. Gated DeltaNet
# with 2 key heads serving 4 value heads; Mamba-2 with 2 groups of B/C serving 4 heads and chunks shorter than the
# tests' prompts (transformers' chunked scan carries its state across them); experts at the MoE tests' size.
_EXPERTS = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=48, shared_intermediate_size=48)
_GDN = dict(GENERIC_TINY, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"])
_MAMBA2 = dict(GENERIC_TINY, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4,
               mamba_expand=2, mamba_chunk_size=8)
TINY.update({
    "qwen3_5_text": _GDN, "qwen3_next": dict(_GDN, **_EXPERTS, decoder_sparse_step=1),
    "qwen3_5_moe_text": dict(_GDN, **_EXPERTS), "olmo_hybrid": _GDN,
    "granitemoehybrid": dict(_MAMBA2, **_EXPERTS, layer_types=["mamba", "attention"]),
    "bamba": dict(_MAMBA2, attn_layer_indices=[1]), "falcon_h1": dict(_MAMBA2, mamba_d_ssm=128),
    # Nemotron-H: Mamba-2, MLP, attention (no rope), MLP blocks
    "nemotron_h": dict(GENERIC_TINY, mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=16, n_groups=2, conv_kernel=4,
                       expand=2, chunk_size=8, num_hidden_layers=4, layers_block_type=["mamba", "mlp", "attention", "mlp"]),
    # attention-free state-space models: Mamba-2 (2 groups of B/C), Mamba-1 and Falcon-Mamba's selective scans
    "mamba2": dict(hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=32, state_size=16, n_groups=2, expand=2,
                   conv_kernel=4, chunk_size=8),
    "mamba": dict(hidden_size=64, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4, time_step_rank=8),
    "falcon_mamba": dict(hidden_size=64, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4, time_step_rank=8),
    # Jamba: a Mamba-1 layer, then attention (no rope) with experts
    "jamba": dict(GENERIC_TINY, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
                  use_mamba_kernels=False),
    # Kimi-Linear: Kimi delta attention (a decay per key channel), then latent attention without rope; experts
    "kimi_linear": dict(GENERIC_TINY, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
                        v_head_dim=16, qk_nope_head_dim=8, qk_head_dim=16, num_experts=4, num_experts_per_token=2,
                        num_shared_experts=1, moe_intermediate_size=32, layer_types=["linear_attention", "full_attention"],
                        mlp_layer_types=["dense", "sparse"], linear_head_dim=16, linear_num_heads=4,
                        linear_conv_kernel_dim=4),
    # Zamba / Zamba2: a Mamba layer, then hybrid ones (shared attention over the embeddings and the stream; Zamba ties
    # its shared block across two of them)
    "zamba": dict(GENERIC_TINY, num_key_value_heads=4, attention_head_dim=32, attn_layer_period=2, attn_layer_offset=1,
                  num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "hybrid"], n_mamba_heads=2,
                  mamba_d_state=8, mamba_dt_rank=8),
    "zamba2": dict(GENERIC_TINY, num_key_value_heads=4, attention_head_dim=32, layers_block_type=["mamba", "hybrid"],
                   hybrid_layer_ids=[1], mamba_d_state=16, n_mamba_heads=4, chunk_size=8),
    # LFM2: a short-convolution layer, then attention
    "lfm2": dict(GENERIC_TINY, layer_types=["conv", "full_attention"], conv_L_cache=3, block_auto_adjust_ff_dim=False),
    "lfm2_moe": dict(GENERIC_TINY, **_EXPERTS, layer_types=["conv", "full_attention"], conv_L_cache=3, num_dense_layers=1),
})


def train_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on the built-in corpus, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, chat_template=CHAT_TEMPLATE)


def make_config(family: str, vocab_size: int = 384, generic: bool = False, **overrides):
    """A transformers config of `family` (a key of TINY: its model_type) with tiny defaults;
    `generic`: any model_type, with GENERIC_TINY's sizes (scripts/traced_sweep.py)."""
    from transformers import AutoConfig

    if family not in TINY and not generic:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(TINY)} (or pass generic=True)")
    kwargs = {**TINY.get(family, GENERIC_TINY), "vocab_size": vocab_size, "max_position_embeddings": 256,
              "bos_token_id": None, "eos_token_id": 2, "pad_token_id": 0, **overrides}
    return AutoConfig.for_model(family, **kwargs)


def make_checkpoint(out: str | os.PathLike, family: str = "qwen3", seed: int = 0, dtype: str = "float32",
                    shard_size: str | None = None, train_steps: int = 0, generic: bool = False, **overrides) -> Path:
    """Write a random-weight HF checkpoint (config, safetensors, tokenizer, generation config).

    With `train_steps` > 0 the model is first trained on the built-in corpus (a few hundred steps
    memorize it), so the demo generates readable text instead of random tokens.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out)
    tok = train_tokenizer()
    config = make_config(family, vocab_size=len(tok), generic=generic, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    # HF's default init (std 0.02) makes near-uniform logits; larger weights give decisive greedy
    # tokens, so token-equality tests are meaningful.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08 if "embed" not in name else 1.0)
    if train_steps:
        _train(model, tok, train_steps, seed)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(out, **kwargs)
    tok.save_pretrained(out)
    GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
                     bos_token_id=None, do_sample=False).save_pretrained(out)
    return out


def _train(model, tok, steps: int, seed: int, seq_len: int = 32, batch: int = 8) -> float:
    """Fit the model to the built-in corpus (next-token loss, AdamW); returns the last loss."""
    import torch

    ids = tok(_CORPUS.replace("\n", " "), return_tensors="pt").input_ids[0]
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - seq_len - 1, (batch,), generator=gen)
        x = torch.stack([ids[s:s + seq_len] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss)
