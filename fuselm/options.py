"""The options of a run: one frozen object, built once from the command line or from keywords.

`fuselm.load`, `run`, `stream_generate`, `validate` and `eval` take it; an engine says which fields it
honours (`Engine.HONOURS`), so an option it cannot honour is named by `unhonoured` instead of being
dropped silently.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields

from .errors import FuselmError

BACKENDS = ("auto", "mlx", "torch", "numpy", "onnxruntime")
DTYPES = ("auto", "f32", "f16", "bf16")
KV_BITS = (8, 16, 32)
SPECULATIVE = (None, "ngram", "draft")


@dataclass(frozen=True)
class KVFormat:
    """How the KV cache is stored: bits per key / value (None: the graph's dtype; 32/16 float; 8 int8 with
    per-group scales), and the channels per int8 scale (None: 64, or head_dim when smaller)."""

    key_bits: int | None = None
    value_bits: int | None = None
    group: int | None = None

    def __post_init__(self):
        for what, bits in (("--kv-bits-k", self.key_bits), ("--kv-bits-v", self.value_bits)):
            if bits is not None and (isinstance(bits, bool) or bits not in KV_BITS):
                raise FuselmError(f"{what} {bits!r} is not a KV cache format; choose 8 (int8, per-group scales), 16 "
                                  "(float16) or 32 (float32), or leave it out for the graph's dtype")
        if self.group is not None and (isinstance(self.group, bool) or not isinstance(self.group, int)
                                       or self.group <= 0):
            raise FuselmError(f"--kv-group-size {self.group!r} must be a positive integer (32, 64 or 128)")

    @classmethod
    def of(cls, kv_bits=None, kv_bits_k=None, kv_bits_v=None, kv_group_size=None) -> KVFormat:
        """From the command line's four flags: --kv-bits for both, --kv-bits-k / -v override one."""
        if kv_bits is not None and (isinstance(kv_bits, bool) or kv_bits not in KV_BITS):
            raise FuselmError(f"--kv-bits {kv_bits!r} is not a KV cache format; choose 8 (int8, per-group scales), 16 "
                              "(float16) or 32 (float32), or leave it out for the graph's dtype")
        return cls(kv_bits if kv_bits_k is None else kv_bits_k, kv_bits if kv_bits_v is None else kv_bits_v,
                   kv_group_size)

    @property
    def default(self) -> bool:
        return self == KVFormat()


@dataclass(frozen=True)
class Options:
    """Everything about how a model runs and generates. Fields left at their defaults ask for nothing."""

    # the engine
    backend: str = "auto"  # auto: fuselm's rule (runtime_metal/engines/auto.py); mlx, torch, numpy, onnxruntime
    device: str | None = None  # torch: cpu, cuda, cuda:1, mps; mlx: gpu, cpu
    dtype: str = "auto"  # compute type of the graph's float32 values (auto: bf16 on an MLX GPU, else f32)
    threads: int | None = None  # CPU threads (torch's, or onnxruntime's intra-op pool)
    compile: bool | None = None  # compile the static decode step (None: the backend's default)
    fused_kernels: bool = True  # False: fused ops run their ONNX function bodies (an A/B check)
    kv: KVFormat = field(default_factory=KVFormat)
    # generation
    max_tokens: int = 64
    ignore_eos: bool = False
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    speculative: str | None = None  # ngram: drafts from the prompt and the text so far; draft: a draft model
    num_draft: int = 4  # tokens drafted per verification step
    draft_model: str | None = None  # the draft model's directory (speculative="draft")
    prefill_chunk: int | None = None  # prompt tokens per prefill step (None: the backend's)
    skip: tuple[str, ...] = ()  # runtime rewrites not to apply at load (runtime_metal/rewrites/: an A/B)
    profile: bool = False  # the per-op time table (runtime_metal's engines)
    pipe_timeout: float = 60.0  # a `fuselm split` output: seconds a rank waits for its neighbour

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise FuselmError(f"--backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.dtype not in DTYPES:
            raise FuselmError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if not isinstance(self.kv, KVFormat):
            raise FuselmError(f"options.kv must be a KVFormat, got {type(self.kv).__name__}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise FuselmError(f"--max-tokens must be at least 1, got {self.max_tokens}")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise FuselmError(f"--threads must be a whole number >= 1, got {self.threads!r}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise FuselmError("sampling needs --temperature >= 0, 0 < --top-p <= 1 and --top-k >= 0")
        if self.draft_model and self.speculative is None:  # a draft model asks for its drafts (as mlx-lm's flag)
            object.__setattr__(self, "speculative", "draft")
        if self.speculative not in SPECULATIVE:
            raise FuselmError(f"--speculative {self.speculative!r} is not one of ngram, draft")
        if self.speculative == "draft" and not self.draft_model:
            raise FuselmError("--speculative draft needs --draft-model DIR (a fuselm model with the same tokenizer)")
        if self.draft_model and self.speculative not in (None, "draft"):
            raise FuselmError(f"--draft-model drafts for --speculative draft, not {self.speculative}; drop one")
        if self.prefill_chunk is not None and (isinstance(self.prefill_chunk, bool) or
                                               not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 1):
            raise FuselmError(f"--prefill-chunk must be a whole number >= 1, got {self.prefill_chunk!r}")
        if isinstance(self.num_draft, bool) or not isinstance(self.num_draft, int) or not 1 <= self.num_draft <= 32:
            raise FuselmError(f"--num-draft must be a whole number from 1 to 32, got {self.num_draft!r}")

    @classmethod
    def of(cls, options: Options | None = None, **keywords) -> Options:
        """`options` with `keywords` replacing its fields (a fresh Options when None). Besides the fields:
        the command line's kv_bits / kv_bits_k / kv_bits_v / kv_group_size and no_fused_kernels; an unknown
        keyword is a TypeError, as for any function."""
        base = options if options is not None else cls()
        kv = {k: keywords.pop(k) for k in ("kv_bits", "kv_bits_k", "kv_bits_v", "kv_group_size") if k in keywords}
        if kv:
            keywords["kv"] = KVFormat.of(**kv)
        if "skip" in keywords:
            keywords["skip"] = tuple(keywords["skip"] or ())
        if "no_fused_kernels" in keywords:
            keywords["fused_kernels"] = not keywords.pop("no_fused_kernels")
        unknown = set(keywords) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"unexpected keyword arguments {sorted(unknown)} (fuselm.Options has no such field)")
        return dataclasses.replace(base, **keywords) if keywords else base

    def replace(self, **keywords) -> Options:
        return Options.of(self, **keywords)

    def to_dict(self) -> dict:
        """As JSON-able data (a pipeline rank's command); `from_dict` reads it back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Options:
        return cls(**{**data, "kv": KVFormat(**data.get("kv") or {}), "skip": tuple(data.get("skip") or ())})

    def given(self) -> dict:
        """The fields set to something other than their default, by name."""
        default = Options()
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)}

    def unhonoured(self, honours: dict[str, tuple | None]) -> list[str]:
        """The command-line flags of the fields an engine cannot honour: set, and not in `honours` (field ->
        the values it takes, None for any)."""
        out = []
        for name, value in self.given().items():
            if name in honours and (honours[name] is None or value in honours[name]):
                continue
            out.append(FLAGS.get(name, "--" + name.replace("_", "-")))
        return out


FLAGS = {"fused_kernels": "--no-fused-kernels", "kv": "--kv-bits", "skip": "--skip"}

# What every engine honours: the choice of engine and the generation loop's own options.
GENERATION = {name: None for name in ("backend", "max_tokens", "ignore_eos", "temperature", "top_k", "top_p", "seed",
                                      "speculative", "num_draft", "draft_model", "pipe_timeout")}
