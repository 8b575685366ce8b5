"""A request's life at the edges: its client leaving, and the server shutting down.

The engine is gated (``Gate``): it parks after every round, so each test disconnects or
begins a shutdown between two known rounds and then checks what the next one did.
"""

from __future__ import annotations

import json
import threading

import pytest
from server_helpers import Gate, Served, raw_request

from specbatch import Engine
from specbatch.config import EngineConfig


def _engine(model_dir, speculate: bool) -> Engine:
    from specbatch.models import load
    target = load(model_dir["llama"])
    config = EngineConfig(num_draft_tokens=3) if speculate else EngineConfig(speculation=False)
    return Engine(target, target if speculate else None, config)


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
        assert request.handle.result(30).finish_reason == "cancelled"
    finally:
        gate.open()
        served.close()

