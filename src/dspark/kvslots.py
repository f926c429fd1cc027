"""Bookkeeping for a batched KV cache whose rows hold different numbers of live tokens.

Row b owns slots 0..S-1 of the cache tensors; slot s holds the token at logical position pos[b, s], or -1 when the
slot is dead (padding of a ragged forward, or rolled back). Dead slots are masked out of attention, so they cost
memory but never change results; trailing dead columns are cut and `compaction_index` squeezes holes out. A batch of
one that is rolled back is always cut back to a plain contiguous cache, with no mask at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicLayer


class SlotTable:
    def __init__(self, batch_size: int, device: torch.device | str = "cpu"):
        self.pos = torch.empty(batch_size, 0, dtype=torch.long, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)

    @property
    def batch_size(self) -> int:
        return self.pos.shape[0]

    @property
    def width(self) -> int:
        return self.pos.shape[1]

    def is_contiguous(self) -> bool:
        """Every slot live and every row the same length: a plain causal cache needs no mask."""
        return bool((self.pos >= 0).all()) and bool((self.lengths == self.width).all())

    def append(self, num_new: torch.Tensor, width: int) -> torch.Tensor:
        """Reserve `width` slots per row, the first num_new[b] of them live. Returns their position ids [B, width]."""
        offsets = torch.arange(width, device=self.pos.device)
        positions = self.lengths[:, None] + offsets
        live = offsets[None, :] < num_new[:, None]
        self.pos = torch.cat([self.pos, torch.where(live, positions, -1)], dim=1)
        self.lengths = self.lengths + num_new
        return positions

    def attention_mask(self, width: int) -> torch.Tensor:
        """Bool [B, 1, width, S] for the `width` slots just appended: a query sees live slots at or before it.

        Padding queries see every live slot of their row (and their own slot), so no row of the softmax is empty:
        an empty row would give NaN, and 0 * NaN poisons the values that later layers read from those slots.
        """
        key_pos = self.pos
        query_pos = self.pos[:, -width:].clone()
        dead_query = query_pos < 0
        query_pos[dead_query] = torch.iinfo(torch.long).max
        mask = (key_pos[:, None, :] >= 0) & (key_pos[:, None, :] <= query_pos[:, :, None])
        own = torch.arange(width, device=self.pos.device)
        mask[:, own, self.width - width + own] = True
        return mask[:, None]

    def rollback(self, lengths: torch.Tensor) -> int:
        """Keep the first lengths[b] tokens of each row. Returns how many trailing slot columns the caller must cut."""
        if bool((lengths > self.lengths).any()):
            raise ValueError("rollback cannot grow a row")
        self.pos = torch.where(self.pos < lengths[:, None], self.pos, -1)
        self.lengths = lengths.clone()
        return self._trim()

    def select(self, rows: torch.Tensor) -> int:
        """Keep only the given rows (finished requests leave the batch). Returns trailing columns to cut."""
        self.pos = self.pos[rows]
        self.lengths = self.lengths[rows]
        return self._trim()

    def _trim(self) -> int:
        live_cols = (self.pos >= 0).any(dim=0).nonzero()
        keep = int(live_cols[-1]) + 1 if len(live_cols) else 0
        cut = self.width - keep
        self.pos = self.pos[:, :keep]
        return cut

    def dead_fraction(self) -> float:
        return float((self.pos < 0).float().mean()) if self.pos.numel() else 0.0

    def merge(self, other: SlotTable) -> None:
        """Append other's rows below ours; the narrower table is padded with dead slots."""
        width = max(self.width, other.width)
        self.pos = torch.cat([F.pad(p, (0, width - p.shape[1]), value=-1) for p in (self.pos, other.pos)])
        self.lengths = torch.cat([self.lengths, other.lengths])

    def compaction_index(self) -> torch.Tensor:
        """Slot index [B, S'] that moves every row's live slots to the front in order; updates the table to match."""
        live = self.pos >= 0
        new_width = int(live.sum(dim=1).max()) if self.pos.numel() else 0
        # Sort live slots first, keeping their order (stable); padding picks dead slots, which stay dead.
        order = torch.sort((~live).to(torch.int8), dim=1, stable=True).indices[:, :new_width]
        self.pos = self.pos.gather(1, order)
        return order


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys/values live in a buffer with spare room: appending writes in place and cropping
    only moves the end, instead of copying the whole cache on every forward."""

    def __init__(self, **kwargs):
        self._k = self._v = None
        self.length = 0
        super().__init__(**kwargs)

    @property
    def keys(self):
        return None if self._k is None else self._k[:, :, : self.length]

    @keys.setter
    def keys(self, value):
        self._k = value
        self.length = 0 if value is None else value.shape[-2]

    @property
    def values(self):
        return None if self._v is None else self._v[:, :, : self.length]

    @values.setter
    def values(self, value):
        self._v = value

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if self._k is None or self.length + n > self._k.shape[-2]:
            room = max(64, 2 * (self.length + n))
            grown = []
            for old, new in ((self._k, key_states), (self._v, value_states)):
                buf = new.new_empty(*new.shape[:2], room, new.shape[-1])
                if old is not None:
                    buf[:, :, : self.length] = old[:, :, : self.length]
                grown.append(buf)
            self._k, self._v = grown
        self._k[:, :, self.length : self.length + n] = key_states
        self._v[:, :, self.length : self.length + n] = value_states
        self.length += n
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        self.length -= abs(tokens_to_remove)

    def get_seq_length(self) -> int:
        return self.length


class KVCache:
    """A Hugging Face cache (growing layers) plus the slot table of its live slots."""

    def __init__(self, batch_size: int, device: torch.device | str = "cpu"):
        self.kv = Cache(layer_class_to_replicate=GrowingLayer)
        self.slots = SlotTable(batch_size, device)

    @property
    def lengths(self) -> torch.Tensor:
        return self.slots.lengths

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv.layers[i].keys, self.kv.layers[i].values

    def _cut(self, n: int) -> None:
        if n:
            for layer in self.kv.layers:
                layer.crop(-n)

    def rollback(self, lengths: torch.Tensor) -> None:
        """Keep the first lengths[b] tokens of row b; squeeze holes out once they are most of the cache."""
        self._cut(self.slots.rollback(lengths))
        if self.slots.dead_fraction() > 0.5 and self.slots.width > 64:
            self.compact()

    def select(self, rows: torch.Tensor) -> None:
        self.kv.batch_select_indices(rows)
        self._cut(self.slots.select(rows))

    def merge(self, other: KVCache) -> None:
        """Admit other's requests (continuous batching): rows are concatenated, the narrower cache padded."""
        width = max(self.slots.width, other.slots.width)
        if self.batch_size and self.kv.layers and other.kv.layers:
            for mine, theirs in zip(self.kv.layers, other.kv.layers):
                mine.keys, mine.values = (
                    torch.cat([_pad_slots(a, width), _pad_slots(b, width)])
                    for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values))
                )
        elif not self.batch_size:
            self.kv = other.kv
        self.slots.merge(other.slots)

    @property
    def batch_size(self) -> int:
        return self.slots.batch_size

    def compact(self) -> None:
        index = self.slots.compaction_index()
        for layer in self.kv.layers:
            if layer.is_initialized:
                idx = index[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
                # Gather both before assigning: setting keys sets the layer's length, which bounds the values view.
                keys, values = layer.keys.gather(2, idx), layer.values.gather(2, idx)
                layer.keys, layer.values = keys, values


def _pad_slots(t: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(t, (0, 0, 0, width - t.shape[2]))
