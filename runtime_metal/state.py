"""The recurrent state behind the graph's past_state/present_state contract (fuselm/contract.py).

A layer whose memory is a fixed-size state (short convolutions, the gated delta rule, Mamba-2) takes
`past_state.{i}.{conv,recurrent}` and returns `present_state.{i}.*` of the same shape: unlike the KV cache
nothing grows, so each step's present simply replaces the past (mlx-lm's ArraysCache). The arrays are float32
whatever the compute dtype or the KV cache's format (`--kv-bits`), so a long prompt's state does not drift.

    state = RecurrentState(backend, io.states)
    state.reset()                    # zeros: no token yet
    out = run({**feeds, **state.feeds()})
    state.update(out)                # the presents become the next step's pasts
    saved = state.snapshot()         # the arrays as they are (ops never write a state in place) ...
    state.restore(saved)             # ... put back: a step undone (a checked step, a rejected draft token)
    step(..., *state.values())       # a compiled step takes them in the graph's order ...
    state.put(presents)              # ... and gives the presents back in that order
"""

from __future__ import annotations

import math

from fuselm import contract

# a state is replaced whole at every step: the tokens of a rejected draft cannot be taken back out of it
NO_ROLLBACK = ("this model's recurrent states keep no earlier step to roll back to; checkpoint() before the tokens "
               "and restore() after (speculative decoding does)")


class RecurrentState:
    """The session's recurrent states, one float32 array per `past_state` input of the graph."""

    def __init__(self, backend, specs: list[contract.StateSpec]):
        self.backend, self.specs = backend, list(specs)
        self.arrays: dict[str, object] = {}

    def __bool__(self) -> bool:
        return bool(self.specs)

    def reset(self, batch: int = 1) -> None:
        self.arrays = {s.name: self.backend.state_zeros((batch, *s.shape)) for s in self.specs}

    def feeds(self) -> dict:
        return dict(self.arrays)

    snapshot = feeds  # (ops never write a state in place: the arrays as they are)

    def update(self, outputs: dict) -> None:
        self.arrays = {s.name: outputs[s.present] for s in self.specs}

    def values(self) -> list:
        """The arrays in the graph's order (a compiled step's state inputs)."""
        return [self.arrays[s.name] for s in self.specs]

    def put(self, values: list) -> None:
        """The arrays a compiled step gave back, in `values()` order."""
        self.arrays = {s.name: v for s, v in zip(self.specs, values, strict=True)}

    def ordered(self, saved: dict) -> list:
        """A snapshot's arrays in `values()` order."""
        return [saved[s.name] for s in self.specs]

    def restore(self, saved: dict) -> None:
        self.arrays = dict(saved)

    def describe(self) -> str:
        layers = sorted({contract.parse_state(s.name).layer for s in self.specs})
        mib = sum(4 * math.prod(s.shape) for s in self.specs) / 2**20  # float32
        return f"recurrent state float32 ({len(layers)} layer{'s' if len(layers) != 1 else ''}, {mib:.2f} MiB)"
