"""Shared fixtures: tiny checkpoints built in code, once per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

FAMILIES = ["qwen3", "qwen2", "llama", "mistral"]


@pytest.fixture(scope="session")
def make_ckpt(tmp_path_factory):
    """Factory: make_ckpt(family, **config_overrides) -> path of a cached tiny HF checkpoint."""
    from fuselm.synth import make_checkpoint

    cache: dict[str, os.PathLike] = {}

    def get(family: str = "qwen3", **overrides):
        key = f"{family}-{sorted(overrides.items())!r}"
        if key not in cache:
            path = tmp_path_factory.mktemp(f"ckpt-{family}") / "hf"
            cache[key] = make_checkpoint(path, family, **overrides)
        return cache[key]

    return get
