"""The header read timeout (issue 26): the protocol driven by hand with a fake loop whose
timers fire when the test says, and once through a real server and a socket that stalls."""

from __future__ import annotations

import json

import pytest
import uvicorn
from uvicorn.server import ServerState

from specbatch.serving.http.protocol import with_header_timeout


class FakeTimer:
    def __init__(self, delay, callback):
        self.delay, self.callback, self.cancelled = delay, callback, False

    def cancel(self):
        self.cancelled = True


class FakeLoop:
    """Timers never fire on their own: ``fire()`` runs the live ones."""

    def __init__(self):
        self.timers: list[FakeTimer] = []
        self.tasks: list = []

    def call_later(self, delay, callback):
        self.timers.append(FakeTimer(delay, callback))
        return self.timers[-1]

    def create_task(self, coro):
        self.tasks.append(coro)
        coro.close()  # the app is not run: only the connection's reading is under test
        return self

    def add_done_callback(self, _):
        pass

    def live(self):
        return [t for t in self.timers if not t.cancelled]

    def fire(self):
        for timer in self.live():
            timer.cancelled = True
            timer.callback()


class FakeTransport:
    def __init__(self):
        self.written, self.closed = b"", False

    def write(self, data):
        self.written += data

    def close(self):
        self.closed = True

    def is_closing(self):
        return self.closed

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass


async def _app(scope, receive, send):  # never called: FakeLoop closes the task
    raise AssertionError


def connect(timeout=0.5):
    loop, transport = FakeLoop(), FakeTransport()
    config = uvicorn.Config(_app, log_level="error")
    protocol = with_header_timeout(timeout)(config=config, server_state=ServerState(), app_state={}, _loop=loop)
    protocol.connection_made(transport)
    return protocol, loop, transport


def test_partial_headers_past_the_timeout_get_408_and_close():
    protocol, loop, transport = connect()
    protocol.data_received(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
    assert [t.delay for t in loop.live()] == [0.5] and not transport.closed
    loop.fire()
    assert transport.closed
    head, _, body = transport.written.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head
    assert json.loads(body)["error"]["code"] == "header_timeout"


def test_a_connection_that_sends_nothing_is_closed_without_an_answer():
    protocol, loop, transport = connect()
    loop.fire()
    assert transport.closed and transport.written == b""


def test_complete_headers_stop_the_clock():
    protocol, loop, transport = connect()
    protocol.data_received(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
    assert loop.live() == [] and len(loop.tasks) == 1  # the request went to the app; its body is the app's
    protocol.header_timed_out()  # a timer that raced the headers does nothing
    assert not transport.closed and transport.written == b""


def test_bytes_in_several_reads_share_one_clock():
    protocol, loop, transport = connect()
    for piece in (b"GET /health HT", b"TP/1.1\r\n", b"Host: x\r\n"):
        protocol.data_received(piece)
    assert len(loop.timers) == 1 and len(loop.live()) == 1


def test_a_kept_alive_connection_starts_a_new_clock_at_its_next_request():
    import h11
    protocol, loop, transport = connect()
    protocol.data_received(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert loop.live() == []
    for event in (h11.Response(status_code=200, headers=[("content-length", "0")]), h11.EndOfMessage()):
        transport.write(protocol.conn.send(event))  # the app's answer, as uvicorn's cycle sends it
    protocol.on_response_complete()
    assert [t.delay for t in loop.live()] == [protocol.timeout_keep_alive]  # idle: keep-alive's, not ours
    protocol.data_received(b"GET /hea")
    assert [t.delay for t in loop.live()] == [0.5]  # the next request's first bytes: a new header clock
    sent = len(transport.written)
    loop.fire()
    assert transport.closed and transport.written[sent:].startswith(b"HTTP/1.1 408 ")


def test_no_timeout_means_no_timer():
    protocol, loop, transport = connect(timeout=None)
    protocol.data_received(b"GET /health HTTP/1.1\r\n")
    assert loop.timers == []


def test_a_lost_connection_stops_its_clock():
    protocol, loop, transport = connect()
    protocol.data_received(b"GET /he")
    protocol.connection_lost(None)
    assert loop.live() == []


@pytest.mark.parametrize("sent", [b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n", b"POST /v1/comp"])
def test_a_real_server_closes_a_connection_stalled_in_its_headers(model_dir, sent):
    import socket

    from server_helpers import Served, read_response

    from specbatch.kernels.build import new_engine
    from specbatch.kernels.models import load
    from specbatch.runtime.config import EngineConfig
    s = Served(new_engine(load(model_dir["llama"]), None, EngineConfig(speculation=False)), header_timeout=0.2)
    try:
        sock = socket.create_connection(("127.0.0.1", s.port), timeout=60)
        sock.sendall(sent)  # then nothing: only the server's timeout ends the wait
        status, body = read_response(sock)
        assert status == 408 and json.loads(body)["error"]["code"] == "header_timeout"
    finally:
        s.close()
