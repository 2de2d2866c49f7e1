"""What a pass did, as every pass (and every runtime rewrite: runtime_metal/rewrites/) reports it.

Kept apart from passes/base.py so that the runtime can report its load-time rewrites without importing onnx_ir.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Stats:
    """What a pass did: fusions fired (where) and candidates skipped (where, why)."""

    fired: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)

    def fire(self, where: str) -> None:
        self.fired.append(where)

    def skip(self, where: str, reason: str) -> None:
        self.skipped.append((where, reason))

    def merge(self, other: Stats) -> None:
        self.fired += other.fired
        self.skipped += other.skipped
        self.counts.update(other.counts)

    def as_dict(self) -> dict[str, Any]:
        return {"fired": len(self.fired), "fired_at": list(self.fired),
                "skipped": [{"at": w, "reason": r} for w, r in self.skipped],
                "counts": dict(sorted(self.counts.items()))}
