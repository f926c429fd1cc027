"""Acceptance statistics of speculative decoding, per request and merged over many."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    gamma: int
    rounds: int = 0
    drafted_rounds: int = 0  # rounds in which the drafter proposed (the policy may skip drafting)
    tokens: int = 0  # τ summed over rounds (accepted drafts + the target's token)
    verified_tokens: int = 0  # Σ ℓ
    accepted_hist: list[int] = field(default_factory=list)  # rounds by number of accepted drafts 0..γ
    reached: list[int] = field(default_factory=list)  # position k verified with all before it accepted
    accepted: list[int] = field(default_factory=list)  # ... and accepted
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0  # drafter proposal + verification-length policy
    verify_seconds: float = 0.0  # target forward over the block + acceptance + cache rollback
    context_seconds: float = 0.0  # drafter context growing by the accepted tokens' features

    def __post_init__(self):
        self.accepted_hist = self.accepted_hist or [0] * (self.gamma + 1)
        self.reached = self.reached or [0] * self.gamma
        self.accepted = self.accepted or [0] * self.gamma

    def record(self, verified: int, accepted: int, drafted: bool = True) -> None:
        self.rounds += 1
        self.drafted_rounds += drafted
        self.tokens += accepted + 1
        self.verified_tokens += verified
        self.accepted_hist[accepted] += 1
        for k in range(min(verified, accepted + 1)):
            self.reached[k] += 1
            self.accepted[k] += k < accepted

    def merge(self, other: SpecStats) -> SpecStats:
        out = SpecStats(max(self.gamma, other.gamma))
        for s in (self, other):
            out.rounds += s.rounds
            out.drafted_rounds += s.drafted_rounds
            out.tokens += s.tokens
            out.verified_tokens += s.verified_tokens
            for name in ("prefill_seconds", "draft_seconds", "verify_seconds", "context_seconds"):
                setattr(out, name, getattr(out, name) + getattr(s, name))
            for name in ("accepted_hist", "reached", "accepted"):
                mine, theirs = getattr(out, name), getattr(s, name)
                for i, v in enumerate(theirs):
                    mine[i] += v
        return out

    @property
    def tau(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0

    def accept_by_position(self) -> list[float | None]:
        """P(position k accepted | positions before k accepted and k verified), k = 1..γ."""
        return [a / r if r else None for a, r in zip(self.accepted, self.reached)]

    def to_dict(self) -> dict:
        return {
            "tau": round(self.tau, 4),
            "rounds": self.rounds,
            "drafted_rounds": self.drafted_rounds,
            "gamma": self.gamma,
            "mean_verified": round(self.verified_tokens / self.rounds, 4) if self.rounds else 0.0,
            "accept_by_position": [None if p is None else round(p, 4) for p in self.accept_by_position()],
            "accepted_length_histogram": list(self.accepted_hist),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
            "context_seconds": round(self.context_seconds, 4),
        }


def merged(stats: list[SpecStats]) -> SpecStats:
    out = SpecStats(stats[0].gamma if stats else 1)
    for s in stats:
        out = out.merge(s)
    return out
