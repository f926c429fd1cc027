"""Suffix decoding: drafts from suffix trees over the request's own text and earlier answers, at no model cost.

A request's prompt and output so far, and a global tree of answers (filled from what the drafter was trained on, and
growing with the answers served), are searched for the longest suffix of the context; what followed it most often
is the draft. The trees are arctic-inference's `SuffixDecodingCache` (the implementation behind vLLM's and SGLang's
suffix decoding). Drafts are deterministic, so their distributions are one-hot and rejection sampling stays lossless,
as for the n-gram proposer. A draft's confidence at each position is the tree's count-based probability of that
token after the ones before it; positions past the tree's draft get no confidence, and `Proposal.lengths` says how
many drafts each row has.
"""

from __future__ import annotations

import math
import os
from itertools import count
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file, save_file

from dspark.errors import DSparkError
from dspark.fsutil import make_public
from dspark.proposer import Proposal
from dspark.sampling import Sampling, all_greedy

ANSWER_INDEX = "suffix-answers.safetensors"  # beside a drafter: the answers that fill the global tree
NO_CONFIDENCE = -30.0  # the confidence logit of a position the tree did not draft
MAX_TREE_DEPTH = 64  # the longest context suffix matched, as vLLM's default
# The shortest context match of each group whose probabilities are calibrated together: a count after a match of one
# token says less than the same count after sixteen (overconfident at short matches, underconfident at long ones).
MATCH_BUCKETS = (1, 2, 4, 8, 16)


def match_bucket(match_len: int) -> int:
    """The calibration group of a context match of this many tokens."""
    return max(i for i, lo in enumerate(MATCH_BUCKETS) if lo <= max(match_len, 1))


def suffix_trees_available() -> bool:
    try:
        import arctic_inference.suffix_decoding  # noqa: F401
    except ImportError:
        return False
    return True


def _new_trees(max_cached: int):
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as e:
        raise DSparkError(
            "suffix decoding needs arctic-inference's suffix trees, which are not installed; `make install` builds "
            "them (see the README), or leave out --suffix"
        ) from e
    return SuffixDecodingCache(max_tree_depth=MAX_TREE_DEPTH, max_cached_requests=max_cached)


class SuffixCache:
    """Each row's tree key and its tokens so far (the prompt but its first token, then the output)."""

    def __init__(self, proposer: SuffixProposer, keys: list[int]):
        self.proposer, self.keys = proposer, keys
        self.histories: list[list[int]] = [[] for _ in keys]
        self.match_lengths = [0] * len(keys)  # each row's context match in the last proposal, for reports

    def select(self, rows: torch.Tensor) -> None:
        kept = rows.tolist()
        for i in set(range(len(self.keys))) - set(kept):
            self.proposer.finish(self.keys[i])
        self.keys = [self.keys[i] for i in kept]
        self.histories = [self.histories[i] for i in kept]
        self.match_lengths = [self.match_lengths[i] for i in kept]

    def merge(self, other: SuffixCache) -> None:
        self.keys += other.keys
        self.histories += other.histories
        self.match_lengths += other.match_lengths


class SuffixProposer:
    """Drafts up to γ tokens per row from the suffix trees.

    answers: token lists that fill the global tree first (the drafter's training answers); max_cached: how many
    answers the global tree keeps, the oldest evicted first (served answers join it as they finish); isolate: served
    answers never join it, so one client's text cannot speed up (and so reveal itself to) another's; min_match: the
    shortest context match a draft is taken from; calibration [len(MATCH_BUCKETS), γ, 2]: Platt scaling (a, b) of
    the probabilities' logits per match group and position (`dspark suffix-index` fits it on held-out answers), so
    that a confidence is the survival rate observed for drafts like it."""

    target_layer_ids: list[int] = []  # it reads tokens, not the target's features
    confidence_head = True  # the tree's probabilities estimate survival

    def __init__(
        self,
        vocab_size: int,
        block_size: int = 7,
        answers: list[list[int]] = (),  # type: ignore[assignment]
        max_cached: int = 4096,
        isolate: bool = False,
        max_spec_factor: float = 2.0,
        min_token_prob: float = 0.1,
        min_match: int = 1,
        calibration: torch.Tensor | None = None,
    ):
        if calibration is not None and tuple(calibration.shape) != (len(MATCH_BUCKETS), block_size, 2):
            raise DSparkError(
                f"the suffix calibration has shape {tuple(calibration.shape)}, not ({len(MATCH_BUCKETS)}, {block_size}"
                ", 2); rebuild the answer index with `dspark suffix-index`"
            )
        self.vocab_size, self.block_size, self.isolate = vocab_size, block_size, isolate
        self.calibration = calibration
        self.max_spec_factor, self.min_token_prob, self.min_match = max_spec_factor, min_token_prob, min_match
        self.trees = _new_trees(max(max_cached, 1))
        self.keys = count()
        for answer in answers:
            key = next(self.keys)
            self.trees.start_request(key, [])
            self.trees.add_active_response(key, answer)
            self.trees.stop_request(key)

    def eval(self) -> SuffixProposer:
        return self

    def new_cache(self, batch_size: int) -> SuffixCache:
        return SuffixCache(self, [next(self.keys) for _ in range(batch_size)])

    def finish(self, key: int) -> None:
        """A row left its batch: its prompt tree goes; its answer stays in the global tree unless isolated."""
        if key in self.trees.active_requests:
            self.trees.stop_request(key)
        if self.isolate and key in self.trees.cached_requests:
            self.trees.evict_cached_response(key)

    def extend_context(self, cache: SuffixCache, features, num_new: torch.Tensor, next_ids: torch.Tensor) -> None:
        """next_ids [B, n]: the token after each new position. A row's first call is its prefill: the prompt (but its
        first token) goes to the row's own tree, the first output token to the answers."""
        for b, n in enumerate(num_new.tolist()):
            tokens, key = next_ids[b, :n].tolist(), cache.keys[b]
            cache.histories[b] += tokens
            if key not in self.trees.active_requests:
                self.trees.start_request(key, tokens[:-1])
                if self.isolate:  # its answer never enters the global tree
                    self.trees.evict_cached_response(key)
                tokens = tokens[-1:]
            self.trees.add_active_response(key, tokens)

    def propose(self, cache: SuffixCache, anchor_ids: torch.Tensor, sampling: Sampling, generators=None) -> Proposal:
        gamma, rows = self.block_size, len(cache.keys)
        tokens = torch.zeros(rows, gamma, dtype=torch.long)
        logits = torch.full((rows, gamma), NO_CONFIDENCE)
        lengths = torch.zeros(rows, dtype=torch.long)
        for b, (key, history) in enumerate(zip(cache.keys, cache.histories)):
            draft = self.trees.speculate(
                key,
                history[-MAX_TREE_DEPTH:],
                max_spec_tokens=gamma,
                max_spec_factor=self.max_spec_factor,
                min_token_prob=self.min_token_prob,
            )
            n = len(draft.token_ids) if draft.match_len >= self.min_match else 0
            cache.match_lengths[b] = draft.match_len if n else 0
            if n:
                tokens[b, :n] = torch.tensor(draft.token_ids)
                tokens[b, n:] = draft.token_ids[-1]
                raw = torch.tensor([_logit(p) for p in draft.probs[:n]])
                if self.calibration is not None:
                    scale, shift = self.calibration[match_bucket(draft.match_len), :n].unbind(-1)
                    raw = scale * raw + shift
                logits[b, :n] = raw
            lengths[b] = n
        device = anchor_ids.device
        tokens = tokens.to(device)
        probs = None
        if not all_greedy(sampling):
            probs = torch.zeros(rows, gamma, self.vocab_size, device=device)
            probs.scatter_(2, tokens[..., None], 1.0)
        return Proposal(tokens, probs, logits.to(device), lengths.to(device))


def _logit(p: float) -> float:
    p = min(max(p, 1e-3), 1 - 1e-3)
    return math.log(p / (1 - p))


def expected_accepted(confidence_logits: torch.Tensor) -> torch.Tensor:
    """Σ_k Π_{i≤k} c_i per row: the drafts a round is expected to accept if all are verified."""
    return torch.sigmoid(confidence_logits.float()).cumprod(dim=1).sum(dim=1)


def write_answer_index(answers: list[list[int]], path: str | Path, calibration: torch.Tensor | None = None) -> None:
    """The answers that fill a global tree, as one token array and the offsets between answers, and the calibration
    of the trees' probabilities where one was fitted."""
    path = Path(path)
    flat = torch.tensor([t for a in answers for t in a], dtype=torch.int32)
    offsets = torch.tensor([0] + [len(a) for a in answers], dtype=torch.int64).cumsum(0)
    tensors = {"tokens": flat, "offsets": offsets}
    if calibration is not None:
        tensors["calibration"] = calibration.float().contiguous()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(tensors, str(tmp))
    make_public(tmp)
    os.replace(tmp, path)


def is_answer_index(path: str | Path) -> bool:
    """An earlier index of ours: a safetensors file holding tokens and offsets."""
    try:
        return {"tokens", "offsets"} <= set(load_file(str(path))) <= {"tokens", "offsets", "calibration"}
    except Exception:  # safetensors reports damage with its own exception types
        return False


class AnswerIndex(NamedTuple):
    answers: list[list[int]]
    calibration: torch.Tensor | None  # None in an index written without one


def read_answer_index(path: str | Path, limit: int | None = None) -> AnswerIndex:
    """The first `limit` answers of an index (all of them without a limit), and its calibration."""
    try:
        data = load_file(str(path))
        tokens, offsets = data["tokens"].tolist(), data["offsets"].tolist()
    except Exception as e:  # safetensors reports damage with its own exception types
        raise DSparkError(f"{path} is not a suffix answer index ({e}); rebuild it or leave out --suffix") from e
    ends = list(zip(offsets, offsets[1:]))[:limit]
    return AnswerIndex([tokens[a:b] for a, b in ends], data.get("calibration"))
