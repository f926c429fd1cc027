"""Running the app: uvicorn's server, told when shutdown begins; and a server on a free loopback port in a
background thread, which the tests and the load benchmark drive."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_SECONDS = 10.0  # a request's headers must arrive whole within this (the app's WholeBody times the body)


class DrainingServer(uvicorn.Server):
    """uvicorn's server that tells the app when shutdown begins (SIGINT, SIGTERM), so that requests in flight get the
    app's drain time and then end with an error a client can read, rather than waiting for the slowest stream. It
    keeps listening while they drain, so that a new request is answered 503 by the app instead of refused."""

    async def shutdown(self, sockets=None) -> None:
        state = getattr(self.config.app, "state", None)
        begin = getattr(state, "begin_shutdown", None)
        if begin is not None:
            begin()
            deadline = time.monotonic() + state.drain_seconds + 1
            while state.in_flight() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        await super().shutdown(sockets)


class HeadersInTime(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for each request's headers: a client that trickles them (which
    restarts uvicorn's keep-alive timer on every byte) is cut off after HEADER_SECONDS instead of holding a
    connection."""

    deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.arm()

    def on_response_complete(self) -> None:
        self.arm()  # before: a pipelined request that follows disarms it in handle_events
        super().on_response_complete()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self.disarm()

    def connection_lost(self, exc) -> None:
        self.disarm()
        super().connection_lost(exc)

    def arm(self) -> None:
        self.disarm()
        self.deadline = self.loop.call_later(HEADER_SECONDS, self.headers_late)

    def disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def headers_late(self) -> None:
        if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
            self.transport.close()


def server_config(app, host: str, port: int, drain_seconds: float) -> uvicorn.Config:
    # uvicorn's own deadline only backs up the app's drain: streams are ended by then and their connections close.
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=drain_seconds + 5,
        http=HeadersInTime,
    )


class LocalServer:
    def __init__(self, app, drain_seconds: float = 10.0):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = DrainingServer(server_config(app, "127.0.0.1", self.port, drain_seconds))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LocalServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the local server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True  # what uvicorn's SIGINT handler does: the graceful shutdown above
        self.thread.join(timeout=120)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
