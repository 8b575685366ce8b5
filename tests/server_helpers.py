"""Serving the app on loopback for tests: a uvicorn thread, raw HTTP, and a gate on the
engine's rounds so tests stage events by state, never by time."""

from __future__ import annotations

import json
import socket
import threading
import time

import openai
import uvicorn

from specbatch.serving.http.app import create_app
from specbatch.serving.http.protocol import with_header_timeout
from specbatch.tools.compat import parse_response


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """The app over ``engine`` on a loopback port, in a thread; ``server_cls(config)``
    builds the uvicorn server (``GracefulServer`` for the shutdown tests)."""

    def __init__(self, engine, server_cls=uvicorn.Server, header_timeout=None, **kw):
        self.engine, self.port = engine, free_port()
        self.app = create_app(engine, "tiny", **kw)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error",
                                http=with_header_timeout(header_timeout))
        self.server = server_cls(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        until(lambda: self.server.started or not self.thread.is_alive())
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=kw.get("api_key") or "none", max_retries=0)

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.close()


def until(condition, timeout: float = 30.0) -> None:
    """Wait for a state (not a duration): fails only if it never comes."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the awaited state never came"
        time.sleep(0.005)


def raw_request(port: int, method: str, path: str, body: bytes = b"", headers: list | None = None) -> socket.socket:
    """Send one HTTP/1.1 request with exactly these bytes (no client-side validation)."""
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1", b"Connection: close"]
    if body or method == "POST":
        lines += [b"Content-Type: application/json", f"Content-Length: {len(body)}".encode()]
    lines += [name + b": " + value for name, value in headers or []]
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + body)
    return sock


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """Status and (de-chunked) body, reading until the server closes."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    return parse_response(data)


def call(port: int, method: str, path: str, body: bytes = b"", headers: list | None = None) -> tuple[int, bytes]:
    return read_response(raw_request(port, method, path, body, headers))


def sse_events(body: bytes) -> list:
    """The ``data:`` payloads of an SSE body, JSON-decoded (``[DONE]`` kept as the string)."""
    lines = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


class Gate:
    """Parks the engine thread at the end of every scheduler step until released: between
    two rounds a test can disconnect a client or begin a shutdown, and then see exactly
    what the next round did (``after[i]``: the gauges and finished ids of step i)."""

    def __init__(self, engine):
        self.scheduler, self.engine = engine.scheduler, engine
        self._real = self.scheduler.step
        self._permits = threading.Semaphore(0)
        self._opened = False
        self._released = 0
        self.after: list[tuple[dict, list[str]]] = []
        self.scheduler.step = self._step

    def _step(self, waiting, more_coming):
        done = self._real(waiting, more_coming=more_coming)
        self.after.append((self.scheduler.gauges(), [r.id for r in done]))
        if not self._opened:
            self._permits.acquire()
        return done

    def run_to(self, n: int) -> None:
        """Let the engine run until it is parked after its ``n``-th step."""
        while True:
            until(lambda: len(self.after) > self._released)  # parked after step len(after)
            if len(self.after) >= n:
                return
            self.release()

    def release(self) -> None:
        """End the parked step: the engine cuts its next plan and runs one more."""
        self._released += 1
        self._permits.release()

    def open(self) -> None:
        """Stop gating (and free a parked step): always before closing the engine."""
        self._opened = True
        self._permits.release()
