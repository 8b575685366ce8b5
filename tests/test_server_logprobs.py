"""The server's two logprobs shapes (completions' legacy one, chat's), streamed and whole,
parsed by the official client; values equal the engine's with speculation off."""

from __future__ import annotations

import httpx
import pytest
from helpers import drive
from server_helpers import Served

from specbatch.runtime.config import EngineConfig
from specbatch.runtime.params import SamplingParams
from specbatch.kernels.build import new_core, new_engine

CHAT = [{"role": "user", "content": "x = 1"}]


@pytest.fixture(scope="module")
def served(model_dir):
    from specbatch.kernels.models import load
    tiny = load(model_dir["llama"])
    served = Served(new_engine(tiny, tiny, EngineConfig(num_draft_tokens=3, speculative_width_cap=2,
                                                    rearm_min_remaining=4)))
    yield served
    served.close()


def plain_logprobs(target, prompt: str, **params) -> list:
    with new_core(target, None, EngineConfig(speculation=False)) as core:
        run, (rid,) = drive(core, {0: [(prompt, SamplingParams(**params))]})
    return run.finals[rid].completion.logprobs


def test_completions_legacy_shape_equals_speculation_off(served, tiny):
    kw = dict(model="tiny", prompt="def f(x):", max_tokens=12, temperature=0.8, seed=7)
    whole = served.client.completions.create(logprobs=3, **kw)
    lp = whole.choices[0].logprobs
    ref = plain_logprobs(tiny, "def f(x):", max_tokens=12, temperature=0.8, seed=7, logprobs=3)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == whole.usage.completion_tokens
    assert max(abs(a - b.logprob) for a, b in zip(lp.token_logprobs, ref)) < 1e-4
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and top[token] == value  # the alternatives and the sampled token
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in served.client.completions.create(logprobs=3, stream=True, **kw):
        got = chunk.choices[0].logprobs if chunk.choices else None
        for key in streamed if got else ():
            streamed[key] += getattr(got, key)
    assert streamed == {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs, "text_offset": lp.text_offset}


def test_chat_shape_streamed_and_whole(served):
    kw = dict(model="tiny", messages=CHAT, max_tokens=10, temperature=0.0, logprobs=True, top_logprobs=2)
    whole = served.client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == item.top_logprobs[0].logprob  # greedy: the sampled token is the argmax
        raw = bytes(item.bytes)
        try:
            assert item.token == raw.decode("utf-8")
        except UnicodeDecodeError:  # a piece of a character: OpenAI's "bytes:" form
            assert item.token == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    streamed = []
    for chunk in served.client.chat.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    plain = served.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4)
    assert plain.choices[0].logprobs is None


def test_n_choices_each_carry_logprobs(served):
    many = served.client.completions.create(model="tiny", prompt="class A:", max_tokens=6, n=2, temperature=0.9,
                                            seed=3, logprobs=0)
    for choice in many.choices:
        assert len(choice.logprobs.token_logprobs) >= 1
        assert all(len(top) == 1 for top in choice.logprobs.top_logprobs)  # logprobs=0: the sampled token only


@pytest.mark.parametrize("path,body,param", [
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"logprobs": "3"}, "logprobs"),
    ("chat/completions", {"logprobs": "yes"}, "logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 1.5}, "top_logprobs"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
])
def test_bad_values_are_400_naming_the_param(served, path, body, param):
    base = {"prompt": "x"} if path == "completions" else {"messages": CHAT}
    r = httpx.post(f"{served.url}/v1/{path}", json={**base, "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
