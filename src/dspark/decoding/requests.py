"""Per-request bookkeeping shared by plain and speculative decoding: output, stop conditions, result."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspark.decoding.stats import SpecStats
from dspark.errors import DSparkError


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token, included in token_ids) or "length"
    seconds: float
    stats: SpecStats | None = None  # speculative decoding only

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of an emitted token (its raw distribution, before temperature, top-k and
    top-p), and the `top` likeliest tokens with theirs."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """TokenLogprobs of tokens[j] under logits [n, V] row j."""
    logp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    if top:
        values, ids = logp.topk(top, dim=-1)
        alternatives = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        alternatives = [[] for _ in tokens]
    return [TokenLogprob(t, c, a) for t, c, a in zip(tokens, chosen, alternatives)]


@dataclass
class RequestState:
    index: int
    prompt: list[int]
    max_new_tokens: int
    stop_token_ids: set[int]
    context_window: int | None = None  # the model's maximum sequence length: prompt + output never exceed it
    top_logprobs: int | None = None  # None: no log-probabilities; k >= 0: each token's, and the k likeliest
    min_tokens: int = 0  # no stop token before this many output tokens (vLLM's `min_tokens`)
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, when top_logprobs is set
    finish_reason: str | None = None

    def __post_init__(self):
        if not self.prompt:
            raise DSparkError(f"prompt {self.index} is empty; every request needs at least one token")
        if self.max_new_tokens <= 0:
            raise DSparkError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise DSparkError(
                f"min_tokens must be between 0 and the maximum of new tokens ({self.max_new_tokens}), got "
                f"{self.min_tokens}"
            )
        if self.context_window:
            if len(self.prompt) >= self.context_window:
                raise DSparkError(
                    f"prompt {self.index} has {len(self.prompt)} tokens, but the model's context window "
                    f"is {self.context_window}; shorten the prompt"
                )
            self.max_new_tokens = min(self.max_new_tokens, self.context_window - len(self.prompt))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def commit(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> list[int]:
        """Append tokens up to and including the first stop token, and at most up to max_new_tokens (with their
        log-probabilities, when given). Returns the tokens actually appended."""
        taken = []
        for tok in tokens:
            if self.finished:
                break
            taken.append(tok)
            self.output.append(tok)
            if tok in self.stop_token_ids:
                self.finish_reason = "stop"
            elif len(self.output) >= self.max_new_tokens:
                self.finish_reason = "length"
        if logprobs is not None:
            self.logprobs += logprobs[: len(taken)]
        return taken

    def result(self, seconds: float, stats: SpecStats | None = None) -> GenerationResult:
        return GenerationResult(list(self.output), self.finish_reason or "length", seconds, stats)


def without_early_stops(logits: torch.Tensor, requests: list[RequestState]) -> torch.Tensor:
    """logits [B, n, V] of each request's next n output positions, with its stop tokens ruled out wherever they would
    end the output before its min_tokens. The distribution decoding samples from (or takes the argmax of) is this
    one, in plain and in speculative decoding alike, so speculation stays lossless; log-probabilities stay the raw
    ones. The logits themselves are returned where no request needs it."""
    short = [(b, r) for b, r in enumerate(requests) if r.min_tokens > len(r.output) and r.stop_token_ids]
    if not short:  # every step of every request passes here: nothing is built unless a request needs it
        return logits
    logits = logits.clone()
    for b, r in short:
        logits[b, : r.min_tokens - len(r.output), sorted(r.stop_token_ids)] = float("-inf")
    return logits


def pad_prompts(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, Lmax] and lengths [B]; the padding is dead in the cache's slot table."""
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
    ids = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    return ids, lengths
