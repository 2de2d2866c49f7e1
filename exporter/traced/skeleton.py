"""The HF model without weights, checked for what the traced exporter can express.

`Skeleton(hf_dir)` reads config.json with transformers (local files, no remote code), builds
transformers' own class for the model_type with every parameter on the meta device (buffers stay
real: inv_freq, embed scales), and refuses what it cannot export: remote code, vision/audio towers,
mixture-of-experts blocks it does not recognise, hybrid (linear attention / state space) layers,
rope types whose frequencies change with the sequence length, models without a key/value cache.

`probe()` runs the model's own forward once on CPU with every decoder layer replaced by a
recorder: which rotary frequencies (if any: learned position tables and ALiBi biases are computed by
the model around the layers) and which mask (causal, sliding window, chunked) each layer gets, and
which other tensors the model hands every layer (side inputs: ALiBi biases).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import re
from collections import UserDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from fuselm import contract
from fuselm.errors import FuselmError

from . import block_indexer, moe, state_ops
from .attention_op import NAME, register
from .rope_op import RopeSpec, rope_layouts

# Module class names (substrings) of what the exporter refuses, found in the built model (a config's
# num_experts alone does not make a model sparse: Doge keeps it with is_moe false).
# Sparse MoE blocks that moe.py recognises are exported (fuselm::MoE); any other "Moe" / "Experts" module is refused.
_REFUSED_MODULES = {"Moe": "it is a mixture-of-experts model", "Experts": "it is a mixture-of-experts model",
                    "Mamba": "it has state-space (Mamba) layers", "GatedDeltaNet": "it has linear-attention layers",
                    "LinearAttention": "it has linear-attention layers", "ShortConv": "it has convolution layers",
                    "DeltaAttention": "it has linear-attention layers (Kimi delta attention)",
                    "Lightning": "it has linear-attention layers (lightning attention)",
                    "Rglru": "it has recurrent (RG-LRU) layers", "Rwkv": "it has RWKV (recurrent) layers",
                    "LSTM": "it has xLSTM (recurrent) layers",
                    "Vision": "it has a vision tower (a multimodal model)", "Audio": "it has an audio tower (a multimodal model)"}
# recurrent-state modules converted where the modeling file has a kernel state_ops.py swaps for a fuselm op
_STATE_KERNELS = {"Mamba": ("mamba2_scan_forward", "mamba_scan_forward", "mamba_selective_scan"),
                  "GatedDeltaNet": ("torch_chunk_gated_delta_rule",),
                  "LinearAttention": ("torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention"),
                  "ShortConv": ("causal_conv1d_forward",), "DeltaAttention": ("chunk_kimi_delta_attention",),
                  "Lightning": ("MiniMaxLightningAttention",)}
_OTHER_RECURRENCES = ("Rglru", "Rwkv", "LSTM")
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "indexed_attention",
                          "hybrid_sliding")
# layer types of recurrent-state and feed-forward blocks (what each holds is found by tracing it)
_STATE_LAYER_TYPES = ("attention", "linear_attention", "mamba", "conv", "hybrid", "mlp", "moe")
_LAYER_TYPE_REASONS: dict[str, str] = {}  # what a layer type needs that the graph contract does not have
REFUSED_ROPE_TYPES = {"dynamic": "dynamic NTK scaling recomputes the frequencies from the sequence length at run time",
                      "longrope": "longrope switches between two frequency sets at run time by sequence length"}
_CACHE_ARGS = ("past_key_values", "past_key_value", "layer_past", "cache")  # what transformers' layers call it
# what the traced layer takes from the graph itself (the rest of its tensor arguments are per-token or side inputs)
_LAYER_ARGS = ("attention_mask", "position_ids", "position_embeddings", "cache_position", *_CACHE_ARGS)
# the attention's mask under another name, beside a recurrent block's padding mask (Zamba2's hybrid layers)
_MASK_ARGS = ("causal_mask",)
PROBE_LEN = 8
PROBE_WINDOW = 3  # sliding_window during the probe, so sliding layers show in an 8-token mask
PROBE_CHUNK = 4  # attention_chunk_size during the probe: chunked layers show as two 4-token blocks


@contextlib.contextmanager
def params_on_meta():
    """Every parameter created inside goes to the meta device; buffers stay real (accelerate's
    `init_empty_weights(include_buffers=False)`)."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def placeholders(module: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Give every meta parameter of `module` real-shaped uninitialized memory; returns what to undo."""
    undo = []
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and p.device.type == "meta":
                undo.append((m, name, p))
                m._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=torch.float32), requires_grad=False)
    by_id = {}
    for m, name, p in undo:  # tied parameters must stay one object
        m._parameters[name] = by_id.setdefault(id(p), m._parameters[name])
    return undo


def restore(undo) -> None:
    for m, name, p in undo:
        m._parameters[name] = p


MASKS = ("causal", "sliding", "chunked")  # the mask kinds a layer may get (exporter/graph.py's attention_mask)
NO_MASK = "none"  # a recurrent-state or feed-forward block: the model gives it no attention mask


@dataclass
class LayerPlan:
    """One decoder layer: its index, its rotary (None: no rope), its mask kind, its kind key, and how it
    is called (trace.py): its hidden state's shape in the probe, the other tensors the model hands it
    (`inputs`: Gemma's per-layer inputs, by name and probe shape; `side`: any other, ALiBi's biases) and the
    name of a shared-KV mapping it gets (`shares`: Gemma 3n / 4 pass the keys and values of one layer to later
    ones)."""

    index: int
    rope: RopeSpec | None
    mask: str = "causal"
    kind: int = -1
    kwargs: dict = field(default_factory=dict)  # the model's other (non-tensor) arguments to the layer
    cache_arg: str = "past_key_values"  # the layer's name for its cache argument
    hidden: tuple = ()  # the hidden state's probe shape ([..., 1, PROBE_LEN, ..., hidden]: AltUp's streams lead, HC's follow)
    inputs: dict = field(default_factory=dict)  # name -> probe shape of the layer's other float tensor inputs
    shares: str | None = None  # the argument holding the shared keys/values
    cache: str = "kv"  # how the layer uses its cache (trace.py CACHE_MODES), set by its kind's dry run
    share: tuple | None = None  # ("store" | "reuse", key) of the shared-KV mapping, set by the dry run
    kv_source: int | None = None  # a "reuse" layer: the layer whose keys/values it reads
    attends: tuple | None = None  # (heads, head_dim) of the keys attention reads, from the dry run
    side: tuple[str, ...] = ()  # other tensors the model computes for the layer (ALiBi biases), by name
    mask_form: str = "additive"  # or "masked": a boolean mask, True where attention is masked (MPT)
    mask_arg: str = "attention_mask"  # the argument the graph's mask goes to (_MASK_ARGS: the padding mask then None)
    rotary: bool = True  # the model passes it position embeddings (Nemotron-H's and Granite 4's attention: none)
    layer_type: str = ""  # what the trace found (fuselm.json's layer_types): full_attention, mamba2, ...
    index_dim: int = 0  # the width of its indexer's keys (the `.index` cache) where the layer keeps them
    # (argument, layer j): the model hands the layer what layer j returned beside its hidden state (a shared DSA
    # layer reuses layer j's top-k keys); `gives`: a later layer reads what this one returns so
    carried: tuple[str, int] | None = None
    gives: bool = False

    @property
    def masked(self) -> bool:
        return self.mask != NO_MASK

    @property
    def sliding(self) -> bool:
        return self.mask == "sliding"


class Skeleton:
    """transformers' model for a checkpoint directory, parameters on meta."""

    def __init__(self, hf_dir: Path, config_dict: dict):
        from transformers import AutoConfig

        self.hf_dir, self.raw = hf_dir, config_dict
        self.model_type = config_dict.get("model_type")
        if config_dict.get("auto_map"):
            raise FuselmError(f"config.json: auto_map names remote code ({', '.join(config_dict['auto_map'])}); fuselm "
                              "never runs a checkpoint's own code (trust_remote_code); use a model_type that the "
                              "installed transformers implements")
        try:
            config = AutoConfig.from_pretrained(hf_dir, local_files_only=True, trust_remote_code=False)
        except (ValueError, KeyError, OSError) as e:
            raise FuselmError(f"model_type {self.model_type!r} is not known to the installed transformers "
                              f"({_first_line(e)}); use a checkpoint of a model_type it implements") from None
        except Exception as e:  # transformers' own config validation (types, ranges)
            raise FuselmError(f"config.json is not a valid {self.model_type!r} config for transformers "
                              f"({type(e).__name__}: {_first_line(e)}); use the config.json that came with the "
                              "checkpoint") from None
        self._refuse_layer_types(config)
        self._refuse_rope(config)
        register()
        config.use_cache = False
        # Attention goes through transformers' attention interface (fuselm_trace, one Attention op); a
        # model that computes it in its own code (Falcon) is built eager and its cache update traced.
        self.inline_attention = False
        try:
            model = self._build(config, NAME)
        except KeyError as e:
            if e.args != (NAME,):
                raise self._cannot_build(e) from None
            self.inline_attention = True
            model = self._build(config, "eager")
        self.config, self.model = config, model.eval()
        forward = inspect.signature(type(model).forward).parameters
        if not any(k in forward for k in (*_CACHE_ARGS, "cache_params", "state")):
            raise FuselmError(f"model_type {self.model_type!r} is not supported: transformers' {type(model).__name__} "
                              "keeps no key/value cache (its forward takes none, and its causal mask is cut for the "
                              "whole sequence at once); fuselm graphs decode one step at a time from a cache")
        scaled = moe.scaled_input(model)  # experts on inputs scaled by the router's scores: from gathered weights
        self.moe_blocks = moe.find_blocks(model, self.model_type, skip=scaled)
        self.dense_experts = dense = moe.dense_experts(model, self.moe_blocks)
        if dense:  # experts fuselm::MoE cannot express: transformers' batched_mm in standard ops
            config._experts_implementation = "batched_mm"
        self.grouped = moe.grouped(model)  # routers that sort tokens by expert: traced per (token, slot) row
        moe.verify_grouped(self.grouped, self.model_type)
        looped = moe.looped(model)  # experts that loop over the routed experts: from gathered weights
        moe.verify_looped(looped, self.model_type)
        self.grouped += looped + scaled
        dense = [*dense, *self.grouped]
        dense += moe.shared_experts(model)  # stacked shared experts run on every token: plain nodes, as written
        inside_moe = moe.covered(model, self.moe_blocks) | {id(m) for d in dense for m in d.modules()}
        modeling = importlib.import_module(type(model).__module__)
        family = type(model).__name__.removesuffix("ForCausalLM")  # (GraniteMoeHybrid: a name, not its experts)
        for name, module in model.named_modules():
            kind = type(module).__name__.removeprefix(family).lower()
            for part, why in _REFUSED_MODULES.items():
                if part in _STATE_KERNELS and any(k in vars(modeling) for k in _STATE_KERNELS[part]):
                    continue
                if part == "Rglru" and state_ops.griffin_classes(modeling):  # Griffin's block, traced as state ops
                    continue
                if (self.moe_blocks or dense) and (part == "Moe" or id(module) in inside_moe):
                    continue  # a model with recognised blocks: only experts outside them are refused
                # (a recurrence no op computes, named by its family: RWKV's, xLSTM's layers)
                if part.lower() in kind or (part in _OTHER_RECURRENCES and part.lower() in type(module).__name__.lower()):
                    if part in ("Moe", "Experts") and (why_not := moe.unrecognised(model, self.moe_blocks, dense)):
                        raise FuselmError(f"model_type {self.model_type!r} is not supported: it is a mixture-of-"
                                          f"experts model with {why_not}")
                    if part in _STATE_KERNELS:
                        why += (f", written around none of the functions fuselm traces as one state op "
                                f"({', '.join(_STATE_KERNELS[part])})")
                    elif part in _OTHER_RECURRENCES:
                        why += ", a recurrence none of fuselm's state ops computes (" + ", ".join(contract.STATE_OPS) + ")"
                    if part in ("Vision", "Audio") and _setting(config, "text_config") is not None:
                        why += "; convert its text-only checkpoint"
                    if part == "Experts":  # experts of another layout than the stacked one fuselm::MoE reads
                        tensors = ", ".join(f"{n} {list(p.shape)}" for n, p in module.named_parameters())
                        why = (f"it is a mixture-of-experts model whose experts ({tensors}) are not the stacked "
                               "gate_up_proj [E, 2I, H] / down_proj [E, H, I] beside a router of one weight [E, H] "
                               "that fuselm::MoE reads")
                    raise FuselmError(f"model_type {self.model_type!r} is not supported: {why} "
                                      f"({type(module).__name__}{f' at {name}' if name else ''})")
        self.layers_name, self.layers = self._find_layers()
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        self._renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
        heads = _setting(config, "num_attention_heads")
        self.head_dim = _setting(config, "head_dim") or (config.hidden_size // heads if heads else None)
        self.modeling = importlib.import_module(type(self.layers[0]).__module__)
        block_indexer.verify(self.model, config, self.model_type)
        state_ops.verify(self.modeling, self.model_type, config)

    def _build(self, config, implementation: str):
        from transformers import AutoModelForCausalLM

        config._attn_implementation = implementation
        try:
            with params_on_meta(), torch.device("cpu"):
                return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=implementation)
        except ValueError as e:  # no causal-LM class for this config
            raise FuselmError(f"model_type {self.model_type!r}: transformers has no causal LM for it "
                              f"({_first_line(e)}); fuselm converts decoder-only causal LMs") from None
        except KeyError:
            raise
        except Exception as e:  # the model's constructor rejects the config (sizes that do not divide, ...)
            raise self._cannot_build(e) from None

    def _cannot_build(self, e: Exception) -> FuselmError:
        return FuselmError(f"model_type {self.model_type!r}: transformers cannot build the model from config.json "
                           f"({type(e).__name__}: {_first_line(e)}); use the config.json that came with the checkpoint")

    def _refuse_layer_types(self, config) -> None:
        types = getattr(config, "layer_types", None) or []
        odd = sorted({t for t in types if t not in _ATTENTION_LAYER_TYPES + _STATE_LAYER_TYPES})
        if odd:
            why = "; ".join(_LAYER_TYPE_REASONS[t] for t in odd if t in _LAYER_TYPE_REASONS) or "hybrid attention"
            raise FuselmError(f"model_type {self.model_type!r} is not supported: it has {', '.join(odd)} layers "
                              f"({why}); fuselm converts full / sliding-window / chunked attention, linear-attention, "
                              "state-space and short-convolution layers")

    def _refuse_rope(self, config) -> None:
        params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        nested = [p for p in params.values() if isinstance(p, dict)] if isinstance(params, dict) else []
        for p in [params, *nested]:
            if not isinstance(p, dict):
                continue
            kind = p.get("rope_type", p.get("type"))
            if isinstance(kind, str) and kind in REFUSED_ROPE_TYPES:
                raise FuselmError(f"rope type {kind!r} is not supported by the traced exporter: "
                                  f"{REFUSED_ROPE_TYPES[kind]}, and FusedRoPE carries fixed frequencies. Use a "
                                  "checkpoint with a static rope type (default, linear, llama3, yarn, ...)")

    def _find_layers(self) -> tuple[str, nn.ModuleList]:
        """The decoder layers, found by structure: the one ModuleList of num_hidden_layers modules of
        one class (`model.layers`, GPT-J's `transformer.h`, GPT-NeoX's `gpt_neox.layers`)."""
        n = self.config.num_hidden_layers
        lists = [(name, m) for name, m in self.model.named_modules() if isinstance(m, nn.ModuleList)]
        found = [(name, m) for name, m in lists if len(m) == n and len({type(x) for x in m}) == 1]
        of_n = [(name, m) for name, m in lists if len(m) == n]
        if not found and len(of_n) == 1:  # hybrids with a class per layer kind (OLMo-Hybrid, Zamba2)
            found = of_n
        if len(found) != 1:
            stacks = ", ".join(f"{name} ({len(m)} x {'/'.join(sorted({type(x).__name__ for x in m}))})"
                               for name, m in lists if len(m)) or "none"
            raise FuselmError(f"model_type {self.model_type!r}: cannot tell its {n} decoder layers: "
                              f"{'no' if not found else 'more than one'} ModuleList of {n} modules of one class "
                              f"(its module lists: {stacks}); the traced exporter converts one stack of decoder layers")
        return found[0]

    @property
    def base(self) -> nn.Module:
        """The module that owns the layer list (HF's `XModel`)."""
        return self.model.get_submodule(self.layers_name.rsplit(".", 1)[0]) if "." in self.layers_name else self.model

    def model_name(self, stored: str) -> str:
        """A checkpoint tensor's name in the model: transformers' own load-time renames for this
        architecture (its conversion mapping: GPT-NeoX's `embed_out` -> `lm_head`)."""
        name = stored
        for renaming in self._renamings:  # each in turn (transformers' apply_renamings, not in 5.17)
            name, _ = renaming.rename_source_key(name)
        return name

    def conversions(self, stored: dict[str, tuple]) -> tuple[dict[str, list], str | None]:
        """transformers' load-time conversions of this architecture that make one model tensor from one `stored`
        one (its Transpose, Chunk, Split: Ergo's router kept [H, E], a fused qkv kept whole), as Checkpoint.convert's
        views; and, as "source -> target: operations", the others that apply to `stored` and that fuselm does not
        (expert stacking aside: moe.stack_experts)."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import Chunk, Split, Transpose, WeightConverter

        expected = self.expected_tensors()
        views, others = {}, []
        for c in get_model_conversion_mapping(self.model):
            ops = list(getattr(c, "operations", []))
            names = [type(o).__name__ for o in ops]
            if not isinstance(c, WeightConverter) or set(names) <= {"MergeModulelist", "Concatenate"}:
                continue
            matched = [n for n in stored for src in c.source_patterns if re.search(src, n)]
            if not matched:
                continue
            op = ops[0] if len(ops) == 1 and len(c.source_patterns) == 1 else None
            if isinstance(op, Transpose | Chunk | Split) and getattr(op, "num_shards_attribute", None) is None:
                for n in matched:
                    targets = [re.sub(c.source_patterns[0], t, n) for t in c.target_patterns]
                    shape = stored[n][2]
                    if isinstance(op, Transpose):
                        if not (op.check_dims and tuple(shape) == tuple(expected.get(targets[0], ()))):
                            views[targets[0]] = [n, "transpose", op.dim0, op.dim1]
                        continue
                    sizes = ([shape[op.dim] // len(targets)] * len(targets) if isinstance(op, Chunk)
                             else [expected.get(t, (0,) * (op.dim + 1))[op.dim] for t in targets])
                    at = 0
                    for t, size in zip(targets, sizes, strict=True):
                        views[t] = [n, "slice", op.dim, at, at + size]
                        at += size
                continue
            others.append(f"{', '.join(c.source_patterns)} -> {', '.join(c.target_patterns)}: {', '.join(names)}")
        return views, "; ".join(others) or None

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor the model expects: parameters (tied ones once) and persistent buffers."""
        out = {name: tuple(p.shape) for name, p in self.model.named_parameters()}
        persistent = set(self.model.state_dict(keep_vars=True))
        out.update({name: tuple(b.shape) for name, b in self.model.named_buffers() if name in persistent})
        return out

    def tied_names(self) -> set[str]:
        """State-dict names that alias another parameter (a tied lm_head): allowed in the checkpoint."""
        return set(self.model.state_dict(keep_vars=True)) - set(self.expected_tensors())

    def aliases(self) -> dict[str, str]:
        """Parameter name -> the name it is stored under (a tied lm_head.weight -> the embedding's)."""
        first: dict[int, str] = {}
        return {name: first.setdefault(id(p), name) for name, p in self.model.named_parameters(remove_duplicate=False)}

    def embed_name(self) -> str:
        """The input embedding's weight (`get_input_embeddings()`), by its stored name."""
        return self._param_name(self.model.get_input_embeddings())

    def head_name(self) -> str:
        """The head's weight (`get_output_embeddings()`), by its stored name (the embedding's when tied)."""
        head = self.model.get_output_embeddings()
        if head is None:
            raise FuselmError(f"model_type {self.model_type!r}: transformers' model has no output embedding "
                              "(get_output_embeddings() is None); fuselm converts causal LMs with a head")
        return self._param_name(head)

    def _param_name(self, module: nn.Module) -> str:
        return next(n for n, p in self.model.named_parameters() if p is module.weight)

    def metadata(self, plans: list[LayerPlan], kinds: int, kv_shapes: list[tuple[int, int, int]]) -> dict:
        """The model-specific fields of fuselm.json (exporter/README.md); rope from the first rotary layer; dims'
        kv_heads / head_dim are those of the keys layer 0's attention reads (a latent layer's expanded ones),
        `attention` has every layer's cache (contract.attention_meta)."""
        c = self.config
        attending = next((k for k in kv_shapes if any(k)), (0, 0, 0))  # the first layer that attends
        kv_shape = plans[0].attends or attending[:2]
        rope = next((p.rope for p in plans if p.rope is not None), None)
        sliding = any(p.sliding for p in plans)
        chunked = any(p.mask == "chunked" for p in plans)
        params = getattr(c, "rope_parameters", None) or {}
        return {
            "family": self.model_type,
            "model_type": self.model_type,
            "architecture": (self.raw.get("architectures") or [type(self.model).__name__])[0],
            "dims": {k: v for k, v in {  # attention's dims only where a layer attends (not a pure Mamba-2 model)
                "layers": c.num_hidden_layers, "hidden": c.hidden_size, "heads": _setting(c, "num_attention_heads"),
                "kv_heads": kv_shape[0], "head_dim": kv_shape[1], "intermediate": _first(_setting(c, "intermediate_size")),
                "vocab": c.vocab_size}.items() if v or k == "intermediate"},
            "rms_norm_eps": getattr(c, "rms_norm_eps", None),
            "tie_word_embeddings": bool(self.tied_names()),
            "max_position_embeddings": getattr(c, "max_position_embeddings", None),
            "sliding_window": getattr(c, "sliding_window", None) if sliding else None,
            "rope": {"type": params.get("rope_type") if isinstance(params.get("rope_type"), str) else "per_layer_type",
                     "theta": params.get("rope_theta"), "scaling": params,
                     "rotary_dim": 2 * len(rope.inv_freq) if rope else 0,
                     "inv_freq_len": len(rope.inv_freq) if rope else 0,
                     "attention_scaling": rope.attention_scaling if rope else 1.0,
                     "interleaved": rope.interleaved if rope else 0,
                     "layers_without_rope": [p.index for p in plans if p.rope is None]},
            "positions": self.positions,
            "traced": {"layer_kinds": kinds, "sliding_layers": [p.index for p in plans if p.sliding],
                       "chunked_layers": [p.index for p in plans if p.mask == "chunked"],
                       "side_inputs": sorted({k for p in plans for k in p.side})},
            "layer_types": [p.layer_type for p in plans],
            "attention": contract.attention_meta(
                [{"mask": "none", "cache": "none"} if not any(k) else
                 {"mask": p.mask, "cache": "shared" if p.kv_source is not None else
                  ("latent" if p.cache == "latent" else "kv"), "kv_heads": k[0], "key_dim": k[1], "value_dim": k[2],
                  **({"kv_source": p.kv_source} if p.kv_source is not None else {}),
                  **({"index_dim": p.index_dim} if p.index_dim else {}),
                  **({"index_topk": _setting(c, "index_topk")} if p.index_dim and _setting(c, "index_topk") else {}),
                  **({"reads_layer": p.carried[1]} if p.carried else {})}
                 for p, k in zip(plans, kv_shapes, strict=True)],
                sliding_window=getattr(c, "sliding_window", None) if sliding else None,
                chunk_size=getattr(c, "attention_chunk_size", None) if chunked else None),
        }

    def probe(self) -> list[LayerPlan]:
        """Run the base model's forward once with recorder layers; one LayerPlan per decoder layer."""
        config = self.config
        # the rotary module is whichever module outside the layers returns the pair the layers receive
        inside = {id(m) for layer in self.layers for m in layer.modules()}
        rotaries = [m for m in self.base.modules() if id(m) not in inside and m is not self.base and m is not self.layers]
        tags: dict[int, tuple] = {}

        def tagged(module, forward):
            def run(*args, **kwargs):
                out = forward(*args, **kwargs)
                if isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out):
                    tags[id(out[0])] = (module, args, kwargs, *out)
                elif isinstance(out, torch.Tensor) and out.is_complex():  # polar(1, freqs): Llama 4, DeepSeek-V2
                    tags[id(out)] = (module, args, kwargs, out, None)
                return out
            return run

        window = getattr(config, "sliding_window", None)
        chunk = getattr(config, "attention_chunk_size", None)
        try:
            for m in rotaries:
                m.forward = tagged(m, m.forward)
            if window is not None:
                config.sliding_window = PROBE_WINDOW
            if chunk is not None:
                config.attention_chunk_size = PROBE_CHUNK
            seen = self._record(1, PROBE_LEN, find_returns=True)
        finally:
            config.sliding_window = window
            if chunk is not None:
                config.attention_chunk_size = chunk
            for m in rotaries:
                del m.forward  # back to the class's
        positions = self.positions_fed  # the tensor itself: _angles finds it among the rotary module's arguments
        causal = torch.ones(PROBE_LEN, PROBE_LEN).tril().bool()
        blocks = torch.arange(PROBE_LEN) // PROBE_CHUNK
        patterns = {"causal": causal, "sliding": causal & ~torch.ones(PROBE_LEN, PROBE_LEN).tril(-PROBE_WINDOW).bool(),
                    "chunked": causal & (blocks[:, None] == blocks[None, :])}
        plans, specs = [], {}
        for i, kwargs in enumerate(seen):
            carried = [(k, v.source) for k, v in kwargs.items() if isinstance(v, CarriedMark)]
            kwargs = {k: v for k, v in kwargs.items() if not isinstance(v, CarriedMark)}
            pe = kwargs.get("position_embeddings")
            first = None  # no rotary from the model: positions enter around the layers (tables, ALiBi) or in them
            if pe is not None:
                first = pe if isinstance(pe, torch.Tensor) else pe[0]  # one complex tensor, or (cos, sin)
                # what a rotary module returned, or a view of all of it (Gemma 4 slices them to the kept positions)
                tag = tags.get(id(first)) or next((t for t in tags.values() if _same_tensor(first, t[3])), None)
                if tag is None:
                    raise FuselmError(f"model_type {self.model_type!r}: decoder layer {i} gets cos/sin that no rotary "
                                      "embedding module made; not supported by the traced exporter")
                first = tag[3]
                if id(first) not in specs:
                    specs[id(first)] = self._rope_spec(*tag, positions)
            given = kwargs.get("attention_mask")
            if isinstance(given, dict):
                raise FuselmError(f"model_type {self.model_type!r}: decoder layer {i} takes a mapping of masks "
                                  f"({', '.join(map(str, given))}) where fuselm gives a layer one attention mask (its "
                                  "attention reads other state from the cache beside keys and values); not supported "
                                  "by the traced exporter")
            # a recurrent-state or feed-forward block: no mask, or Mamba's padding mask [B, T] (all ones without padding)
            unmasked = "attention_mask" in kwargs and (given is None or (isinstance(given, torch.Tensor) and given.dim() == 2))
            # (a layer without an attention module ignores it: Zamba2's Mamba layers get it too)
            attends = any("attention" in type(m).__name__.lower() for m in self.layers[i].modules())
            mask_arg = next((k for k in _MASK_ARGS if unmasked and attends and isinstance(kwargs.get(k), torch.Tensor)),
                            "attention_mask")
            mask, mask_form = (NO_MASK, "additive") if unmasked and mask_arg == "attention_mask" else \
                self._mask({"attention_mask": kwargs[mask_arg]}, i, patterns, window, chunk)
            plans.append(self._plan(i, kwargs, specs[id(first)] if first is not None else None, mask, mask_form))
            plans[-1].mask_arg = mask_arg
            plans[-1].rotary = pe is not None  # attention without positions (Nemotron-H's, Granite 4's): none given
            if len(carried) > 1:
                raise FuselmError(f"model_type {self.model_type!r}: decoder layer {i} reads {len(carried)} tensors "
                                  "earlier layers returned; not supported by the traced exporter")
            if carried:
                plans[-1].carried = carried[0]
                plans[carried[0][1]].gives = True
        self.positions = self._positions(seen[0]) if all(p.rope is None for p in plans) else "rotary"
        return plans

    def _mask(self, kwargs: dict, i: int, patterns: dict, window, chunk) -> tuple[str, str]:
        """The mask kind (MASKS) of the mask a layer got in the probe, and its form: "additive", or "masked" for a
        boolean mask True where attention is masked (MPT casts the additive mask to bool); anything else is refused."""
        allowed = _allowed(kwargs.get("attention_mask"), i, self.model_type)
        mask_form = "masked" if allowed.dtype == torch.bool and not allowed[0, 0] else "additive"
        allowed = ~allowed if mask_form == "masked" else allowed
        mask = next((m for m, p in patterns.items() if torch.equal(allowed, p)
                     and (m != "sliding" or window is not None) and (m != "chunked" or chunk is not None)), None)
        if mask is None:
            raise FuselmError(f"model_type {self.model_type!r}: decoder layer {i} uses a mask that is neither "
                              "causal, a sliding window nor chunked (bidirectional or a learned pattern); not supported")
        return mask, mask_form

    def _plan(self, i: int, kwargs: dict, rope, mask: str, mask_form: str) -> LayerPlan:
        """Layer i's plan from the arguments the model gave it in the probe."""
        cache_arg = next((k for k in _CACHE_ARGS if k in kwargs), "past_key_values")
        static = {k: v for k, v in kwargs.items() if not k.startswith("_") and k not in _LAYER_ARGS
                  and (v is None or isinstance(v, (bool, int, float, str)))}
        hidden = tuple(kwargs["_returned"].shape)
        tensors = {k: v for k, v in kwargs.items() if k not in _LAYER_ARGS + _MASK_ARGS and not k.startswith("_")
                   and isinstance(v, torch.Tensor)}
        inputs = {k: tuple(v.shape) for k, v in tensors.items()
                  if v.is_floating_point() and v.dim() >= 3 and tuple(v.shape[:2]) == (1, PROBE_LEN)}
        shares = next((k for k, v in kwargs.items() if isinstance(v, (dict, UserDict))), None)
        return LayerPlan(i, rope, mask, kwargs=static, cache_arg=cache_arg, hidden=hidden, inputs=inputs, shares=shares,
                         side=tuple(k for k in tensors if k not in inputs), mask_form=mask_form)

    def side_inputs(self, batch: int, total: int) -> list[dict[str, torch.Tensor]]:
        """Per decoder layer, the tensors the model hands it beside the hidden state, mask and positions
        (LayerPlan.side: ALiBi biases), as the model computes them for `total` tokens of `batch` rows."""
        return [{k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)} for kwargs in self._record(batch, total)]

    def _record(self, batch: int, length: int, find_returns: bool = False) -> list[dict]:
        """The base model's forward on `length` zero embeddings (or ids), every decoder layer replaced by a
        recorder: per layer, its arguments by name."""
        base, config = self.base, self.config
        seen: list[dict] = []
        chained: list[bool] = []  # whether each layer got exactly what the layer before returned

        class Stop(Exception):
            pass

        class Recorder(StandIn):
            def __init__(self, last, returns_tuple, layer):
                super().__init__(layer)
                self.last, self.returns_tuple = last, returns_tuple
                self.signature = inspect.signature(type(layer).forward)

            def forward(self, hidden_states, *args, **kwargs):
                chained.append(not seen or _same_tensor(hidden_states, seen[-1]["_returned"]))
                seen.append({**_named(self.signature, hidden_states, args, kwargs), "_returned": hidden_states})
                if self.last:
                    raise Stop
                out = _layer_output(hidden_states, self.returns_tuple)
                if self.returns_tuple == 2:  # what the layer returns beside its hidden state, marked: who reads it
                    out = (hidden_states, CarriedMark(len(seen) - 1))
                return out

        originals = list(self.layers)
        positions = self.positions_fed = torch.arange(length)[None].repeat(batch, 1)
        common = dict(position_ids=positions, attention_mask=torch.ones(batch, length, dtype=torch.long), use_cache=False)
        try:
            # transformers 5 layers return a tensor; older ones a tuple (Bamba's a pair)
            forms = (0, 1, 2) if find_returns else (self.returns_tuple,)
            for returns_tuple in forms:
                seen.clear()
                chained.clear()
                for i in range(len(originals)):
                    self.layers[i] = Recorder(i == len(originals) - 1, returns_tuple, originals[i])
                undo = placeholders(self.model)  # what runs before the layers (norms, position tables) gets memory
                try:
                    with torch.no_grad():
                        try:
                            base(inputs_embeds=torch.zeros(batch, length, config.hidden_size), **common)
                        except (RuntimeError, ValueError):  # a model that needs the ids (Gemma 4's per-layer inputs)
                            seen.clear()
                            chained.clear()
                            base(input_ids=torch.zeros(batch, length, dtype=torch.long), **common)
                except Stop:
                    pass
                except (ValueError, TypeError) as e:  # it unpacks the layer's output otherwise: the next form
                    if returns_tuple != forms[-1]:
                        chained.append(False)
                        continue
                    params = inspect.signature(type(base).forward).parameters
                    if isinstance(e, ValueError) or "inputs_embeds" in params or "input_ids" in params:
                        raise FuselmError(f"model_type {self.model_type!r}: its forward before the decoder layers "
                                          f"cannot be probed or reads more from a decoder layer than its hidden state "
                                          f"({type(e).__name__}: {_first_line(e)}); not supported by the traced "
                                          "exporter") from None
                    needs = [n for n, p in list(params.items())[1:] if p.default is inspect.Parameter.empty
                             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
                    raise FuselmError(f"model_type {self.model_type!r}: its decoder layers sit in "
                                      f"{type(base).__name__}, whose forward takes {', '.join(needs)} from the model "
                                      f"around it ({type(self.model).__name__}), not token embeddings; the traced "
                                      "exporter feeds the module that holds the layers and cannot trace this one") from None
                except Exception as e:  # noqa: BLE001 - any failure of the model's own code is the refusal's reason
                    raise FuselmError(f"model_type {self.model_type!r}: its forward before the decoder layers "
                                      f"cannot be probed ({type(e).__name__}: {_first_line(e)}); not supported by "
                                      "the traced exporter") from None
                finally:
                    restore(undo)
                if all(chained):
                    self.returns_tuple = returns_tuple
                    break
            else:
                raise FuselmError(f"model_type {self.model_type!r}: its forward changes the hidden state between "
                                  "decoder layers; not supported by the traced exporter")
        finally:
            for i, layer in enumerate(originals):
                self.layers[i] = layer
        if len(seen) != len(originals):
            raise FuselmError(f"model_type {self.model_type!r}: its forward did not call every decoder layer once; "
                              "not supported by the traced exporter")
        return seen

    def _positions(self, layer_kwargs: dict) -> str:
        """How a model without rotary layers places tokens, for fuselm.json: ALiBi biases, learned (or fixed
        sinusoidal) position tables gathered by position_ids before the layers, or none the probe sees."""
        if any(k in ("alibi", "position_bias") and isinstance(v, torch.Tensor) for k, v in layer_kwargs.items()):
            return "alibi"
        embed = self.model.get_input_embeddings()
        inside = {id(m) for layer in self.layers for m in layer.modules()}
        tables = [n for n, m in self.model.named_modules()
                  if isinstance(m, nn.Embedding) and m is not embed and id(m) not in inside]
        return f"learned: {', '.join(tables)}" if tables else "none outside the layers"

    def _rope_spec(self, module, args, kwargs, first, second, positions) -> RopeSpec:
        """The frequencies the rotary module used for this call, checked against its own cos/sin. Most
        modules hold them (`inv_freq` or `{layer_type}_inv_freq`, `attention_scaling`); from a module
        with a sin/cos table (GPT-J's `embed_positions`) they are read back from the table's angles.
        `second` None: the module returned one complex tensor (its real and imaginary parts are cos and sin)."""
        complex_pe = second is None
        if complex_pe:
            cos, sin, sin_first = first.real, first.imag, False
        else:  # (cos, sin), or (sin, cos) as GPT-J returns them: at position 0 sin is 0
            sin_first = not first[:, 0].any() and bool(second[:, 0].all())
            cos, sin = (second, first) if sin_first else (first, second)
        layer_type = next((a for a in (*args[2:], *kwargs.values()) if isinstance(a, str)), None)
        prefix = f"{layer_type}_" if layer_type else ""
        inv = getattr(module, f"{prefix}inv_freq", None)
        scaling = getattr(module, f"{prefix}attention_scaling", 1.0)
        if isinstance(inv, torch.Tensor) and inv.device.type != "meta":
            candidates = [inv.float()]
        else:  # one angle per table column; which columns are the frequencies depends on the layout
            angles, scaling = self._angles(module, args, kwargs, positions, sin_first), float(cos[0, 0, 0])
            candidates = [angles[: len(angles) // 2], angles[::2], angles]
        # rotate_half tables repeat the angles as [f, f]; interleaved ones (Cohere) as [f0, f0, f1, f1, ...];
        # GPT-J's and the complex ones hold each once
        for inv in candidates:
            freqs = positions[..., None].float() * inv.float()
            tables = (torch.cat((freqs, freqs), dim=-1), freqs.repeat_interleave(2, dim=-1), freqs)
            if any(emb.shape == cos.shape and torch.allclose(emb.cos() * scaling, cos, atol=1e-6)
                   and torch.allclose(emb.sin() * scaling, sin, atol=1e-6) for emb in tables):
                break
        else:
            raise FuselmError(f"model_type {self.model_type!r}: {type(module).__name__}'s cos/sin are not "
                              "cos/sin(position x inv_freq) x attention_scaling; not supported by the traced exporter")
        head_dim = self.head_dim
        per_layer = _setting(self.config, "per_layer_config")  # Gemma 4: head_dim per layer type
        if layer_type and per_layer is not None:
            with contextlib.suppress(KeyError, IndexError, TypeError, AttributeError):
                head_dim = per_layer[layer_type].head_dim
        layouts = rope_layouts(self.modeling, first if complex_pe else (cos, sin), positions, inv.float(), float(scaling),
                               head_dim, self.model_type)
        return RopeSpec(inv, scaling, layouts, complex_pe)

    def _angles(self, module, args, kwargs, positions, sin_first: bool) -> torch.Tensor:
        """The angle of each cos/sin column per position step (float64), read back at position 1 and
        refined at a far one: atan2 of float32 tables is 1e-7 accurate, this 1e-10."""
        far = max(2, min(4096, (getattr(self.config, "max_position_embeddings", None) or 256) - 1))

        def angle(p: int) -> torch.Tensor:
            at = torch.tensor([[p]])
            with torch.no_grad():  # the class's forward: the instance's is the probe's recorder
                a, b = type(module).forward(module, *[at if x is positions else x for x in args],
                                            **{k: at if v is positions else v for k, v in kwargs.items()})
            c, s = (b, a) if sin_first else (a, b)
            return torch.atan2(s.double(), c.double())[0, 0]

        turns = torch.round((angle(1) * far - angle(far)) / (2 * torch.pi))
        return (angle(far) + 2 * torch.pi * turns) / far


def _setting(config, name: str):
    """A config attribute, or None where it is absent or differs per layer (Gemma 4's head_dim raises then)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError
        return None


def _first(value):
    """The first layer's value of a per-layer list (Gemma 3n's intermediate_size), else the value."""
    return value[0] if isinstance(value, (list, tuple)) and value else value


def _named(signature: inspect.Signature, hidden, args, kwargs) -> dict:
    """A layer call's arguments by parameter name (Gemma 3n passes position_embeddings by position)."""
    try:
        bound = signature.bind(None, hidden, *args, **kwargs)  # (self, hidden_states, ...)
    except TypeError:
        return dict(kwargs)
    named = {}
    for name, value in list(bound.arguments.items())[2:]:
        if signature.parameters[name].kind == inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif signature.parameters[name].kind != inspect.Parameter.VAR_POSITIONAL:
            named[name] = value
    return named


def _same_tensor(a, b) -> bool:
    """`a` is `b`, or a view of all of it (Gemma 4 slices the hidden state to the kept positions, all of them here)."""
    return a is b or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                      and a.stride() == b.stride() and a.data_ptr() == b.data_ptr())


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:160]


def _allowed(mask, i: int, model_type: str) -> torch.Tensor:
    """The boolean [S, T] pattern of the mask a layer received: where an additive float mask is 0, a boolean
    mask as it is (True at the allowed positions, or at the masked ones: the caller tells by the first key)."""
    if not isinstance(mask, torch.Tensor):
        raise FuselmError(f"model_type {model_type!r}: decoder layer {i} got no attention mask tensor; "
                          "not supported by the traced exporter")
    m = mask[0, 0] if mask.dim() == 4 else mask
    return m if m.dtype == torch.bool else m == 0


class CarriedMark(torch.Tensor):
    """Stands in the probe for what decoder layer `source` returns beside its hidden state: a later layer handed it
    reads that layer's output (LayerPlan.carried)."""

    @staticmethod
    def __new__(cls, source: int):
        mark = torch.Tensor._make_subclass(cls, torch.empty(0))
        mark.source = source
        return mark


class StandIn(nn.Module):
    """A module standing in for a decoder layer: attributes it lacks are the layer's (Nemotron-H's model loop reads
    each layer's `block_type`)."""

    def __init__(self, original: nn.Module):
        super().__init__()
        object.__setattr__(self, "_original", original)  # not a submodule: its parameters stay out

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_original"], name)


def _layer_output(hidden_states, returns_tuple: int):
    """What a decoder layer returns: the hidden state (0), a 1-tuple of it (1) or it and no attention weights (2)."""
    return (hidden_states, *(None,) * (returns_tuple - 1)) if returns_tuple else hidden_states
