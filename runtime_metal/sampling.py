"""How the next token is picked from the logits: greedy, or temperature / top-k / top-p sampling.

A backend picks on the device where it can (`Backend.pick_token`): the logits never leave it and
the next step can be queued before this one is read. `sample` is the host version, used where a
backend has no device sampler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fuselm.errors import FuselmError


@dataclass
class Sampler:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    rng: np.random.Generator | None = field(default=None, repr=False)
    device_key: object = field(default=None, repr=False)  # a backend that samples on the device keeps its key here

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise FuselmError("sampling needs --temperature >= 0, 0 < --top-p <= 1 and --top-k >= 0")
        self.rng = np.random.default_rng(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def pick(self, logits: np.ndarray) -> int:
        """The next token from these logits (host; `sample`)."""
        return sample(logits, self.temperature, self.top_k, self.top_p, self.rng)

    def distribution(self, logits: np.ndarray) -> np.ndarray:
        """What `pick` draws from (`probabilities`)."""
        return probabilities(logits, self.temperature, self.top_k, self.top_p)


def probabilities(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The distribution sampling draws from: softmax(logits / temperature), cut to the top-k, then to the top-p
    nucleus, renormalised (float64). Speculative decoding's rejection rule reads it too."""
    z = np.asarray(logits, np.float64).reshape(-1) / temperature
    if top_k and top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p)
        cum = np.cumsum(p[order])
        cut = order[np.searchsorted(cum, top_p) + 1:]
        p[cut] = 0.0
        p /= p.sum()
    return p


def sample(logits: np.ndarray, temperature: float, top_k: int, top_p: float, rng: np.random.Generator) -> int:
    """Greedy at temperature 0; else temperature, then top-k, then top-p (nucleus) sampling."""
    if temperature <= 0:
        return int(np.argmax(logits))
    p = probabilities(logits, temperature, top_k, top_p)
    return int(rng.choice(p.size, p=p))
