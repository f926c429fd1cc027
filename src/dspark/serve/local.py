"""Running the app: uvicorn's server, told when shutdown begins; and a server on a free loopback port in a
background thread, which the tests and the load benchmark drive."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


class DrainingServer(uvicorn.Server):
    """uvicorn's server that tells the app when shutdown begins (SIGINT, SIGTERM), so that requests in flight get the
    app's drain time and then end with an error a client can read, rather than waiting for the slowest stream."""

    async def shutdown(self, sockets=None) -> None:
        begin = getattr(getattr(self.config.app, "state", None), "begin_shutdown", None)
        if begin is not None:
            begin()
        await super().shutdown(sockets)


def server_config(app, host: str, port: int, drain_seconds: float) -> uvicorn.Config:
    # uvicorn's own deadline only backs up the app's drain: streams are ended by then and their connections close.
    return uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=drain_seconds + 5)


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
