"""Parameters transformers concatenates from several stored tensors when it loads a checkpoint (its conversion
mapping's WeightConverter with one Concatenate(dim=0): OLMo-Hybrid's q/k/v convolutions -> `conv1d.weight`),
presented to the weight writer as the one tensor the model reads. (Stacked MoE experts: moe.py.)
"""

from __future__ import annotations

import numpy as np

from fuselm.errors import FuselmError

from ..weights import Checkpoint


class ConcatCheckpoint(Checkpoint):
    """`base` with each concatenated parameter as a virtual tensor: its stored parts, read whole and joined along
    their first dim (they are small: convolution weights). Validation sees the parameter, not its parts."""

    def __init__(self, base: Checkpoint, concats: dict[str, list[str]]):
        self.__dict__.update(base.__dict__)
        self.base, self.concats = base, concats
        self.parts = {p for parts in concats.values() for p in parts}
        self.tensors = dict(base.tensors)
        for name, parts in concats.items():
            path, dtype, shape = base.tensors[parts[0]]
            self.tensors[name] = (path, dtype, (sum(base.tensors[p][2][0] for p in parts), *shape[1:]))

    def validate(self, expected, ignorable) -> None:
        kept = self.base.tensors
        self.base.tensors = {k: v for k, v in self.tensors.items() if k not in self.parts}
        try:
            self.base.validate(expected, ignorable)
        finally:
            self.base.tensors = kept

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        if name not in self.concats:
            return self.base.read_rows(name, start, stop)
        whole = np.concatenate([self.base.read_rows(p, 0, self.base.tensors[p][2][0]) for p in self.concats[name]])
        return whole if whole.ndim == 1 else whole[start:stop]


def concatenations(ckpt: Checkpoint, model) -> dict[str, list[str]]:
    """Model parameter -> the stored tensors transformers concatenates into it, for those the checkpoint lacks."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    out = {}
    converters = [c for c in get_model_conversion_mapping(model) if isinstance(c, WeightConverter)
                  and [(type(o).__name__, getattr(o, "dim", None)) for o in c.operations] == [("Concatenate", 0)]]
    for name, _ in model.named_parameters():
        conv = next((c for c in converters for t in c.target_patterns if name.endswith(t)), None)
        if conv is None or name in ckpt.tensors:
            continue
        prefix = name[: -len(next(t for t in conv.target_patterns if name.endswith(t)))]
        parts = [prefix + src for src in conv.source_patterns]
        missing = [p for p in parts if p not in ckpt.tensors]
        if len(missing) == len(parts):
            continue  # validate reports the parameter missing
        if missing:
            raise FuselmError(f"checkpoint {ckpt.dir}: {missing[0]} is missing (one of the tensors transformers "
                              f"concatenates into {name}); re-download the checkpoint")
        out[name] = parts
    return out


def concatenated(ckpt: Checkpoint, concats: dict[str, list[str]]) -> Checkpoint:
    return ConcatCheckpoint(ckpt, concats) if concats else ckpt
