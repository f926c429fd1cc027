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


@dataclass
class RequestState:
    index: int
    prompt: list[int]
    max_new_tokens: int
    stop_token_ids: set[int]
    context_window: int | None = None  # the model's maximum sequence length: prompt + output never exceed it
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    def __post_init__(self):
        if not self.prompt:
            raise DSparkError(f"prompt {self.index} is empty; every request needs at least one token")
        if self.max_new_tokens <= 0:
            raise DSparkError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.context_window:
            if len(self.prompt) >= self.context_window:
                raise DSparkError(f"prompt {self.index} has {len(self.prompt)} tokens, but the model's context window "
                                  f"is {self.context_window}; shorten the prompt")
            self.max_new_tokens = min(self.max_new_tokens, self.context_window - len(self.prompt))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def commit(self, tokens: list[int]) -> list[int]:
        """Append tokens up to and including the first stop token, and at most up to max_new_tokens.

        Returns the tokens actually appended."""
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
        return taken

    def result(self, seconds: float, stats: SpecStats | None = None) -> GenerationResult:
        return GenerationResult(list(self.output), self.finish_reason or "length", seconds, stats)


def pad_prompts(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, Lmax] and lengths [B]; the padding is dead in the cache's slot table."""
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
    ids = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    return ids, lengths
