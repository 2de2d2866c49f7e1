"""The config fields every family shares (mlx-lm's ModelArgs): explicit, unknown keys ignored."""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass

from fuselm.errors import FuselmError, shown

# What each annotated type accepts from JSON: bools are not numbers, numbers are finite.
_ACCEPTS = {
    int: ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    float: ("a finite number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)),
    bool: ("true or false", lambda v: isinstance(v, bool)),
    str: ("a string", lambda v: isinstance(v, str)),
}


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
        given = {k: v for k, v in d.items() if k in fields and v is not None}
        hints = typing.get_type_hints(cls)
        for name, value in given.items():
            kinds = [t for t in (typing.get_args(hints[name]) or (hints[name],)) if t is not type(None)]
            if not any(_ACCEPTS[t][1](value) for t in kinds):
                raise FuselmError(f"config.json: {name} = {shown(value)} is not {' or '.join(_ACCEPTS[t][0] for t in kinds)}; "
                                  "use the config.json that came with the checkpoint")
        cfg = cls(**given)
        cfg.check()
        return cfg

    def check(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "head_dim"):
            if name == "head_dim" and self.head_dim is None:  # HF's default, once heads is known to be positive
                self.head_dim = self.hidden_size // self.num_attention_heads
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise FuselmError(f"config.json: {name} = {value!r} is not a positive integer; fix the config")
        if self.rms_norm_eps < 0:
            raise FuselmError(f"config.json: rms_norm_eps = {self.rms_norm_eps!r} is negative; fix the config")
        for name in ("max_position_embeddings", "sliding_window"):
            value = getattr(self, name, None)
            if value is not None and value <= 0:
                raise FuselmError(f"config.json: {name} = {value!r} is not a positive integer; fix the config")
        if self.num_attention_heads % self.num_key_value_heads:
            raise FuselmError(f"config.json: num_attention_heads {self.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads {self.num_key_value_heads}; fix the config")
        if self.hidden_act not in ("silu", "swish"):  # the same function in transformers' ACT2FN
            raise FuselmError(f"config.json: hidden_act {self.hidden_act!r} is not supported (only 'silu'); "
                              "use a checkpoint with a SiLU MLP")
