"""No input yields a 5xx: bad values are a 400 in the OpenAI envelope naming the parameter,
hostile bodies and header bytes included; after a fuzz the server still serves a seeded
request exactly as before."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_helpers import Served, call

from specbatch.kernels.build import new_engine
from specbatch.runtime.config import EngineConfig
from specbatch.tools.compat import exchange, verdict
from specbatch.tools.compat_cases import matrix

ROUTES = [("GET", "/health"), ("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
          ("POST", "/v1/chat/completions"), ("GET", "/nope"), ("DELETE", "/v1/completions")]


@pytest.fixture(scope="module")
def served(model_dir):
    from specbatch.kernels.models import load
    tiny = load(model_dir["llama"])
    served = Served(new_engine(tiny, tiny, EngineConfig(num_draft_tokens=3, speculative_width_cap=2, max_queue=64)))
    yield served
    served.close()


def _raw(**fields) -> bytes:
    """A completion body with ``fields`` spliced in verbatim (NaN, 1e400, 5,000-digit ints...)."""
    return ("{" + ", ".join([f'"{k}": {v}' for k, v in {"prompt": '"x"', **fields}.items()]) + "}").encode()


BAD = [  # (path, body, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", b'\xff\xfe{"prompt": "x"}\xff', 400, None),
    ("/v1/completions", b"[" * 1000 + b"]" * 1000, 400, None),
    ("/v1/completions", b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400, None),
    ("/v1/completions", json.dumps({"model": "tiny"}).encode(), 400, "prompt"),
    ("/v1/completions", _raw(prompt=5), 400, "prompt"),
    ("/v1/completions", _raw(prompt="[]"), 400, "prompt"),
    ("/v1/completions", _raw(prompt=f"[{2 ** 70}]"), 400, "prompt"),
    ("/v1/completions", _raw(prompt="[1, -1]"), 400, "prompt"),
    ("/v1/completions", _raw(prompt="[true]"), 400, "prompt"),
    ("/v1/completions", _raw(prompt="[[1, 2]]"), 400, "prompt"),
    ("/v1/completions", _raw(prompt="[" + "9" * 5000 + "]"), 400, "prompt"),
    ("/v1/completions", _raw(prompt=json.dumps("x " * 5000)), 400, "prompt"),
    ("/v1/completions", _raw(max_tokens=0), 400, "max_tokens"),
    ("/v1/completions", _raw(max_tokens='"9"'), 400, "max_tokens"),
    ("/v1/completions", _raw(max_tokens=2 ** 64), 400, "max_tokens"),
    ("/v1/completions", _raw(max_tokens="9" * 5000), 400, "max_tokens"),
    ("/v1/completions", _raw(max_tokens=5000), 400, "max_tokens"),
    ("/v1/completions", _raw(max_completion_tokens=-3), 400, "max_completion_tokens"),
    ("/v1/completions", _raw(temperature=-1), 400, "temperature"),
    ("/v1/completions", _raw(temperature="NaN"), 400, "temperature"),
    ("/v1/completions", _raw(temperature="Infinity"), 400, "temperature"),
    ("/v1/completions", _raw(temperature="-Infinity"), 400, "temperature"),
    ("/v1/completions", _raw(temperature="1e400"), 400, "temperature"),
    ("/v1/completions", _raw(temperature="9" * 400), 400, "temperature"),
    ("/v1/completions", _raw(temperature="true"), 400, "temperature"),
    ("/v1/completions", _raw(top_p=0), 400, "top_p"),
    ("/v1/completions", _raw(top_p="NaN"), 400, "top_p"),
    ("/v1/completions", _raw(top_p=1.5), 400, "top_p"),
    ("/v1/completions", _raw(top_k=2 ** 63), 400, "top_k"),
    ("/v1/completions", _raw(top_k=2 ** 31), 400, "top_k"),
    ("/v1/completions", _raw(top_k=-2), 400, "top_k"),
    ("/v1/completions", _raw(top_k=1.5), 400, "top_k"),
    ("/v1/completions", _raw(seed=2 ** 64), 400, "seed"),
    ("/v1/completions", _raw(seed=-(2 ** 63) - 1), 400, "seed"),
    ("/v1/completions", _raw(seed=1.5), 400, "seed"),
    ("/v1/completions", _raw(n=0), 400, "n"),
    ("/v1/completions", _raw(n=17), 400, "n"),
    ("/v1/completions", _raw(n=2 ** 64), 400, "n"),
    ("/v1/completions", _raw(stop="[1]"), 400, "stop"),
    ("/v1/completions", _raw(stop='""'), 400, "stop"),
    ("/v1/completions", _raw(stop="{}"), 400, "stop"),
    ("/v1/completions", _raw(stream='"yes"'), 400, "stream"),
    ("/v1/completions", _raw(stream_options='{"include_usage": 1}'), 400, "stream_options"),
    ("/v1/completions", _raw(stream_options="[]"), 400, "stream_options"),
    ("/v1/completions", _raw(ignore_eos=1), 400, "ignore_eos"),
    ("/v1/completions", _raw(model=5), 400, "model"),
    ("/v1/completions", _raw(model='"gpt-9"'), 404, "model"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image"}]}]}', 400, "messages[0].content[0]"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}]}', 400, "messages[0].content"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "\ud800"}]}', 400, "messages"),
    ("/v1/completions", _raw(prompt=r'"\udfff"'), 400, "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400,
     "temperature"),
]


@pytest.mark.parametrize("path, body, status, param", BAD)
def test_bad_input_matrix(served, path, body, status, param):
    got, raw = call(served.port, "POST", path, body)
    assert got == status, raw
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err


@pytest.mark.parametrize("method, path", ROUTES)
def test_undecodable_header_bytes_are_400_on_every_route(served, method, path):
    got, raw = call(served.port, method, path, b'{"prompt": "x", "max_tokens": 1}',
                    headers=[(b"X-Junk", b"caf\xe9 \xff\xfe")])
    err = json.loads(raw)["error"]
    assert got == 400 and err["param"] == "x-junk" and err["code"] == "invalid_header"


def _seeded(served) -> str:
    return served.client.completions.create(model="tiny", prompt="def g(y):", max_tokens=16, temperature=0.9,
                                            seed=77).choices[0].text


KEYS = ["prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
        "stream", "messages", "model", "stream_options", "ignore_eos", "logprobs", "role", "content"]
LEAVES = (st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats() | st.text(max_size=12)
          | st.sampled_from([0, 1, -1, 2 ** 31, 2 ** 63, 2 ** 64, "tiny", "x", "user"]))
BODIES = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.sampled_from(KEYS) | st.text(max_size=5), inner, max_size=6), max_leaves=12)
BASES = st.sampled_from([{"prompt": "x", "max_tokens": 2}, {}, {"messages": [{"role": "user", "content": "x"}],
                                                                 "max_tokens": 2}])
# a valid base with fuzzed fields over it reaches every field's check, not just the first
REQUESTS = st.builds(lambda base, extra: {**base, **extra}, BASES,
                     st.dictionaries(st.sampled_from(KEYS), BODIES, max_size=4)) | BODIES
HEADER_NAMES = st.sampled_from(["x-test", "authorization", "user-agent", "accept", "content-type", "x-b"])
HEADER_VALUES = st.binary(max_size=12).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))


def test_fuzz_never_5xx_and_a_seeded_request_is_unchanged(served):
    before = _seeded(served)

    @settings(max_examples=80, deadline=None)
    @given(body=REQUESTS, stream=st.booleans())
    def bodies(body, stream):
        if isinstance(body, dict):
            body = {"stream": stream, **body}
            for key in ("max_tokens", "max_completion_tokens"):  # valid budgets stay short: a fast suite
                if isinstance(body.get(key), int) and 4 < body[key] <= 2048:
                    body[key] = 4
        raw = json.dumps(body).encode()  # NaN and Infinity go out as the literals Python's json reads
        for path in ("/v1/completions", "/v1/chat/completions"):
            status, reply = call(served.port, "POST", path, raw)
            assert status < 500, (body, reply)

    @settings(max_examples=30, deadline=None)
    @given(raw=st.binary(max_size=64))
    def raw_bodies(raw):
        status, reply = call(served.port, "POST", "/v1/completions", raw)
        assert status < 500, (raw, reply)

    @settings(max_examples=40, deadline=None)
    @given(route=st.sampled_from(ROUTES), headers=st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=3))
    def headers(route, headers):
        status, reply = call(served.port, *route, b'{"prompt": "x", "max_tokens": 1}',
                             headers=[(name.encode(), value) for name, value in headers])
        assert status < 500, (route, headers, reply)

    bodies()
    raw_bodies()
    headers()
    assert _seeded(served) == before


@pytest.mark.parametrize("case", matrix(), ids=lambda c: c.name[:60])
def test_the_compat_matrix(served, case):
    """``python -m specbatch.tools.compat``'s matrix (run there against the real model) on the tiny one."""
    status, body = exchange(served.port, case)
    assert verdict(case, status, body) == "ok", (status, body[:300])
