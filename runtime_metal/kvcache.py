"""The KV cache behind the graph's past/present contract: preallocated, written in place.

The graph sees `past_key_values.{i}.key` as a tensor [B, H, past, D] and concatenates the new
keys to it. The runtime feeds a `CacheView` instead: one preallocated buffer [B, H, max_len, D]
per input. Appending writes the new rows into the buffer (no reallocation, no copy of the past)
and hands the graph a view.

Two modes:
- dynamic (prefill chunks): the graph sees the `pos` rows written so far; the view it gets back
  is buffer[:, :, :pos+S].
- static (decode): the graph sees max_len - S past rows and gets the whole buffer back, so every
  decode step has the same shapes and can be compiled (mx.compile, torch.compile, CUDA graphs).
  Rows after the current position are masked by position: the attention mask fed to the graph has
  zeros there (and ops without a mask input mask by `pos` themselves).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CacheView:
    """One past input of the graph, backed by a preallocated buffer."""

    buffer: object  # backend array [B, H, max_len, D]
    pos: object  # rows written before this step: a Python int, or a 0-d device integer (static mode)
    seq: int  # rows this step appends
    static: bool = False

    @property
    def max_len(self) -> int:
        return int(self.buffer.shape[2])

    @property
    def shape(self) -> tuple[int, int, int, int]:
        b, h, _, d = (int(s) for s in self.buffer.shape)
        return (b, h, self.max_len - self.seq if self.static else int(self.pos), d)

    def append(self, backend, new):
        """Write `new` [B, H, S, D] at `pos`; return what the graph's Concat would have produced."""
        self.buffer = backend.cache_write(self.buffer, new, self.pos)
        if self.static:
            return self.buffer
        return backend.slice(self.buffer, (slice(None), slice(None), slice(0, int(self.pos) + int(new.shape[2]))))
