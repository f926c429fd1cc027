"""An n-gram proposer: the floor any trained drafter must clear (and a drafter that costs almost nothing to run).

Built from regenerated data, it counts which token follows every pair (trigram) and every single token (bigram)
in the target's own answers, and drafts γ tokens by following the most frequent continuation, backing off from the
pair to the single token. Its proposals are deterministic, so it reports one-hot distributions: rejection sampling
then accepts a draft with exactly the target's probability of it and stays lossless. Its confidence for a draft is
the share of the continuation's count among everything seen after that context.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import torch

from dspark.proposer import Proposal
from dspark.sampling import Sampling, all_greedy


class NgramCache:
    """The last two tokens of every row's context."""

    def __init__(self, tails: list[tuple[int, ...]]):
        self.tails = tails

    def select(self, rows: torch.Tensor) -> None:
        self.tails = [self.tails[i] for i in rows.tolist()]

    def merge(self, other: NgramCache) -> None:
        self.tails += other.tails


class NgramProposer:
    target_layer_ids: list[int] = []  # it reads tokens, not the target's features

    def __init__(self, sequences, vocab_size: int, block_size: int = 7):
        self.block_size, self.vocab_size = block_size, vocab_size
        pairs, singles = defaultdict(Counter), defaultdict(Counter)
        for seq in sequences:
            for a, b in zip(seq, seq[1:]):
                singles[a][b] += 1
            for a, b, c in zip(seq, seq[1:], seq[2:]):
                pairs[(a, b)][c] += 1
        self.pairs = {k: self._best(v) for k, v in pairs.items()}
        self.singles = {k: self._best(v) for k, v in singles.items()}
        self.confidence_head = True  # it estimates its own acceptance (schedulers may use it)

    @staticmethod
    def _best(counts: Counter) -> tuple[int, float]:
        token, n = counts.most_common(1)[0]
        return token, n / sum(counts.values())

    @classmethod
    def from_data(cls, path, target, block_size: int = 7) -> NgramProposer:
        """From a regenerated data file: every conversation's prompt and answers as the target produced them."""
        from dspark.records import examples_from_record, read_records

        sequences = [
            e.input_ids for r in read_records(path) for e in examples_from_record(target.tokenizer, r, 1 << 30)
        ]
        return cls(sequences, target.vocab_size, block_size)

    def eval(self) -> NgramProposer:
        return self

    def new_cache(self, batch_size: int) -> NgramCache:
        return NgramCache([() for _ in range(batch_size)])

    def extend_context(self, cache: NgramCache, features, num_new: torch.Tensor, next_ids: torch.Tensor) -> None:
        """next_ids [B, n]: the token after each new position; the last real one is the row's next anchor."""
        for b, n in enumerate(num_new.tolist()):
            cache.tails[b] = (cache.tails[b] + tuple(next_ids[b, :n].tolist()))[-3:-1]

    def next(self, a: int | None, b: int) -> tuple[int, float]:
        if a is not None and (a, b) in self.pairs:
            return self.pairs[(a, b)]
        return self.singles.get(b, (b, 0.0))

    def propose(self, cache: NgramCache, anchor_ids: torch.Tensor, sampling: Sampling, generators=None) -> Proposal:
        tokens, conf = [], []
        for tail, anchor in zip(cache.tails, anchor_ids.tolist()):
            a, b = (tail[-1] if tail else None), anchor
            row, row_conf = [], []
            for _ in range(self.block_size):
                c, frequency = self.next(a, b)
                row.append(c)
                row_conf.append(frequency)
                a, b = b, c
            tokens.append(row)
            conf.append(row_conf)
        drafts = torch.tensor(tokens, dtype=torch.long, device=anchor_ids.device)
        share = torch.tensor(conf).clamp(1e-4, 1 - 1e-4)
        probs = None
        if not all_greedy(sampling):
            probs = torch.zeros(*drafts.shape, self.vocab_size, device=anchor_ids.device)
            probs.scatter_(2, drafts[..., None], 1.0)
        return Proposal(drafts, probs, torch.log(share / (1 - share)))
