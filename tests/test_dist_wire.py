"""The lock-step protocol without a second process: plans on the wire, drift detection."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specbatch.kernels.drafters.base import Capture
from specbatch.runtime.config import EngineConfig
from specbatch.runtime.params import SamplingParams
from specbatch.runtime.plan import Plan
from specbatch.runtime.request import Request
from specbatch.serving.dist import PeerLost, follow
from specbatch.serving.dist.relay import EchoDrafter
from specbatch.serving.dist.wire import decode_hello, decode_plan, encode_hello, encode_plan

params = st.builds(SamplingParams, max_tokens=st.integers(1, 4096), temperature=st.floats(0, 2),
                   top_p=st.floats(0.01, 1.0), top_k=st.integers(0, 100), seed=st.integers(0, 2**63),
                   stop=st.lists(st.text(min_size=1, max_size=5), max_size=3),
                   stop_token_ids=st.lists(st.integers(0, 511), max_size=3), ignore_eos=st.booleans())


@given(params, st.lists(st.integers(0, 511), min_size=1, max_size=50), st.booleans(), st.booleans())
def test_a_plan_survives_the_wire(tiny, sp, prompt, closing, more):
    request = Request.create(prompt, sp, tiny.tokenizer)
    plan = Plan((request,), ("req-x",), closing=closing, abandon=closing, more_coming=more)
    got, fp = decode_plan(encode_plan(plan, "Scalar/w1/q0/e3"), tiny.tokenizer)
    assert fp == "Scalar/w1/q0/e3"
    assert (got.cancels, got.closing, got.abandon, got.more_coming) == (("req-x",), closing, closing, more)
    (copy,) = got.arrivals
    assert (copy.id, copy.prompt, copy.params) == (request.id, prompt, sp)


class ScriptedPeers:
    """Peers whose driver messages are given up front (no collective ever runs)."""

    rank, size, driver = 1, 2, False

    def __init__(self, messages):
        self.messages = list(messages)
        self.group = None

    def send_bytes(self, payload):
        return self.messages.pop(0)

    def watch(self, on_hang):
        pass

    def stop(self):
        pass


def test_a_follower_that_drifts_stops_loudly(tiny, monkeypatch):
    monkeypatch.setattr("specbatch.serving.dist.sharded.shard_target", lambda target, peers: None)
    hello = encode_hello(EngineConfig(speculation=False), tiny.name, tiny.n_layers, tiny.vocab_size, False)
    assert decode_hello(hello)["config"] == EngineConfig(speculation=False)
    request = Request.create([1, 2, 3], SamplingParams(max_tokens=2, seed=1), tiny.tokenizer)
    first = encode_plan(Plan((request,)), "Idle/w0/q0/e0")
    drifted = encode_plan(Plan(), "Gated/w5/q0/e9")  # not where this rank is after step 1
    with pytest.raises(PeerLost, match="left lock-step at step 1"):
        follow(ScriptedPeers([hello, first, drifted]), tiny)


def test_a_follower_refuses_a_different_target(tiny, monkeypatch):
    monkeypatch.setattr("specbatch.serving.dist.sharded.shard_target", lambda target, peers: None)
    hello = encode_hello(EngineConfig(), "other", tiny.n_layers + 1, tiny.vocab_size, True)
    with pytest.raises(PeerLost, match="different target"):
        follow(ScriptedPeers([hello]), tiny)


def test_echo_drafter_tracks_rows_like_the_real_one():
    echo = EchoDrafter(peers=None, vocab=8, send_logits=False)
    echo.add_rows([[1, 2, 3], [4, 5, 6]])
    echo.add_rows([[7, 8, 9]])
    assert echo.width == 3
    echo.filter([2, 0])
    assert echo.width == 2
    echo.cold_start(Capture([[1, 2, 3]]))
    assert echo.width == 1 and echo.nbytes() == 0
    echo.reset()
    assert echo.width == 0
