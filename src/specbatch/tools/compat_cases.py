"""The cases :mod:`specbatch.tools.compat` runs: each request's exact bytes and what the
server must answer (status, and for a 4xx the ``param`` and ``code`` it names), then the
official ``openai`` client's calls, each checked for text == joined logprob tokens and
consistent usage."""

from __future__ import annotations

import json

import attrs

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]


@attrs.frozen
class Case:
    name: str
    method: str
    path: str
    body: bytes
    status: int
    param: str | None = None
    code: str | None = None
    headers: tuple = ()


def _body(path: str, raw: dict) -> bytes:
    base = {"prompt": "Hi"} if path == COMPLETIONS else {"messages": USER}
    return json.dumps({**base, "max_tokens": 2, **raw}).encode()


def _spliced(path: str, field: str, text: str) -> bytes:
    """A valid body with ``field`` set to ``text`` verbatim (NaN, 1e400, 5,000 digits)."""
    return _body(path, {})[:-1] + f', "{field}": {text}}}'.encode()


BAD_VALUES = {  # field: values each endpoint must refuse naming the field (JSON text, verbatim)
    "max_tokens": ["0", "-1", '"9"', "1.5", "true", str(2 ** 64), "9" * 400, "100000"],
    "max_completion_tokens": ["0", "-3", '"x"', "[]"],
    "temperature": ["-1", "NaN", "Infinity", "-Infinity", "1e400", '"hot"', "true", "[1]"],
    "top_p": ["0", "1.5", "-0.1", "NaN", '"x"'],
    "top_k": ["-2", "1.5", str(2 ** 31), '"x"'],
    "seed": ["1.5", '"x"', str(2 ** 64), str(-(2 ** 63) - 1)],
    "n": ["0", "17", "1.5", '"2"', str(2 ** 64)],
    "stop": ["[1]", '""', "{}", "5", '[""]'],
    "stream": ['"yes"', "1"],
    "stream_options": ['{"include_usage": 1}', "[]"],
    "logit_bias": ['{"42": 1000}', '{"abc": 1}', "[1]", '{"42": "x"}', '{"-1": 5}', '{"99999999": 5}',
                   '{"42": NaN}', json.dumps({str(i): 1 for i in range(301)})],
    "presence_penalty": ["5", "-3", '"high"', "NaN"],
    "frequency_penalty": ["2.5", '"x"', "Infinity"],
    "model": ["5", "[]"],
    "ignore_eos": ["1", '"yes"'],
}
COMPLETION_BAD = {"logprobs": ["-1", "21", "true", '"x"'], "echo": ['"yes"', "1"],
                  "prompt": ["5", "[]", '""', f"[{2 ** 70}]", "[1, -1]", "[true]", "[[1, 2]]", "null",
                             r'"\udfff"', "[99999999]"]}
CHAT_BAD = {"logprobs": ["5", '"x"'], "top_logprobs": ["21", "-1", "1.5"]}
UNSUPPORTED = {  # field: values naming it with code unsupported_parameter (on both endpoints)
    "response_format": ['{"type": "json_object"}', '"json"', '{"type": "json_schema", "json_schema": {}}'],
    "tools": ['[{"type": "function", "function": {"name": "f"}}]', '"x"'],
    "tool_choice": ['"auto"', '"required"', '{"type": "function", "function": {"name": "f"}}'],
    "functions": ['[{"name": "f"}]'],
    "function_call": ['"auto"'],
    "modalities": ['["text", "audio"]'],
    "audio": ['{"voice": "alloy", "format": "wav"}'],
    "web_search_options": ["{}"],
    "reasoning_effort": ['"high"'],
    "min_p": ["0.1"],
    "repetition_penalty": ["1.3"],
    "min_tokens": ["5"],
    "guided_json": ['{"type": "object"}'],
    "guided_regex": ['"[a-z]+"'],
    "guided_choice": ['["yes", "no"]'],
}
HARMLESS = {  # values of those fields that change nothing: a 200
    "response_format": '{"type": "text"}', "tool_choice": '"none"', "tools": "[]", "modalities": '["text"]',
    "min_p": "0", "repetition_penalty": "1.0", "min_tokens": "0", "user": '"alice"', "metadata": '{"k": "v"}',
    "store": "false", "service_tier": '"auto"', "parallel_tool_calls": "true", "logit_bias": '{"42": -100}',
    "presence_penalty": "1.5", "frequency_penalty": "-1", "max_tokens": "null", "top_k": "-1", "stop": '["."]',
    "seed": str(2 ** 63 - 1), "temperature": "5",
}


def value_cases() -> list[Case]:
    out = []
    for path, extra in [(COMPLETIONS, COMPLETION_BAD), (CHAT, CHAT_BAD)]:
        for field, values in {**BAD_VALUES, **extra}.items():
            for text in values:
                status = 404 if field == "model" and text.startswith('"') else 400
                out.append(Case(f"{path} {field}={text[:40]}", "POST", path, _spliced(path, field, text), status,
                                field))
    out.append(Case("both max-token names, one bad", "POST", COMPLETIONS,
                    _body(COMPLETIONS, {"max_tokens": -1, "max_completion_tokens": 5}), 400, "max_tokens"))
    out.append(Case("stream_options without stream", "POST", CHAT,
                    _body(CHAT, {"stream_options": {"include_usage": True}}), 400, "stream_options",
                    "unsupported_parameter"))
    out.append(Case("unknown model", "POST", CHAT, _body(CHAT, {"model": "gpt-9"}), 404, "model", "model_not_found"))
    return out


def unsupported_cases() -> list[Case]:
    out = []
    for path in (COMPLETIONS, CHAT):
        for field, values in UNSUPPORTED.items():
            out += [Case(f"{path} {field}={t[:40]}", "POST", path, _spliced(path, field, t), 400, field,
                         "unsupported_parameter") for t in values]
        out += [Case(f"{path} harmless {field}={t}", "POST", path, _spliced(path, field, t), 200)
                for field, t in HARMLESS.items()]
    for field, text in [("suffix", '"x"'), ("best_of", "2")]:
        out.append(Case(f"completions {field}", "POST", COMPLETIONS, _spliced(COMPLETIONS, field, text), 400, field,
                        "unsupported_parameter"))
    out.append(Case("echo with logprobs", "POST", COMPLETIONS, _body(COMPLETIONS, {"echo": True, "logprobs": 1}),
                    400, "echo", "unsupported_parameter"))
    out.append(Case("echo", "POST", COMPLETIONS, _body(COMPLETIONS, {"echo": True}), 200))
    return out


def message_cases() -> list[Case]:
    bad = [  # messages, param
        ([], "messages"), ("hi", "messages"), ([5], "messages[0]"), ([{"content": "x"}], "messages[0]"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"), ([{"role": "", "content": "x"}], "messages[0].role"),
        ([{"role": "user\u0000", "content": "x"}], "messages[0].role"), ([{"role": 5, "content": "x"}], "messages[0]"),
        ([{"role": "user"}], "messages[0].content"), ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": {"text": "x"}}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0]"),
        ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "messages[0].content[0]"),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0]"),
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0]"),
        ([{"role": "user", "content": ["x"]}], "messages[0].content[0]"),
        ([{"role": "assistant", "content": None}], "messages[0].content"),
        ([{"role": "user", "content": "x"}, {"role": "user", "content": None}], "messages[1].content"),
    ]
    out = [Case(f"messages={json.dumps(m)[:50]}", "POST", CHAT, json.dumps({"messages": m, "max_tokens": 2}).encode(),
                400, p) for m, p in bad]
    good = [
        [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "What is 2+2?"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "4"}],
        [{"role": "user", "content": ""}],
    ]
    out += [Case(f"valid messages {i}", "POST", CHAT, json.dumps({"messages": m, "max_tokens": 2}).encode(), 200)
            for i, m in enumerate(good)]
    return out


def body_cases() -> list[Case]:
    bodies = [b"{not json", b"[1, 2]", b"", b'\xff\xfe{"prompt": "x"}', b"[" * 2000 + b"]" * 2000, b"null", b'"x"',
              b'{"prompt": ' + b"[" * 2000 + b"]" * 2000 + b"}", b"{}", b'{"prompt": "x"' + b" " * 10]
    out = [Case(f"body {b[:20]!r}", "POST", p, b, 400) for p in (COMPLETIONS, CHAT) for b in bodies]
    out.append(Case("body over the limit", "POST", COMPLETIONS, b'{"prompt": "' + b"x" * (1 << 20) + b'"}', 413))
    out += [Case("route GET /nope", "GET", "/nope", b"", 404), Case("route DELETE", "DELETE", COMPLETIONS, b"", 405),
            Case("route GET completions", "GET", COMPLETIONS, b"", 405),
            Case("unknown model id", "GET", "/v1/models/gpt-9", b"", 404, "model", "model_not_found"),
            Case("model id", "GET", "/v1/models/tiny", b"", 200), Case("models", "GET", "/v1/models", b"", 200),
            Case("health", "GET", "/health", b"", 200), Case("metrics", "GET", "/metrics", b"", 200)]
    for method, path in [("GET", "/health"), ("POST", COMPLETIONS), ("POST", CHAT), ("GET", "/v1/models")]:
        body = _body(path, {}) if method == "POST" else b""
        out.append(Case(f"bad header bytes {path}", method, path, body, 400, "x-junk", "invalid_header",
                        headers=(b"X-Junk: caf\xe9 \xff",)))
    out += [Case("plain completion", "POST", COMPLETIONS, _body(COMPLETIONS, {"temperature": 0}), 200),
            Case("stream completion", "POST", COMPLETIONS, _body(COMPLETIONS, {"stream": True}), 200),
            Case("stream chat with usage", "POST", CHAT,
                 _body(CHAT, {"stream": True, "stream_options": {"include_usage": True}}), 200),
            Case("n=3", "POST", COMPLETIONS, _body(COMPLETIONS, {"n": 3}), 200),
            Case("token-id prompt", "POST", COMPLETIONS, _body(COMPLETIONS, {"prompt": [1, 2, 3]}), 200)]
    return out


def matrix() -> list[Case]:
    return value_cases() + unsupported_cases() + message_cases() + body_cases()


def _text_choice(c, usage_tokens=None) -> tuple[bool, str]:
    joined = "".join(c.logprobs.tokens)
    ok = c.text == joined and (usage_tokens is None or usage_tokens == len(c.logprobs.tokens))
    return ok, f"{c.text!r} vs {joined!r}"


def _chat_choice(c, usage_tokens=None) -> tuple[bool, str]:
    joined = "".join(t.token for t in c.logprobs.content)
    ok = c.message.content == joined and (usage_tokens is None or usage_tokens == len(c.logprobs.content))
    return ok, f"{c.message.content!r} vs {joined!r}"


def _completions(client):
    r = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=8, temperature=0,
                                  logprobs=2)
    ok, detail = _text_choice(r.choices[0], r.usage.completion_tokens)
    return ok and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, detail


def _chat(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say hi."}],
                                       max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    ok, detail = _chat_choice(r.choices[0], r.usage.completion_tokens)
    return ok and all(len(t.top_logprobs) == 2 for t in r.choices[0].logprobs.content), detail


def _streaming(client):
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Count to five."}], max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True}, logprobs=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    tokens = [t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    usage = chunks[-1].usage
    ok = text == "".join(tokens) and usage is not None and usage.completion_tokens == len(tokens)
    return ok, f"{text!r} vs {''.join(tokens)!r}, usage {usage and usage.completion_tokens}"


def _n(client):
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0.8, n=3,
                                  seed=5, logprobs=1)
    total = sum(len(c.logprobs.tokens) for c in r.choices)
    ok = sorted(c.index for c in r.choices) == [0, 1, 2] and all(_text_choice(c)[0] for c in r.choices)
    return ok and r.usage.completion_tokens == total, f"{[c.text for c in r.choices]}, usage {r.usage.completion_tokens}"


def _logprobs_stream(client):
    chunks = list(client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=10, temperature=0,
                                            stream=True, logprobs=1, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    return text == "".join(tokens) and chunks[-1].usage.completion_tokens == len(tokens), repr(text)


def _stop(client):
    r = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=16, temperature=0,
                                  stop=["."], logprobs=1)
    ok, detail = _text_choice(r.choices[0], r.usage.completion_tokens)
    return ok and "." not in r.choices[0].text, f"{detail} ({r.choices[0].finish_reason})"


def _seed(client):
    ask = dict(model="tiny", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=12,
               temperature=0.9, seed=1234, logprobs=True)
    a, b = client.chat.completions.create(**ask), client.chat.completions.create(**ask)
    ok = a.choices[0].message.content == b.choices[0].message.content and _chat_choice(a.choices[0])[0]
    return ok and a.system_fingerprint == b.system_fingerprint, repr(a.choices[0].message.content)


def _retrieve(client):
    model = client.models.retrieve("tiny")
    return model.id == "tiny", model.id


CLIENT_CHECKS = {"completions": _completions, "chat": _chat, "streaming": _streaming, "n": _n,
                 "logprobs (stream)": _logprobs_stream, "stop": _stop, "seed": _seed, "models.retrieve": _retrieve}


def client_checks(base_url: str) -> list[tuple[str, bool, str]]:
    """The official client's calls (completions, chat, streaming, n, logprobs, stop, seed,
    models.retrieve): each parses, and its text is its logprob tokens joined, its usage
    the count of them."""
    import openai
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=300)
    out = []
    for name, check in CLIENT_CHECKS.items():
        try:
            ok, detail = check(client)
        except Exception as exc:  # a raise is a call that did not parse
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        out.append((name, bool(ok), detail))
    return out
