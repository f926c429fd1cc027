"""The speculative decoding loop (docs/design.md §4), for one request or a ragged batch of them.

One round, per the paper's Figure 1: the drafter proposes γ tokens after each anchor -> the policy picks how many
to verify -> the target scores [anchor, drafts] in one forward -> accept a prefix and take the target's next token
-> roll the target's cache back to what was accepted and feed the accepted tokens' features to the drafter.
"""

from __future__ import annotations

import time

import torch

from dspark.decoding.policy import FixedLength
from dspark.decoding.requests import GenerationResult, RequestState, pad_prompts
from dspark.sampling import SamplingParams, next_token
from dspark.decoding.stats import SpecStats
from dspark.proposer import Proposer
from dspark.decoding.verify import verify_greedy, verify_sampling


class SpeculativeEngine:
    def __init__(self, target, drafter: Proposer, policy=None):
        target.validate_layer_ids(drafter.target_layer_ids)
        self.layer_ids = list(drafter.target_layer_ids)  # the features this drafter reads, asked for per forward
        self.target = target
        self.drafter = drafter.eval()
        self.policy = policy or FixedLength()

    @property
    def gamma(self) -> int:
        return self.drafter.block_size

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        sampling: SamplingParams = SamplingParams(),
        stop_token_ids: set[int] | None = None,
        on_tokens=None,
        on_round=None,
    ) -> list[GenerationResult]:
        """on_tokens(request, tokens) streams output; on_round(request, confidence_logits, verified, accepted)
        sees every round (calibration records them)."""
        target, drafter, device = self.target, self.drafter, self.target.device
        stop = target.stop_token_ids if stop_token_ids is None else stop_token_ids
        requests = [RequestState(i, p, max_new_tokens, stop, target.context_window) for i, p in enumerate(prompts)]
        stats = [SpecStats(self.gamma) for _ in requests]
        generators = sampling.generators(len(prompts))
        start = time.perf_counter()

        # Prefill: the target reads each prompt and says its first token, the anchor of round one.
        tcache, dcache = target.new_cache(len(prompts)), drafter.new_cache(len(prompts))
        ids, lengths = pad_prompts(prompts, device)
        out = target.forward(tcache, ids, lengths, logits="last", features=self.layer_ids)
        anchors = next_token(out.logits[:, 0], sampling, generators)
        drafter.extend_context(dcache, out.features, lengths, following(ids, lengths - 1, anchors))
        active = list(range(len(prompts)))
        prefill = time.perf_counter() - start
        for r, tok in zip(active, anchors.tolist()):
            stats[r].prefill_seconds = prefill
            self._emit(requests[r], [tok], on_tokens)

        while True:
            keep = [i for i, r in enumerate(active) if not requests[r].finished]
            if not keep:
                break
            if len(keep) < len(active):
                rows = torch.tensor(keep, device=device)
                tcache.select(rows)
                dcache.select(rows)
                anchors = anchors[rows]
                active = [active[i] for i in keep]
            gens = [generators[r] for r in active]

            t0 = time.perf_counter()
            proposal = drafter.propose(dcache, anchors, sampling, gens)
            ell = self.policy.lengths(proposal.confidence_logits, self.gamma, len(active)).to(device)
            # Never verify past max_new_tokens: those tokens would be cut anyway.
            room = torch.tensor([requests[r].max_new_tokens - len(requests[r].output) - 1 for r in active], device=device)
            ell = torch.minimum(ell, room.clamp_min(0))

            t1 = time.perf_counter()
            width = int(ell.max()) + 1
            verify_ids = torch.cat([anchors[:, None], proposal.tokens], dim=1)[:, :width]
            out = target.forward(tcache, verify_ids, ell + 1, features=self.layer_ids)
            if sampling.greedy:
                accepted, anchors = verify_greedy(out.logits, proposal.tokens, ell)
            else:
                accepted, anchors = verify_sampling(out.logits, proposal.probs, proposal.tokens, ell, sampling, gens)
            # Keep [x0, x1..x_a] in the target's cache; the drafter's context grows by the same tokens' features.
            tcache.rollback(tcache.lengths - (ell + 1) + (accepted + 1))
            t2 = time.perf_counter()
            drafter.extend_context(dcache, out.features, accepted + 1, following(verify_ids, accepted, anchors))
            t3 = time.perf_counter()

            drafts, acc, nxt, ells = proposal.tokens.tolist(), accepted.tolist(), anchors.tolist(), ell.tolist()
            share = 1 / len(active)
            for i, r in enumerate(active):
                stats[r].record(ells[i], acc[i])
                stats[r].draft_seconds += (t1 - t0) * share
                stats[r].verify_seconds += (t2 - t1) * share
                stats[r].context_seconds += (t3 - t2) * share
                if on_round and proposal.confidence_logits is not None:
                    on_round(r, proposal.confidence_logits[i], ells[i], acc[i])
                self._emit(requests[r], drafts[i][: acc[i]] + [nxt[i]], on_tokens)

        seconds = time.perf_counter() - start
        return [req.result(seconds, stats[i]) for i, req in enumerate(requests)]

    @staticmethod
    def _emit(request: RequestState, tokens: list[int], on_tokens) -> None:
        taken = request.commit(tokens)
        if on_tokens and taken:
            on_tokens(request.index, taken)


def following(ids: torch.Tensor, last: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """The token after each position of ids [B, n]: ids shifted left, with row b's position last[b] followed by
    next_tokens[b] (the new anchor)."""
    out = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
    return out.scatter(1, last[:, None], next_tokens[:, None])
