"""A batched KV cache addressed by position: row b's token at position p lives in slot p of every layer.

One preallocated buffer per side ([layers, batch, kv_heads, capacity, head_dim]) holds every layer. A forward writes
its new keys/values in place at each row's positions; rolling back only moves a row's length (as gpt-fast does), so
a rejected draft costs nothing to undo and the cache never holds a dead slot below a row's length. Rows of
different lengths share the buffer: a query at position p sees slots 0..p of its own row, which is all a causal
model needs, so stale slots past a row's length are never read. The buffer doubles when a forward would pass its
end; its capacity is always a multiple of GRANULE, so that batch-invariant attention (decoder.bucketed_attention)
can read every row up to the next multiple of GRANULE past a query.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

GRANULE = 64


def round_up(n: int, granule: int = GRANULE) -> int:
    return -(-n // granule) * granule


class Slots(NamedTuple):
    """Where a forward's new tokens go: positions [B, W], and their common first position when every row has the
    same length (a plain slice copy), else None."""

    positions: torch.Tensor
    start: int | None


class KVCache:
    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        capacity: int = 0,
    ):
        shape = (num_layers, batch_size, kv_heads, round_up(capacity), head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def reserve(self, width: int) -> None:
        """Make room for `width` more tokens in every row."""
        need = (int(self.lengths.max()) if self.batch_size else 0) + width
        if need > self.capacity:
            room = max(round_up(need), 2 * self.capacity, GRANULE)
            grow = [*self.k.shape[:3], room - self.capacity, self.k.shape[4]]
            self.k = torch.cat([self.k, self.k.new_zeros(grow)], dim=3)
            self.v = torch.cat([self.v, self.v.new_zeros(grow)], dim=3)

    def positions(self, width: int) -> torch.Tensor:
        """Positions [B, width] of the next `width` tokens of each row."""
        return self.lengths[:, None] + torch.arange(width, device=self.lengths.device)

    def open(self, width: int) -> Slots:
        """Room and positions for `width` new tokens per row; write them layer by layer, then `advance`."""
        self.reserve(width)
        return Slots(self.positions(width), self.common_length())

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: Slots) -> None:
        """Store k, v [B, H, W, hd] in the slots `open` returned."""
        if slots.start is not None:
            self.k[layer, :, :, slots.start : slots.start + k.shape[2]] = k
            self.v[layer, :, :, slots.start : slots.start + k.shape[2]] = v
            return
        rows = torch.arange(k.shape[0], device=k.device)[:, None]
        self.k[layer][rows, :, slots.positions] = k.transpose(1, 2)
        self.v[layer][rows, :, slots.positions] = v.transpose(1, 2)

    def advance(self, num_new: torch.Tensor) -> None:
        """The first num_new[b] of row b's written tokens are now part of it."""
        self.lengths = self.lengths + num_new

    def view(self, layer: int, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, H, upto, hd] of slots 0..upto-1."""
        return self.k[layer, :, :, :upto], self.v[layer, :, :, :upto]

    def filled(self, upto: int) -> torch.Tensor:
        """Bool [B, upto]: which of slots 0..upto-1 hold a live token of each row."""
        return torch.arange(upto, device=self.lengths.device)[None, :] < self.lengths[:, None]

    def common_length(self) -> int | None:
        """The length every row shares, or None in a ragged batch."""
        first = int(self.lengths[0]) if self.batch_size else 0
        return first if bool((self.lengths == first).all()) else None

    def rollback(self, lengths: torch.Tensor) -> None:
        """Keep the first lengths[b] tokens of row b."""
        if bool((lengths > self.lengths).any()):
            raise ValueError("rollback cannot grow a row")
        self.lengths = lengths.to(self.lengths).clone()

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the given rows (finished requests leave the batch)."""
        self.k, self.v, self.lengths = self.k[:, rows], self.v[:, rows], self.lengths[rows]

    def merge(self, other: KVCache) -> None:
        """Admit other's rows below ours (continuous batching); the smaller buffer is padded to the larger."""
        room = max(self.capacity, other.capacity)
        pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, room - t.shape[3]))
        self.k = torch.cat([pad(self.k), pad(other.k)], dim=1)
        self.v = torch.cat([pad(self.v), pad(other.v)], dim=1)
        self.lengths = torch.cat([self.lengths, other.lengths])


def causal_visibility(positions: torch.Tensor, upto: int) -> torch.Tensor:
    """Bool mask [B, 1, W, upto]: a query at position p sees slots 0..p of its own row."""
    slots = torch.arange(upto, device=positions.device)
    return (slots[None, None, :] <= positions[:, :, None])[:, None]
