"""What the server reports at /metrics (Prometheus text format), one registry per server."""

from __future__ import annotations

from collections import deque

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dspark.decoding.stats import SpecStats
from dspark.scheduling.calibration import ECE_BINS, ece_from_bins

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)


class ServerMetrics:
    def __init__(self, gamma: int):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("dspark_requests", "finished requests by finish reason", ["reason"], registry=r)
        self.prompt_tokens = Counter("dspark_prompt_tokens", "prompt tokens read", registry=r)
        self.generated_tokens = Counter("dspark_generated_tokens", "tokens generated", registry=r)
        self.rounds = Counter("dspark_rounds", "decoding rounds, summed over requests", registry=r)
        self.drafted_rounds = Counter(
            "dspark_drafted_rounds",
            "rounds in which the drafter proposed (the rest verified the anchor alone)",
            registry=r,
        )
        self.verified = Counter("dspark_verified_draft_tokens", "draft tokens sent to verification", registry=r)
        self.accepted = Counter("dspark_accepted_draft_tokens", "draft tokens accepted", registry=r)
        self.tau = Gauge(
            "dspark_tau", "tokens per round (accepted drafts + the target's own), all requests so far", registry=r
        )
        self.verified_per_round = Gauge(
            "dspark_verified_per_round", "draft tokens verified per request and round", registry=r
        )
        self.accept_by_position = Gauge(
            "dspark_accept_by_position",
            "P(draft position k accepted | 1..k-1 accepted and k verified)",
            ["k"],
            registry=r,
        )
        self.queue_depth = Gauge("dspark_queue_depth", "requests waiting to join the batch", registry=r)
        self.active = Gauge("dspark_active_requests", "requests in the batch", registry=r)
        self.batch_rows = Histogram(
            "dspark_batch_rows", "rows per engine round", registry=r, buckets=(1, 2, 4, 8, 16, 32, 64)
        )
        self.ttft = Histogram(
            "dspark_time_to_first_token_seconds", "submission to first token", registry=r, buckets=LATENCY_BUCKETS
        )
        self.latency = Histogram(
            "dspark_request_latency_seconds", "submission to last token", registry=r, buckets=LATENCY_BUCKETS
        )
        self.latency_quantile = Gauge(
            "dspark_request_latency_quantile_seconds",
            "latency percentiles over the last 1000 requests",
            ["quantile"],
            registry=r,
        )
        self.predicted_tokens = Counter(
            "dspark_predicted_round_tokens",
            "tokens the verification policy expected its rounds to yield (1 + the survival of every verified draft)",
            registry=r,
        )
        self.round_tokens = Counter("dspark_round_tokens", "tokens the same rounds yielded", registry=r)
        # The cost model against the clock: what the scheduler's cost table priced its rounds at, and how long the
        # same rounds took (streaming their tokens included). A ratio far from 1 says the table is not this machine's
        # now (profiled on a quieter host, another configuration), and the scheduler trades drafts at wrong prices.
        self.round_seconds = Counter(
            "dspark_scheduled_round_seconds", "wall time of the rounds a cost-aware scheduler planned", registry=r
        )
        self.round_priced_seconds = Counter(
            "dspark_scheduled_round_priced_seconds", "what its cost table priced the same rounds at", registry=r
        )
        # Reliability of the survival estimates, per draft position k and tenth of [0, 1]: how many verified drafts
        # fell in the bin, the sum of their estimates and how many survived. Differences of these counters between
        # two scrapes give the ECE of that interval (bench serve reports it per concurrency).
        labels = ["k", "bin"]
        self.calibration_count = Counter(
            "dspark_calibration_drafts", "verified drafts by position and estimate bin", labels, registry=r
        )
        self.calibration_predicted = Counter(
            "dspark_calibration_predicted", "sum of their survival estimates", labels, registry=r
        )
        self.calibration_survived = Counter(
            "dspark_calibration_survived", "how many of them survived", labels, registry=r
        )
        self.ece = Gauge(
            "dspark_confidence_ece", "expected calibration error of the survival estimates since start", registry=r
        )
        self._bins = [[0.0] * ECE_BINS for _ in range(3)]  # the same totals since start: count, predicted, survived
        self._recent = deque(maxlen=1000)
        self._stats = SpecStats(max(gamma, 1))

    def record_stats(self, stats: SpecStats) -> None:
        self._stats = self._stats.merge(stats)
        self.rounds.inc(stats.rounds)
        self.drafted_rounds.inc(stats.drafted_rounds)
        self.verified.inc(stats.verified_tokens)
        self.accepted.inc(stats.tokens - stats.rounds)
        s = self._stats
        if s.rounds:
            self.tau.set(s.tau)
            self.verified_per_round.set(s.verified_tokens / s.rounds)
        for k, p in enumerate(s.accept_by_position(), 1):
            if p is not None:
                self.accept_by_position.labels(k=str(k)).set(p)

    def record_round(self, survival: torch.Tensor, verified: int, accepted: int) -> None:
        """One row's round: the policy's survival estimates a_1..a_γ, how many drafts it verified, how many were
        accepted. Predicted against realised tokens says whether the confidences mean what they say."""
        self.predicted_tokens.inc(1 + float(survival[:verified].sum()))
        self.round_tokens.inc(1 + accepted)
        for k, a in enumerate(survival[:verified].tolist()):
            b, survived = min(int(a * ECE_BINS), ECE_BINS - 1), float(k < accepted)
            labels = {"k": str(k + 1), "bin": str(b)}
            self.calibration_count.labels(**labels).inc()
            self.calibration_predicted.labels(**labels).inc(a)
            self.calibration_survived.labels(**labels).inc(survived)
            for total, value in zip(self._bins, (1.0, a, survived)):
                total[b] += value
        if verified:
            self.ece.set(ece_from_bins(*self._bins))

    def record_round_time(self, seconds: float, priced_seconds: float) -> None:
        self.round_seconds.inc(seconds)
        self.round_priced_seconds.inc(priced_seconds)

    def finished(self, reason: str, seconds: float) -> None:
        self.requests.labels(reason=reason).inc()
        self.latency.observe(seconds)
        self._recent.append(seconds)
        ordered = sorted(self._recent)
        for q in (0.5, 0.95, 0.99):
            self.latency_quantile.labels(quantile=str(q)).set(ordered[min(len(ordered) - 1, int(q * len(ordered)))])

    def text(self) -> bytes:
        return generate_latest(self.registry)
