"""Checkpoint.convert: tensors transformers makes from one stored tensor as it loads it (a transposed router,
a fused projection split in parts), read as the model holds them while the weights stream."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fuselm.exporter.weights import Checkpoint
from safetensors.torch import save_file

from fuselm.errors import FuselmError


@pytest.fixture
def ckpt(tmp_path):
    router = torch.arange(15, dtype=torch.float32).reshape(3, 5)  # stored [H, E]
    fused = torch.arange(24, dtype=torch.float32).reshape(6, 4)  # q rows 0-3, k rows 4-5
    save_file({"gate_kernel": router, "qkv": fused, "norm": torch.ones(4)}, tmp_path / "model.safetensors")
    c = Checkpoint(tmp_path)
    c.convert({"gate.weight": ["gate_kernel", "transpose", 0, 1],
               "q.weight": ["qkv", "slice", 0, 0, 4], "k.weight": ["qkv", "slice", 0, 4, 6]})
    return c, router.numpy(), fused.numpy()


def test_views_replace_their_sources(ckpt):
    c, router, fused = ckpt
    assert {n: s for n, (_, _, s) in c.tensors.items()} == {"gate.weight": (5, 3), "q.weight": (4, 4),
                                                            "k.weight": (2, 4), "norm": (4,)}
    assert np.array_equal(c.read_rows("gate.weight", 1, 4), router.T[1:4])
    assert np.array_equal(c.read_rows("k.weight", 0, 2), fused[4:6])
    assert np.array_equal(c.read_rows("q.weight", 2, 4), fused[2:4])
    c.validate({"gate.weight": (5, 3), "q.weight": (4, 4), "k.weight": (2, 4), "norm": (4,)}, lambda n: False)
    with pytest.raises(FuselmError, match="gate.weight: shape"):
        c.validate({"gate.weight": (3, 5), "q.weight": (4, 4), "k.weight": (2, 4), "norm": (4,)}, lambda n: False)
