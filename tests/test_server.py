"""The real server on loopback, through the official openai client and raw HTTP."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st

from specbatch import Engine
from specbatch.config import EngineConfig
from specbatch.server.app import create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    def __init__(self, engine, **kw):
        self.engine, self.port = engine, free_port()
        self.server = uvicorn.Server(uvicorn.Config(create_app(engine, "tiny", **kw), host="127.0.0.1",
                                                    port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=kw.get("api_key") or "none", max_retries=0)

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.engine.close()


@pytest.fixture(scope="module")
def spec_server(model_dir):
    from specbatch.models import load
    tiny = load(model_dir["llama"])
    served = Served(Engine(tiny, tiny, EngineConfig(num_draft_tokens=3, speculative_width_cap=2,
                                                    rearm_min_remaining=4, max_queue=64)))
    yield served
    served.close()


@pytest.fixture(scope="module")
def plain_server(model_dir):
    from specbatch.models import load
    served = Served(Engine(load(model_dir["llama"]), None, EngineConfig(speculation=False)))
    yield served
    served.close()


def test_completions_and_chat(spec_server):
    c = spec_server.client
    out = c.completions.create(model="tiny", prompt="def f(x):", max_tokens=8, temperature=0, seed=1)
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens <= 8
    pieces = [ch.choices[0].text for ch in c.completions.create(model="tiny", prompt="def f(x):", max_tokens=8,
                                                                 temperature=0, seed=1, stream=True)]
    assert "".join(pieces) == out.choices[0].text
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, seed=2)
    assert chat.choices[0].message.role == "assistant"
    stream = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                       seed=2, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert [m.id for m in c.models.list().data] == ["tiny"]
    assert httpx.get(f"{spec_server.url}/health").json()["status"] == "ok"


def seeded(served, prompt, seed, n=24):
    return served.client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0.8,
                                            seed=seed).choices[0].text


def test_seeded_text_is_schedule_invariant(spec_server, plain_server):
    prompts = [f"def f{i}(x):" for i in range(8)]
    alone = [seeded(spec_server, p, 100 + i) for i, p in enumerate(prompts)]
    assert [seeded(plain_server, p, 100 + i) for i, p in enumerate(prompts)] == alone
    before = spec_server.engine.stats()["transitions"]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = []
        for i, p in enumerate(prompts):
            futures.append(pool.submit(seeded, spec_server, p, 100 + i))
            time.sleep(0.02)
        assert [f.result() for f in futures] == alone
    after = spec_server.engine.stats()["transitions"]
    assert after.get("Scalar->Batched", 0) > before.get("Scalar->Batched", 0) or \
        after.get("Idle->Batched", 0) > before.get("Idle->Batched", 0)
    assert after.get("Batched->Gated", 0) > before.get("Batched->Gated", 0)


def test_64_streams_with_a_quarter_cancelled(spec_server):
    def one(i):
        body = {"model": "tiny", "prompt": f"x = {i}", "max_tokens": 12, "stream": True, "seed": i,
                "temperature": 0.5, "stream_options": {"include_usage": True}}
        usage, text = None, []
        with httpx.Client(timeout=120) as h, h.stream("POST", f"{spec_server.url}/v1/completions", json=body) as r:
            for n, line in enumerate(r.iter_lines()):
                if i % 4 == 0 and n == 3:
                    return None  # disconnect mid-stream
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
                    text += [c["text"] for c in chunk["choices"]]
        return usage["completion_tokens"], "".join(text)

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(64)))
    for i, got in enumerate(results):  # exact: the same seeded request alone, afterwards
        if got is not None:
            alone = spec_server.client.completions.create(model="tiny", prompt=f"x = {i}", max_tokens=12, seed=i,
                                                          temperature=0.5)
            assert got == (alone.usage.completion_tokens, alone.choices[0].text), i
    deadline = time.time() + 20
    while time.time() < deadline:
        metrics = httpx.get(f"{spec_server.url}/metrics").text
        if "specbatch_live_width 0" in metrics and "specbatch_kv_bytes 0" in metrics:
            break
        time.sleep(0.05)
    assert "specbatch_live_width 0" in metrics and "specbatch_kv_bytes 0" in metrics
    assert 'specbatch_finished_total{reason="cancelled"}' in metrics


BAD = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"model": "tiny"}).encode(), 400, "prompt"),
    (json.dumps({"prompt": 5}).encode(), 400, "prompt"),
    (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "x", "max_tokens": "9"}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "x", "temperature": -1}).encode(), 400, "temperature"),
    (json.dumps({"prompt": "x", "n": 2}).encode(), 400, "n"),
    (json.dumps({"prompt": "x", "top_p": 0}).encode(), 400, "top_p"),
    (json.dumps({"prompt": "x", "model": "gpt-9"}).encode(), 404, "model"),
    (json.dumps({"prompt": "x " * 5000}).encode(), 400, "prompt"),
]


@pytest.mark.parametrize("body, status, param", BAD)
def test_bad_input_matrix(spec_server, body, status, param):
    r = httpx.post(f"{spec_server.url}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    if "x x x" in body.decode(errors="ignore"):
        assert err["code"] == "context_length_exceeded"


@settings(max_examples=40, deadline=None)
@given(body=st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
                         lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                             st.sampled_from(["prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "n",
                                              "stream", "messages", "model", "stream_options"]), inner, max_size=6),
                         max_leaves=12))
def test_fuzzed_bodies_never_500(spec_server, body):
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = httpx.post(f"{spec_server.url}{path}", json=body, timeout=60)
        assert r.status_code < 500, (body, r.text)
    assert httpx.get(f"{spec_server.url}/health").status_code == 200


def test_multi_turn_chat_hits_the_prompt_cache(spec_server):
    c = spec_server.client
    history = [{"role": "user", "content": "write a function that adds two numbers"}]
    first = c.chat.completions.create(model="tiny", messages=history, max_tokens=10, temperature=0)
    hits = spec_server.engine.stats()["prompt_cache_hits"]
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "now subtract"}]
    c.chat.completions.create(model="tiny", messages=history, max_tokens=5, temperature=0)
    assert spec_server.engine.stats()["prompt_cache_hits"] > hits


def test_api_key_and_body_limit(model_dir):
    from specbatch.models import load
    served = Served(Engine(load(model_dir["llama"]), None, EngineConfig(speculation=False)), api_key="s3cret",
                    max_body=2000)
    try:
        body = {"prompt": "x", "max_tokens": 2}
        assert httpx.post(f"{served.url}/v1/completions", json=body).status_code == 401
        wrong = httpx.post(f"{served.url}/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{served.url}/health").status_code == 200
        assert served.engine.stats()["requests_submitted"] == 0  # nothing ran
        ok = httpx.post(f"{served.url}/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        big = httpx.post(f"{served.url}/v1/completions", json={"prompt": "x" * 5000},
                         headers={"Authorization": "Bearer s3cret"})
        assert big.status_code == 413
    finally:
        served.close()


def test_queue_full_is_503_with_retry_after(model_dir):
    from specbatch.models import load
    engine = Engine(load(model_dir["llama"]), None, EngineConfig(speculation=False, max_queue=1, max_batch=1))
    served = Served(engine)
    try:
        long = {"prompt": "x", "max_tokens": 400, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(httpx.post, f"{served.url}/v1/completions", json=long, timeout=60) for _ in range(6)]
            codes = [f.result().status_code for f in futures]
        assert 503 in codes and 200 in codes
        r503 = next(f.result() for f in futures if f.result().status_code == 503)
        assert r503.headers["retry-after"] and r503.json()["error"]["code"] == "queue_full"
    finally:
        served.close()


def test_sigterm_drains_and_exits_zero(model_dir):
    port = free_port()
    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, "-m", "specbatch.cli", "serve", "--model", str(model_dir["llama"]),
                             "--no-speculation", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stdout.read().decode()
    finally:
        proc.kill()


def test_failure_after_streaming_started_sends_an_error_event(model_dir):
    from helpers import inject_failure

    from specbatch.models import load
    engine = Engine(load(model_dir["llama"]), None, EngineConfig(speculation=False))
    served = Served(engine)
    try:
        inject_failure(engine, at_call=6)
        body = {"prompt": "def f(x):", "max_tokens": 40, "stream": True}
        with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2][len("data: "):])
        assert err["error"]["code"] == "generation_failed"
        ok = httpx.post(f"{served.url}/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=60)
        assert ok.status_code == 200
    finally:
        served.close()
