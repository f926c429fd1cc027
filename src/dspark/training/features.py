"""What the frozen target contributes to a training batch: context features at every position and its next-token
distribution q where labels are supervised.

`OnlineFeatures` runs the target inside the training loop (no giant offline cache); `CachedFeatures` reads them
from a feature cache built once on disk (worth it for small targets trained for several epochs). Both hand the
trainer the same `TargetBatch`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dspark.errors import DSparkError
from dspark.fsutil import atomic_dir
from dspark.records import Example
from dspark.training.loss import TargetDist


def pad_batch(examples: list[Example], device="cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids [B, L], loss_mask [B, L], lengths [B] (right-padded with id 0 outside the mask)."""
    length = max(len(e) for e in examples)
    ids = torch.zeros(len(examples), length, dtype=torch.long)
    mask = torch.zeros(len(examples), length, dtype=torch.long)
    for i, e in enumerate(examples):
        ids[i, : len(e)] = torch.tensor(e.input_ids)
        mask[i, : len(e)] = torch.tensor(e.loss_mask)
    return ids.to(device), mask.to(device), torch.tensor([len(e) for e in examples], device=device)


def distribution(logits: torch.Tensor, topk: int) -> TargetDist:
    """q = softmax(logits) (temperature 1), dense or kept as its top-K."""
    probs = torch.softmax(logits.float(), dim=-1)
    if not topk:
        return TargetDist(probs)
    values, ids = probs.topk(topk, dim=-1)
    return TargetDist(values, ids)


@dataclass
class TargetBatch:
    input_ids: torch.Tensor  # [B, L]
    loss_mask: torch.Tensor  # [B, L]
    features: torch.Tensor  # [B, L, n*d]
    q_source: object  # gives q at chosen (row, position) pairs

    def target_dist(self, rows: torch.Tensor, positions: torch.Tensor) -> TargetDist:
        return self.q_source(rows, positions)


class OnlineFeatures:
    """Target forward per batch; q recomputed from the last hidden state through the LM head, only where needed."""

    def __init__(self, target, topk: int, chunk: int = 1024):
        self.target, self.topk, self.chunk = target, topk, chunk

    def __call__(self, examples: list[Example]) -> TargetBatch:
        ids, mask, lengths = pad_batch(examples, self.target.device)
        out = self.target.forward_sequences(ids, lengths, logits=False, features=True, last_hidden=True)
        hidden = out.last_hidden

        def q_at(rows, positions):
            # Overlapping blocks ask for the same position up to γ times: score each (row, position) once (scored
            # per pair, the full-vocabulary LM head took about a fifth of a training step).
            unique, inverse = torch.unique(rows * hidden.shape[1] + positions, return_inverse=True)
            rows, positions = unique // hidden.shape[1], unique % hidden.shape[1]
            parts = []
            for s in range(0, len(rows), self.chunk):
                h = hidden[rows[s : s + self.chunk], positions[s : s + self.chunk]]
                parts.append(distribution(self.target.logits_from_hidden(h), self.topk))
            ids_ = None if parts[0].ids is None else torch.cat([p.ids for p in parts])[inverse]
            return TargetDist(torch.cat([p.probs for p in parts])[inverse], ids_)

        return TargetBatch(ids, mask, out.features, q_at)


class CacheShard:
    """One build of the cache: examples [first, first + count) of the data, memory-mapped."""

    def __init__(self, folder: Path):
        self.index = json.loads((folder / "index.json").read_text())
        total, width, k = self.index["tokens"], self.index["feature_dim"], self.index["topk"]
        self.first, self.count = self.index.get("first_example", 0), self.index["num_examples"]
        self.features = np.memmap(folder / "features.bin", dtype=np.uint16, mode="r", shape=(total, width))
        self.q_probs = np.memmap(folder / "q_probs.bin", dtype=np.float16, mode="r", shape=(total, k))
        self.q_ids = np.memmap(folder / "q_ids.bin", dtype=np.int32, mode="r", shape=(total, k))
        self.offsets = self.index["offsets"]


def cache_shards(folder: Path) -> list[CacheShard]:
    """The first build in `folder` itself, then one `from-N` folder per build of appended examples, in order."""
    if not (folder / "index.json").exists():
        return []
    more = [p for p in folder.glob("from-*") if (p / "index.json").exists()]
    return [CacheShard(p) for p in [folder, *sorted(more, key=lambda p: int(p.name.removeprefix("from-")))]]


class CachedFeatures:
    """Features (bf16) and top-K q (fp16 probabilities, int32 ids) of every token, memory-mapped from disk."""

    def __init__(self, folder: str | Path, device="cpu"):
        self.device = torch.device(device)
        self.shards = cache_shards(Path(folder))

    def check(self, examples: list[Example], target, topk: int) -> None:
        """Refuse a cache that is not this run's (`refuse_foreign_shards`) or holds another number of examples."""
        expected = refuse_foreign_shards(self.shards, target, topk)
        if expected != len(examples):
            raise DSparkError(
                f"the feature cache holds {expected} examples, the data {len(examples)}; it was built "
                "for other data: delete it or pick a new folder"
            )

    def _locate(self, index: int) -> tuple[CacheShard, int, int]:
        shard = next(s for s in reversed(self.shards) if s.first <= index)
        start, n = shard.offsets[index - shard.first]
        return shard, start, n

    def __call__(self, examples: list[Example]) -> TargetBatch:
        ids, mask, _ = pad_batch(examples)
        batch, length = ids.shape
        width, k = self.shards[0].features.shape[1], self.shards[0].q_probs.shape[1]
        feats = torch.zeros(batch, length, width, dtype=torch.bfloat16)
        q_probs = torch.zeros(batch, length, k)
        q_ids = torch.zeros(batch, length, k, dtype=torch.long)
        for i, e in enumerate(examples):
            shard, start, n = self._locate(e.index)
            feats[i, :n] = torch.from_numpy(np.array(shard.features[start : start + n])).view(torch.bfloat16)
            q_probs[i, :n] = torch.from_numpy(np.array(shard.q_probs[start : start + n])).float()
            q_ids[i, :n] = torch.from_numpy(np.array(shard.q_ids[start : start + n])).long()
        dev = self.device
        q_probs, q_ids = q_probs.to(dev), q_ids.to(dev)
        return TargetBatch(
            ids.to(dev), mask.to(dev), feats.to(dev), lambda rows, pos: TargetDist(q_probs[rows, pos], q_ids[rows, pos])
        )


def refuse_foreign_shards(shards: list[CacheShard], target, topk: int) -> int:
    """Refuse shards built for other data, another target, other feature layers, another precision or another
    top-K: their features would be read as if they were this run's. Returns how many examples they hold."""
    expected, identity = 0, cache_identity(target)
    for shard in shards:
        if shard.index["target"] != identity or shard.first != expected or shard.index["topk"] != topk:
            raise DSparkError(
                "the feature cache was built for other data, another target, other --target-layer-ids, another "
                "--target-dtype or another --target-topk; delete it or pick a new folder"
            )
        expected += shard.count
    return expected


def cache_identity(target) -> dict:
    """What a cache's features depend on besides the data: the target, the layers read and their precision."""
    return {**target.identity(), "layer_ids": list(target.layer_ids), "dtype": str(target.dtype)}


def build_feature_cache(folder: str | Path, target, examples: list[Example], topk: int, batch_size: int = 8) -> None:
    """Run the target once over every example the cache in `folder` does not hold yet and store what training needs:
    the first build fills `folder`, examples appended to the data later fill a `from-N` folder inside it. Each build
    is atomic (a killed build leaves nothing), so a rerun continues."""
    if topk <= 0:
        raise DSparkError("a feature cache stores q as its top-K: pass --target-topk > 0 with --feature-cache")
    folder = Path(folder)
    held = refuse_foreign_shards(cache_shards(folder), target, topk)  # before extending a cache that is not this run's
    if held < len(examples):
        write_cache_shard(folder / f"from-{held}" if held else folder, target, examples[held:], held, topk, batch_size)


def write_cache_shard(folder: Path, target, examples: list[Example], first: int, topk: int, batch_size: int) -> None:
    total = sum(len(e) for e in examples)
    width = len(target.layer_ids) * target.hidden_size
    offsets, start = [], 0
    for e in examples:
        offsets.append((start, len(e)))
        start += len(e)
    with atomic_dir(folder) as tmp:
        features = np.memmap(tmp / "features.bin", dtype=np.uint16, mode="w+", shape=(total, width))
        q_probs = np.memmap(tmp / "q_probs.bin", dtype=np.float16, mode="w+", shape=(total, topk))
        q_ids = np.memmap(tmp / "q_ids.bin", dtype=np.int32, mode="w+", shape=(total, topk))
        order = sorted(range(len(examples)), key=lambda i: len(examples[i]))
        for s in tqdm(range(0, len(order), batch_size), desc="feature cache", unit="batch", dynamic_ncols=True):
            chunk = [examples[i] for i in order[s : s + batch_size]]
            ids, _, lengths = pad_batch(chunk)
            out = target.forward_sequences(ids, lengths, logits=False, features=True, last_hidden=True)
            for j, i in enumerate(order[s : s + batch_size]):
                a, n = offsets[i]
                features[a : a + n] = out.features[j, :n].to(torch.bfloat16).view(torch.uint16).cpu().numpy()
                q = distribution(target.logits_from_hidden(out.last_hidden[j, :n]), topk)
                q_probs[a : a + n] = q.probs.half().cpu().numpy()
                q_ids[a : a + n] = q.ids.int().cpu().numpy()
        for m in (features, q_probs, q_ids):
            m.flush()
        index = {
            "tokens": total,
            "feature_dim": width,
            "topk": topk,
            "offsets": offsets,
            "first_example": first,
            "num_examples": len(examples),
            "target": cache_identity(target),
        }
        (tmp / "index.json").write_text(json.dumps(index))
