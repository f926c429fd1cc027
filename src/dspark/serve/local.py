"""A server on a free loopback port in a background thread: what the tests and the load benchmark drive."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


class LocalServer:
    def __init__(self, app):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
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
        self.server.should_exit = True  # uvicorn's graceful shutdown: the app's lifespan drains the engine loop
        self.thread.join(timeout=120)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
