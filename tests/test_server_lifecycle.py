"""A request's life at the edges: its client leaving, and the server shutting down.

The engine is gated (``Gate``): it parks after every round, so each test disconnects or
begins a shutdown between two known rounds and then checks what the next one did.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest
from server_helpers import Gate, Served, free_port, raw_request, read_response, sse_events, until

from specbatch import Engine
from specbatch.runtime.config import EngineConfig
from specbatch.serving.http.serve import EXIT_CUT, GracefulServer
from specbatch.kernels.build import new_engine


def _engine(model_dir, speculate: bool) -> Engine:
    from specbatch.kernels.models import load
    target = load(model_dir["llama"])
    config = EngineConfig(num_draft_tokens=3) if speculate else EngineConfig(speculation=False)
    return new_engine(target, target if speculate else None, config)


def _watch_cancels(engine) -> threading.Event:
    cancelled, real = threading.Event(), engine.cancel

    def cancel(handle):
        real(handle)
        cancelled.set()
    engine.cancel = cancel
    return cancelled


@pytest.mark.parametrize("stream, speculate", [(False, False), (True, True), (False, True), (True, False)])
def test_a_gone_client_is_cancelled_and_freed_within_one_round(model_dir, stream, speculate):
    engine = _engine(model_dir, speculate)
    served, gate = Served(engine), Gate(engine)
    cancelled = _watch_cancels(engine)
    try:
        body = {"prompt": "def f(x):", "max_tokens": 200, "ignore_eos": True, "stream": stream, "seed": 3}
        sock = raw_request(served.port, "POST", "/v1/completions", json.dumps(body).encode())
        gate.run_to(2)  # admitted and decoding; the engine is parked between two rounds
        [request] = engine.scheduler.requests()
        handle = engine.handle(request)
        emitted = request.emitted
        sock.close()  # the client goes away
        assert cancelled.wait(30), "the server never cancelled the request"
        gate.release()  # the parked round ends; the next plan carries the cancel
        gate.run_to(3)
        gauges, finished = gate.after[2]
        assert request.id in finished  # the round after the cancel reached the engine ended it
        assert request.emitted <= emitted + 1  # at most the token a pipelined plain round had in flight
        assert gauges["width"] == 0 and gauges["kv_bytes"] == 0  # its KV went with that round
        gate.open()
        assert handle.result(30).finish_reason == "cancelled"
    finally:
        gate.open()
        served.close()


def test_a_gone_client_still_waiting_for_admission_is_cancelled(model_dir):
    from specbatch.kernels.models import load
    engine = new_engine(load(model_dir["llama"]), None, EngineConfig(speculation=False, max_batch=1))
    served, gate = Served(engine), Gate(engine)
    cancelled = _watch_cancels(engine)
    try:
        running = raw_request(served.port, "POST", "/v1/completions", _body(20, False))
        gate.run_to(1)
        waiting = raw_request(served.port, "POST", "/v1/completions", _body(20, True))
        until(lambda: engine.stats()["queue_depth"] == 1)  # queued behind the one row max_batch allows
        waiting.close()
        assert cancelled.wait(30)
        gate.open()
        assert read_response(running)[0] == 200
        until(lambda: engine.stats()["requests_finished"] == 2)
        assert engine.stats()["finish_reasons"] == {"length": 1, "cancelled": 1}
    finally:
        gate.open()
        served.close()


def _graceful(grace: float):
    return lambda config: GracefulServer(config, config.app.state.drain, grace)


def _body(max_tokens: int, stream: bool) -> bytes:
    return json.dumps({"prompt": "def f(x):", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
                       "seed": 5}).encode()


def test_shutdown_cuts_what_outlives_the_grace(model_dir):
    engine = _engine(model_dir, False)
    gate = Gate(engine)  # nothing can finish: only the drain can end these two
    served = Served(engine, server_cls=_graceful(0))
    try:
        streaming = raw_request(served.port, "POST", "/v1/completions", _body(200, True))
        whole = raw_request(served.port, "POST", "/v1/completions", _body(200, False))
        drain = served.app.state.drain
        until(lambda: len(drain.live) == 2)
        served.server.should_exit = True  # what SIGTERM does
        status, body = read_response(streaming)
        events = sse_events(body)
        assert status == 200 and events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutting_down"
        status, body = read_response(whole)
        assert status == 503 and json.loads(body)["error"]["code"] == "shutting_down"
        served.thread.join(30)
        assert not served.thread.is_alive() and drain.cut == 2
        gate.open()  # the engine got both cancels
        until(lambda: engine.stats()["finish_reasons"].get("cancelled", 0) == 2)
    finally:
        gate.open()
        served.close()


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        return False
    except (ConnectionRefusedError, ConnectionResetError):  # reset: it reached a backlog the closing listener dropped
        return True


def test_shutdown_stops_accepting_and_lets_live_requests_finish(model_dir):
    engine = _engine(model_dir, False)
    gate = Gate(engine)
    served = Served(engine, server_cls=_graceful(30))
    try:
        kept = httpx.Client(base_url=served.url, timeout=30)  # a keep-alive connection opened before
        assert kept.get("/health").status_code == 200
        streaming = raw_request(served.port, "POST", "/v1/completions", _body(6, True))
        drain = served.app.state.drain
        until(lambda: len(drain.live) == 1)
        served.server.should_exit = True
        until(lambda: _refused(served.port))  # no new connections, while the stream is still live
        late = kept.post("/v1/completions", content=_body(4, False))
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        gate.open()
        status, body = read_response(streaming)
        events = sse_events(body)
        assert status == 200 and events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        served.thread.join(30)
        assert not served.thread.is_alive() and drain.cut == 0
        kept.close()
    finally:
        gate.open()
        served.close()


class ServeProcess:
    """``specbatch serve`` as a real process on a free port (SIGTERM goes to it, not to us)."""

    def __init__(self, model: str, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "specbatch.serving.cli", "serve", "--model", model,
                                      "--no-speculation", "--port", str(self.port), *args],
                                     env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        until(self._up, timeout=120)

    def _up(self) -> bool:
        assert self.proc.poll() is None, self.proc.stdout.read().decode()
        try:
            return httpx.get(f"{self.url}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def stream_through_sigterm(self, max_tokens: int) -> list:
        """Stream a completion, SIGTERM the server once its first chunk is here, read the rest."""
        body = {"prompt": "x", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        lines = []
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    if not lines:
                        self.proc.send_signal(signal.SIGTERM)
                    lines.append(line)
        return sse_events("\n".join(lines).encode())

    def exit_code(self) -> int:
        return self.proc.wait(60)


def test_sigterm_drains_and_exits_zero(model_dir):
    server = ServeProcess(str(model_dir["llama"]))
    try:
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert r.status_code == 200
        events = server.stream_through_sigterm(24)  # well inside the default 30 s grace
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert server.exit_code() == 0, server.proc.stdout.read().decode()
    finally:
        server.proc.kill()


def test_sigterm_past_the_grace_cuts_with_an_error_and_exits_nonzero(model_dir):
    # 2,000 tokens take seconds here; the cut comes within uvicorn's 0.1 s tick of the signal
    server = ServeProcess(str(model_dir["llama"]), "--shutdown-grace", "0")
    try:
        events = server.stream_through_sigterm(2000)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutting_down"
        assert server.exit_code() == EXIT_CUT
        assert "were cut" in server.proc.stdout.read().decode()
    finally:
        server.proc.kill()
