"""One engine loop owning the batch: requests join and leave between rounds (continuous batching).

The loop runs in its own thread, since a round is seconds of torch work that must not block the HTTP event loop.
HTTP handlers `submit` requests and read their tokens from an asyncio queue that the loop fills; `cancel` (a client
that went away, a stop string reached) takes a row out at the next round. One request never fails another: a
prefill that raises is retried one request at a time, and a round that raises has each of its rows rebuilt from its
tokens and run alone once, so only the rows that fail alone fail; the others go on in a fresh batch.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from dspark.decoding.requests import RequestState
from dspark.sampling import SamplingParams
from dspark.serve.metrics import ServerMetrics


@dataclass
class Submission:
    request: RequestState  # index: the server-wide request id
    sampling: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None

    def send(self, event: tuple) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class EngineLoop:
    def __init__(self, engine, max_batch: int, metrics: ServerMetrics):
        self.engine, self.max_batch, self.metrics = engine, max_batch, metrics
        self.pending: deque[Submission] = deque()
        self.active: dict[int, Submission] = {}
        self.cancelled: set[int] = set()
        self.wake = threading.Condition()
        self.stopping = False
        self.closing_at: float | None = None  # after this (monotonic) time, requests in flight are ended
        self.thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)

    # ---- called from the HTTP side ---------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def load(self) -> int:
        """Requests admitted or waiting."""
        with self.wake:
            return len(self.pending) + len(self.active)

    def submit(self, sub: Submission) -> None:
        with self.wake:
            self.pending.append(sub)
            self.metrics.queue_depth.set(len(self.pending))
            self.wake.notify()

    def cancel(self, index: int) -> None:
        with self.wake:
            self.cancelled.add(index)
            self.wake.notify()

    def close_after(self, seconds: float) -> None:
        """Shutdown has begun: requests in flight `seconds` from now end with reason "shutdown"."""
        with self.wake:
            self.closing_at = time.monotonic() + seconds
            self.wake.notify()

    def stop(self) -> None:
        """Wait for the requests in flight to finish or be ended by `close_after`, then end the loop."""
        while self.load() and self.thread.is_alive():
            time.sleep(0.05)
        with self.wake:
            self.stopping = True
            self.closing_at = time.monotonic()
            self.wake.notify()
        self.thread.join(timeout=30)

    # ---- the loop ------------------------------------------------------------------------------------------------
    def _run(self) -> None:
        batch = self.engine.new_batch()
        while True:
            with self.wake:
                while not self.pending and not batch.rows and not self.cancelled and not self.stopping:
                    self.wake.wait(timeout=None if self.closing_at is None else 0.1)
                if self.stopping:
                    break
                if self.closing_at is not None and time.monotonic() >= self.closing_at:
                    self._end_all(batch, "shutdown")
                    batch = self.engine.new_batch()
                    continue
                room = self.max_batch - len(batch.rows)
                new = [self.pending.popleft() for _ in range(min(room, len(self.pending)))]
                cancelled, self.cancelled = self.cancelled, set()
                for sub in new:  # in flight from pending to active under the lock: load() never misses one
                    if sub.request.index not in cancelled:
                        self.active[sub.request.index] = sub
                self.metrics.queue_depth.set(len(self.pending))
            for sub in new:
                if sub.request.index in cancelled:  # gone before it started
                    self._finish(sub, "cancelled")
            new = [s for s in new if s.request.index in self.active]
            for index in cancelled:
                self.engine.cancel(batch, index)
            self.metrics.active.set(len(self.active))
            if new:
                self._admit(batch, new)
            if batch.rows:
                rows = list(batch.rows)
                try:
                    self._step(batch)
                    self.metrics.batch_rows.observe(len(rows))
                except Exception:
                    batch = self._isolate(rows)
            self.metrics.active.set(len(self.active))
        self._end_all(batch, "cancelled")
        for sub in list(self.pending):
            self._finish(sub, "cancelled")

    def _admit(self, batch, subs: list[Submission]) -> None:
        """Prefill new requests into the batch; when the group's prefill fails, each is tried alone."""
        try:
            gens = [s.sampling.generators(1)[0] for s in subs]
            self.engine.admit(batch, [s.request for s in subs], [s.sampling for s in subs], gens, self._emit)
            self.metrics.prompt_tokens.inc(sum(len(s.request.prompt) for s in subs))
        except Exception as e:
            if len(subs) > 1:
                for sub in subs:
                    self._admit(batch, [sub])
            else:
                self._fail(subs[0], e)

    def _step(self, batch) -> None:
        start = time.perf_counter()
        done = self.engine.step(batch, self._emit, on_round=self._on_round)
        planned = getattr(self.engine.policy, "planned_ms", None)
        if planned is not None:
            self.metrics.record_round_time(time.perf_counter() - start, planned / 1000)
        for row in done:
            self.metrics.record_stats(row.stats)
            self._finish(self.active.pop(row.request.index), row.request.finish_reason)

    def _isolate(self, rows) -> object:
        """After a failed round: rebuild each unfinished row from its tokens and run it alone once. A row that fails
        alone fails; the others join a fresh batch and go on."""
        fresh = self.engine.new_batch()
        for row in rows:
            sub = self.active.get(row.request.index)
            if sub is None:
                continue
            if row.request.finished:
                self._finish(self.active.pop(row.request.index), row.request.finish_reason)
                continue
            try:
                alone = self.engine.rebuild([row])
                self._step(alone)
                if alone.rows:
                    self.engine.merge(fresh, alone)
            except Exception as e:
                if row.request.index in self.active:
                    self._fail(sub, e)
        return fresh

    def _fail(self, sub: Submission, error: Exception) -> None:
        self.active.pop(sub.request.index, None)
        self._finish(sub, "error", f"{type(error).__name__}: {error}")

    def _end_all(self, batch, reason: str) -> None:
        for sub in list(self.active.values()):
            self._finish(sub, reason)
        self.active.clear()
        batch.rows.clear()

    def _on_round(self, _index: int, confidence_logits, verified: int, accepted: int) -> None:
        # The engine reports rounds of drafters with a confidence head only, so there is always an estimate.
        self.metrics.record_round(self.engine.policy.survival(confidence_logits[None])[0], verified, accepted)

    def _emit(self, index: int, tokens: list[int]) -> None:
        sub = self.active.get(index)
        if sub is None:
            return
        if sub.first_token is None:
            sub.first_token = time.perf_counter()
            self.metrics.ttft.observe(sub.first_token - sub.submitted)
        self.metrics.generated_tokens.inc(len(tokens))
        sub.send(("tokens", tokens))

    def _finish(self, sub: Submission, reason: str, error: str | None = None) -> None:
        self.metrics.finished(reason, time.perf_counter() - sub.submitted)
        sub.send(("done", reason, error))
