"""The config fields every family shares (mlx-lm's ModelArgs): explicit, unknown keys ignored."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fuselm.errors import FuselmError


@dataclass
class DecoderConfig:
    """The fields every supported family reads from config.json; families subclass it."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048

    @classmethod
    def from_dict(cls, d: dict):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        required = [n for n, f in fields.items()
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [n for n in required if d.get(n) is None]
        if missing:
            raise FuselmError(f"config.json lacks {', '.join(missing)}; use the config.json that came with "
                              "the checkpoint")
        cfg = cls(**{k: v for k, v in d.items() if k in fields and v is not None})
        cfg.check()
        return cfg

    def check(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise FuselmError(f"config.json: {name} = {value!r} is not a positive integer; fix the config")
        if self.num_attention_heads % self.num_key_value_heads:
            raise FuselmError(f"config.json: num_attention_heads {self.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads {self.num_key_value_heads}; fix the config")
        if self.hidden_act not in ("silu", "swish"):  # the same function in transformers' ACT2FN
            raise FuselmError(f"config.json: hidden_act {self.hidden_act!r} is not supported (only 'silu'); "
                              "use a checkpoint with a SiLU MLP")
