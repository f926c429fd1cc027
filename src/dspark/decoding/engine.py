"""The speculative decoding loop (docs/design.md §4), for a batch of requests that join and leave between rounds.

One round, per the paper's Figure 1: the drafter proposes γ tokens after each anchor -> the policy picks how many
to verify -> the target scores [anchor, drafts] in one forward -> accept a prefix and take the target's next token
-> roll the target's cache back to what was accepted and feed the accepted tokens' features to the drafter.

`generate` runs a fixed list of prompts to the end. A server drives the same loop one round at a time: `admit` new
requests into a `Batch` (their prefill), `step` it, `cancel` rows. Without a drafter the loop is plain decoding
(each round verifies the anchor alone). Every request brings its own sampling parameters and random generator.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dspark.decoding.policy import FixedLength, VerifyPolicy
from dspark.decoding.requests import (
    GenerationResult,
    RequestState,
    pad_prompts,
    token_logprobs,
    without_early_stops,
)
from dspark.decoding.stats import SpecStats
from dspark.decoding.verify import verify_greedy, verify_sampling
from dspark.kvcache import KVCache
from dspark.proposer import Proposer, ProposerCache
from dspark.sampling import SamplingParams, all_greedy, next_token
from dspark.target import Target


@dataclass
class Row:
    request: RequestState
    sampling: SamplingParams
    generator: torch.Generator
    stats: SpecStats
    started: float
    finished: float = 0.0

    def result(self) -> GenerationResult:
        return self.request.result(self.finished - self.started, self.stats)


@dataclass
class Batch:
    """The rows decoding together, in the order of their cache rows."""

    rows: list[Row]
    tcache: KVCache
    dcache: ProposerCache | None
    anchors: torch.Tensor  # [B] each row's last token, not yet in the caches
    # Rounds that did not draft leave one token per row for the drafter to read: (features [B, 1, F], the token
    # after it [B, 1]) each, read in one call when a round drafts again or the rows change.
    unread: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class SpeculativeEngine:
    def __init__(self, target: Target, drafter: Proposer | None = None, policy: VerifyPolicy | None = None):
        self.target = target
        self.drafter = drafter.eval() if drafter is not None else None
        self.layer_ids = []  # the features the drafter reads, asked for per forward
        if drafter is not None:
            target.validate_layer_ids(drafter.target_layer_ids)
            self.layer_ids = list(drafter.target_layer_ids)
        self.policy: VerifyPolicy = policy or FixedLength()

    @property
    def gamma(self) -> int:
        return self.drafter.block_size if self.drafter is not None else 0

    def new_batch(self, size: int = 0) -> Batch:
        """A batch with caches for `size` rows (filled by a prefill before any round)."""
        empty = torch.empty(0, dtype=torch.long, device=self.target.device)
        return Batch([], self.target.new_cache(size), self.drafter.new_cache(size) if self.drafter else None, empty)

    @torch.no_grad()
    def admit(
        self,
        batch: Batch,
        requests: list[RequestState],
        sampling: list[SamplingParams],
        generators: list[torch.Generator],
        on_tokens=None,
    ) -> None:
        """Prefill: the target reads each new prompt and says its first token, the anchor of the row's first round.
        The prefill runs apart from `batch`, which it joins only once it succeeded."""
        if not batch.rows:
            self.policy.restart()
        start = time.perf_counter()
        joining = self.new_batch(len(requests))
        logits = self._prefill(
            joining,
            [r.prompt for r in requests],
            lambda last: next_token(without_early_stops(last[:, None], requests)[:, 0], sampling, generators),
        )
        now = time.perf_counter()
        for request, params, gen in zip(requests, sampling, generators):
            row = Row(request, params, gen, SpecStats(self.gamma), start)
            row.stats.prefill_seconds = now - start
            joining.rows.append(row)
        tokens = joining.anchors.tolist()
        for i, row in enumerate(joining.rows):
            emit(row.request, [tokens[i]], on_tokens, logits[i : i + 1])
        self.merge(batch, joining)

    @torch.no_grad()
    def rebuild(self, rows: list[Row]) -> Batch:
        """A new batch of these rows rebuilt from their tokens alone (cache: prompt and output but the last token;
        anchor: the last token), for rows whose caches a failed round left in an unknown state. Their output so far is
        read as a prompt is: in a quantized precision, with the float weights, so what follows may part from an
        uninterrupted run at a near tie."""
        batch = self.new_batch(len(rows))
        last = torch.tensor([r.request.output[-1] for r in rows], dtype=torch.long, device=self.target.device)
        self._prefill(batch, [r.request.prompt + r.request.output[:-1] for r in rows], lambda _logits: last)
        batch.rows = list(rows)
        return batch

    def _prefill(self, batch: Batch, contexts: list[list[int]], choose) -> torch.Tensor:
        """Read `contexts` into the caches of `batch` (new, sized for them); its anchors are choose(last logits).
        Returns those logits [B, V]."""
        ids, lengths = pad_prompts(contexts, self.target.device)
        out = self.target.prefill(batch.tcache, ids, lengths, features=self.layer_ids)
        batch.anchors = choose(out.logits[:, 0])
        if self.drafter is not None:
            self.drafter.extend_context(batch.dcache, out.features, lengths, following(ids, lengths - 1, batch.anchors))
        return out.logits[:, 0]

    def merge(self, batch: Batch, other: Batch) -> None:
        """Append the rows of `other` to `batch`."""
        self._catch_up(batch)
        self._catch_up(other)
        batch.tcache.merge(other.tcache)
        if batch.dcache is not None:
            batch.dcache.merge(other.dcache)
        batch.anchors = torch.cat([batch.anchors, other.anchors])
        batch.rows += other.rows

    @torch.no_grad()
    def step(self, batch: Batch, on_tokens=None, on_round=None) -> list[Row]:
        """One round for every unfinished row. Returns the rows that finished or were cancelled: they have left
        the batch."""
        done = self._drop_finished(batch)
        if not batch.rows:
            return done
        target, drafter, device = self.target, self.drafter, self.target.device
        rows, anchors = batch.rows, batch.anchors
        sampling, gens = [r.sampling for r in rows], [r.generator for r in rows]

        t0 = time.perf_counter()
        proposal, ell = None, torch.zeros(len(rows), dtype=torch.long, device=device)
        if drafter is not None and self.policy.drafts(len(rows)):
            self._catch_up(batch)
            proposal = drafter.propose(batch.dcache, anchors, sampling, gens)
            ell = self.policy.lengths(proposal.confidence_logits, self.gamma, len(rows)).to(device)
            # Never verify past max_new_tokens: those tokens would be cut anyway.
            room = torch.tensor([r.request.max_new_tokens - len(r.request.output) - 1 for r in rows], device=device)
            ell = torch.minimum(ell, room.clamp_min(0))
            if proposal.lengths is not None:  # nor past the drafts a row has
                ell = torch.minimum(ell, proposal.lengths)

        t1 = time.perf_counter()
        drafts = proposal.tokens if proposal is not None else anchors.new_zeros(len(rows), 0)
        width = int(ell.max()) + 1
        verify_ids = torch.cat([anchors[:, None], drafts], dim=1)[:, :width]
        out = target.forward(batch.tcache, verify_ids, ell + 1, features=self.layer_ids)
        logits = without_early_stops(out.logits, [r.request for r in rows])
        if all_greedy(sampling):
            accepted, batch.anchors = verify_greedy(logits, drafts, ell)
        else:
            probs = proposal.probs if proposal is not None else None
            accepted, batch.anchors = verify_sampling(logits, probs, drafts, ell, sampling, gens)
        # Keep [x0, x1..x_a] in the target's cache; the drafter's context grows by the same tokens' features.
        batch.tcache.rollback(batch.tcache.lengths - (ell + 1) + (accepted + 1))
        t2 = time.perf_counter()
        if drafter is not None:
            next_ids = following(verify_ids, accepted, batch.anchors)
            if proposal is None:  # one token per row; read when it is needed, with the others
                batch.unread.append((out.features, next_ids))
            else:
                drafter.extend_context(batch.dcache, out.features, accepted + 1, next_ids)
        t3 = time.perf_counter()

        draft_list, acc, nxt, ells = drafts.tolist(), accepted.tolist(), batch.anchors.tolist(), ell.tolist()
        share = 1 / len(rows)
        for i, row in enumerate(rows):
            row.stats.record(ells[i], acc[i], drafted=proposal is not None)
            row.stats.draft_seconds += (t1 - t0) * share
            row.stats.verify_seconds += (t2 - t1) * share
            row.stats.context_seconds += (t3 - t2) * share
            if on_round and proposal is not None and proposal.confidence_logits is not None:
                on_round(row.request.index, proposal.confidence_logits[i], ells[i], acc[i])
            emit(row.request, draft_list[i][: acc[i]] + [nxt[i]], on_tokens, out.logits[i])
        return done + self._drop_finished(batch)

    def cancel(self, batch: Batch, index: int) -> None:
        """Stop a request (its client went away); its row leaves the batch at the next step."""
        for row in batch.rows:
            if row.request.index == index and not row.request.finished:
                row.request.finish_reason = "cancelled"

    def _catch_up(self, batch: Batch) -> None:
        """The drafter reads the tokens of the rounds that did not draft, in one call (a 1-row round on a 2-core
        EPYC: 1.1 ms a token one by one, against a step of 16 ms in int4)."""
        if batch.unread and self.drafter is not None:
            # A proposer that reads tokens only (suffix decoding) asks for no features: the target returns none.
            features = None if not self.layer_ids else torch.cat([f for f, _ in batch.unread], dim=1)
            next_ids = torch.cat([n for _, n in batch.unread], dim=1)
            count = torch.full(next_ids.shape[:1], next_ids.shape[1], dtype=torch.long, device=next_ids.device)
            self.drafter.extend_context(batch.dcache, features, count, next_ids)
        batch.unread.clear()

    def _drop_finished(self, batch: Batch) -> list[Row]:
        keep = [i for i, r in enumerate(batch.rows) if not r.request.finished]
        done = [r for r in batch.rows if r.request.finished]
        now = time.perf_counter()
        for row in done:
            row.finished = now
        if done:
            self._catch_up(batch)
            index = torch.tensor(keep, dtype=torch.long, device=self.target.device)
            batch.tcache.select(index)
            if batch.dcache is not None:
                batch.dcache.select(index)
            batch.anchors = batch.anchors[index]
            batch.rows = [batch.rows[i] for i in keep]
        return done

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        sampling: SamplingParams = SamplingParams(),
        stop_token_ids: set[int] | None = None,
        on_tokens=None,
        on_round=None,
        min_tokens: int = 0,
    ) -> list[GenerationResult]:
        """Decode every prompt to its end (no stop token before min_tokens). on_tokens(request, tokens) streams
        output; on_round(request, confidence_logits, verified, accepted) sees every round (calibration records
        them)."""
        stop = self.target.stop_token_ids if stop_token_ids is None else stop_token_ids
        window = self.target.context_window
        requests = [
            RequestState(i, p, max_new_tokens, stop, window, min_tokens=min_tokens) for i, p in enumerate(prompts)
        ]
        batch = self.new_batch()
        self.admit(batch, requests, [sampling] * len(requests), sampling.generators(len(requests)), on_tokens)
        finished = {}
        while batch.rows:
            for row in self.step(batch, on_tokens, on_round):
                finished[row.request.index] = row
        return [finished[i].result() for i in range(len(requests))]


def emit(request: RequestState, tokens: list[int], on_tokens, logits: torch.Tensor | None = None) -> None:
    """Commit a row's new tokens; logits [n, V] are the target's at each of them (kept as log-probabilities when
    the request asks for them)."""
    logprobs = None
    if request.top_logprobs is not None and logits is not None:
        logprobs = token_logprobs(logits, tokens, request.top_logprobs)
    taken = request.commit(tokens, logprobs)
    if on_tokens and taken:
        on_tokens(request.index, taken)


def following(ids: torch.Tensor, last: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """The token after each position of ids [B, n]: ids shifted left, with row b's position last[b] followed by
    next_tokens[b] (the new anchor)."""
    out = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
    return out.scatter(1, last[:, None], next_tokens[:, None])
