"""One engine loop owning the batch: requests join and leave between rounds (continuous batching).

The loop runs in its own thread, since a round is seconds of torch work that must not block the HTTP event loop.
HTTP handlers `submit` requests and read their tokens from an asyncio queue that the loop fills; `cancel` (a client
that went away, a stop string reached) takes a row out at the next round. A prefill that raises fails only the
requests it was admitting; a round that raises fails the rows it held (their caches are in an unknown state), and
the loop starts a fresh batch and keeps serving.
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

    def stop(self, drain_seconds: float = 10.0) -> None:
        """Finish in-flight requests for up to `drain_seconds`, then cancel what is left and end the loop."""
        deadline = time.monotonic() + drain_seconds
        while self.load() and time.monotonic() < deadline:
            time.sleep(0.05)
        with self.wake:
            self.stopping = True
            self.wake.notify()
        self.thread.join(timeout=30)

    # ---- the loop ------------------------------------------------------------------------------------------------
    def _run(self) -> None:
        batch = self.engine.new_batch()
        while True:
            with self.wake:
                while not self.pending and not batch.rows and not self.cancelled and not self.stopping:
                    self.wake.wait()
                if self.stopping:
                    break
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
                try:  # a prefill that fails fails its own requests; the batch was not touched yet
                    self.engine.admit(batch, [s.request for s in new], [s.sampling for s in new],
                                      [s.sampling.generators(1)[0] for s in new], self._emit)
                    self.metrics.prompt_tokens.inc(sum(len(s.request.prompt) for s in new))
                except Exception as e:  # noqa: BLE001 - one bad request must not end the server
                    for sub in new:
                        self._finish(self.active.pop(sub.request.index), "error", f"{type(e).__name__}: {e}")
            if batch.rows:
                try:
                    rows = len(batch.rows)
                    for row in self.engine.step(batch, self._emit):
                        self.metrics.record_stats(row.stats)
                        self._finish(self.active.pop(row.request.index), row.request.finish_reason)
                    self.metrics.batch_rows.observe(rows)
                except Exception as e:  # noqa: BLE001 - a failed round fails the rows it held, then serving goes on
                    for sub in list(self.active.values()):
                        self._finish(sub, "error", f"{type(e).__name__}: {e}")
                    self.active.clear()
                    batch = self.engine.new_batch()
            self.metrics.active.set(len(self.active))
        for sub in list(self.active.values()) + list(self.pending):
            self._finish(sub, "cancelled")

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
