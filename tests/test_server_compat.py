"""OpenAI compatibility: what clients send is honoured or refused (issue 26)."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import Served

from specbatch.runtime.config import EngineConfig
from specbatch.kernels.build import new_engine


@pytest.fixture(scope="module")
def served(model_dir):
    from specbatch.kernels.models import load
    tiny = load(model_dir["llama"])
    s = Served(new_engine(tiny, tiny, EngineConfig(num_draft_tokens=3, max_queue=4)))
    yield s
    s.close()


def post(served, path, body):
    return httpx.post(f"{served.url}/v1/{path}", json=body, timeout=60)


def chat(served, messages, **kw):
    return post(served, "chat/completions", {"messages": messages, "max_tokens": 6, "temperature": 0, **kw})


def test_text_parts_equal_the_joined_string_through_the_openai_client(served):
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    got = served.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}],
                                                max_tokens=6, temperature=0)
    want = chat(served, [{"role": "user", "content": "Hello there"}]).json()
    assert got.choices[0].message.content == want["choices"][0]["message"]["content"]


def test_tool_call_history_is_accepted(served):
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    assert chat(served, history).status_code == 200


@pytest.mark.parametrize("messages, param", [
    ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"role": "", "content": "x"}], "messages[0].role"),
    ([{"role": "user\u0000", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": None}], "messages[0].content"),
])
def test_bad_messages_are_400_naming_the_param(served, messages, param):
    r = chat(served, messages)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    if "content[0]" in param:
        assert r.json()["error"]["code"] == "unsupported_parameter"
        assert messages[0]["content"][0]["type"] in r.json()["error"]["message"]


@pytest.mark.parametrize("field, value", [
    ("response_format", {"type": "json_object"}), ("response_format", "text"), ("tools", [{"type": "function"}]),
    ("tool_choice", "auto"), ("functions", [{"name": "f"}]), ("stream_options", {"include_usage": True}),
    ("modalities", ["text", "audio"]), ("audio", {"voice": "alloy"}), ("reasoning_effort", "high"),
    ("web_search_options", {}), ("min_p", 0.1), ("repetition_penalty", 1.3), ("min_tokens", 5),
    ("guided_json", {"type": "object"}), ("guided_choice", ["a", "b"])])
def test_fields_the_engine_cannot_honour_are_refused(served, field, value):
    r = chat(served, [{"role": "user", "content": "x"}], **{field: value})
    assert r.status_code == 400
    assert r.json()["error"] | {"message": None} == {"message": None, "type": "invalid_request_error",
                                                     "param": field, "code": "unsupported_parameter"}


def test_harmless_values_of_those_fields_pass(served):
    r = chat(served, [{"role": "user", "content": "x"}], response_format={"type": "text"}, tool_choice="none",
             modalities=["text"], min_p=0, repetition_penalty=1.0, min_tokens=0)
    assert r.status_code == 200


@pytest.mark.parametrize("field, value", [
    ("logit_bias", {"abc": 1}), ("logit_bias", {"1": 1000}), ("logit_bias", [1, 2]),
    ("logit_bias", {str(i): 1 for i in range(301)}), ("logit_bias", {"99999999": 1}),
    ("presence_penalty", 5), ("frequency_penalty", "high"), ("max_tokens", -1)])
def test_bad_sampling_values_are_400_naming_the_param(served, field, value):
    r = chat(served, [{"role": "user", "content": "x"}], max_completion_tokens=4, **{field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.json()


def test_logit_bias_changes_the_text(served):
    token = 42
    text = served.engine.tokenizer.decode([token] * 4)
    r = post(served, "completions", {"prompt": "a", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                                     "logit_bias": {str(token): 100}})
    assert r.json()["choices"][0]["text"] == text


def test_echo_puts_the_prompt_first(served):
    body = {"prompt": "def f(x):", "max_tokens": 4, "temperature": 0}
    plain = post(served, "completions", body).json()["choices"][0]["text"]
    assert post(served, "completions", body | {"echo": True}).json()["choices"][0]["text"] == "def f(x):" + plain


def test_models_retrieve(served):
    assert served.client.models.retrieve("tiny").id == "tiny"
    r = httpx.get(f"{served.url}/v1/models/nope", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_n_counts_n_against_the_queue(served):
    r = post(served, "completions", {"prompt": "a", "max_tokens": 2, "n": 5})  # max_queue is 4
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
    assert post(served, "completions", {"prompt": "a", "max_tokens": 2, "n": 4}).status_code == 200


def _stop_at_a_token_of(served, body) -> str:
    """A stop string the greedy completion of ``body`` reaches: the text of its third token."""
    r = post(served, "completions", body | {"logprobs": 0}).json()["choices"][0]
    return r["logprobs"]["tokens"][2]


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_text_and_usage_agree_after_a_stop_string(served, stream):
    body = {"prompt": "def f(x):", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    stop = _stop_at_a_token_of(served, body)
    args = {k: v for k, v in body.items() if k != "ignore_eos"}
    got = served.client.completions.create(model="tiny", **args, extra_body={"ignore_eos": True}, logprobs=0, stop=[stop], stream=stream,
                                           **({"stream_options": {"include_usage": True}} if stream else {}))
    chunks = list(got) if stream else [got]
    tokens = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens]
    text = "".join(ch.text for c in chunks for ch in c.choices)
    usage = chunks[-1].usage
    assert "".join(tokens) == text and stop not in text
    assert usage.completion_tokens == len(tokens)


def test_chat_logprobs_leave_out_the_end_of_turn_token(served):
    eos = served.engine.tokenizer.eos_token_ids
    token = sorted(eos)[0]
    r = served.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=8, temperature=0, logprobs=True,
                                              logit_bias={str(token): 100})  # it ends at once
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == ""
    assert choice.logprobs.content == [] and r.usage.completion_tokens == 0


def test_a_stalled_body_is_closed_after_the_body_timeout(model_dir):
    import json
    import socket

    from server_helpers import read_response

    from specbatch.kernels.models import load
    s = Served(new_engine(load(model_dir["llama"]), None, EngineConfig(speculation=False)), body_timeout=0.2)
    try:
        sock = socket.create_connection(("127.0.0.1", s.port), timeout=60)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\":")  # 11 of 100 bytes, then nothing
        status, body = read_response(sock)  # returns only because the server closes it
        assert status == 408 and json.loads(body)["error"]["code"] == "body_timeout"
    finally:
        s.close()


def test_health_and_metrics_show_the_waiting_prompt_tokens(model_dir):
    import json

    from server_helpers import Gate, raw_request, read_response, until

    from specbatch.kernels.models import load
    engine = new_engine(load(model_dir["llama"]), None, EngineConfig(speculation=False, max_batch=1))
    gate, s = Gate(engine), Served(engine)
    try:
        body = {"prompt": list(range(1, 41)), "max_tokens": 20, "ignore_eos": True}
        running = raw_request(s.port, "POST", "/v1/completions", json.dumps(body).encode())
        gate.run_to(1)
        waiting = raw_request(s.port, "POST", "/v1/completions", json.dumps(body).encode())
        until(lambda: engine.stats()["queue_depth"] == 1)
        health = httpx.get(f"{s.url}/health", timeout=30).json()
        assert health["queue_depth"] == 1 and health["queued_prompt_tokens"] == 40
        assert "specbatch_queued_prompt_tokens 40" in httpx.get(f"{s.url}/metrics", timeout=30).text
        gate.open()
        assert read_response(running)[0] == 200 and read_response(waiting)[0] == 200
    finally:
        gate.open()
        s.close()


def test_health_and_metrics_show_a_prompt_prefilling_whole(tiny):
    import json
    import threading

    from server_helpers import raw_request, read_response
    from test_metrics import Watched

    from specbatch.kernels.models import LoadedModel
    model = Watched()
    entered, release = threading.Event(), threading.Event()

    def park():  # the engine thread waits inside the prompt's prefill until the test has looked
        entered.set()
        assert release.wait(60)

    model.on_prefill = park
    target = LoadedModel(model, tiny.tokenizer, "fake-target", 4096)
    s = Served(new_engine(target, None, EngineConfig(speculation=False, prefill_chunk=8, prompt_cache_bytes=0)))
    try:
        body = {"prompt": list(range(3, 53)), "max_tokens": 4, "ignore_eos": True}
        sock = raw_request(s.port, "POST", "/v1/completions", json.dumps(body).encode())
        assert entered.wait(60)
        health = httpx.get(f"{s.url}/health", timeout=30).json()
        assert health["prefilling"] == 1 and health["admitting"] == 1 and health["admitting_prompt_tokens"] == 50
        assert health["queue_depth"] == 0 and health["width"] == 0
        text = httpx.get(f"{s.url}/metrics", timeout=30).text
        assert "specbatch_prefilling 1\n" in text and "specbatch_admitting_prompt_tokens 50\n" in text
        model.on_prefill = lambda: None
        release.set()
        assert read_response(sock)[0] == 200
        assert httpx.get(f"{s.url}/health", timeout=30).json()["admitting"] == 0
    finally:
        release.set()
        s.close()
