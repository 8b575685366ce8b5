"""OpenAI request bodies -> (prompt, SamplingParams, options); errors in the OpenAI envelope.

Every value a client sends is checked here, before the engine sees it: a bad one is a 400
naming the parameter, never a 500 from deeper down (an out-of-range ``top_k`` once
reached ``mx.array`` as an int64 it could not cast).
"""

from __future__ import annotations

import json
import math

import attrs

from ...runtime.params import INT32_MAX, MAX_LOGPROBS, SamplingParams
from .fanout import MAX_N

INT64 = (-(1 << 63), (1 << 63) - 1)


class APIError(Exception):
    """An error the client sees as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@attrs.frozen
class Parsed:
    prompt: str | list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    model: str | None
    max_tokens_param: str | None  # the key the client set the budget with; None: the default
    n: int = 1  # completions of this prompt


def load_json(raw: bytes):
    """The body as JSON; nesting too deep or integers too long are a 400, not a crash."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise APIError(400, "malformed JSON: nested too deeply", None, "invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, and ints past Python's digit limit
        if "integer string conversion" not in str(exc):
            raise APIError(400, f"malformed JSON: {exc}", None, "invalid_json") from None
    # An integer of thousands of digits: stand in 2**64 (past any 64-bit range), so the range
    # check of whichever parameter holds it names that parameter.
    return json.loads(raw, parse_int=lambda s: int(s) if len(s) < 100 else (-1 if s[0] == "-" else 1) << 64)


def _typed(body: dict, name: str, types, default=None, required: bool = False):
    if name not in body or body[name] is None:
        if required:
            raise APIError(400, f"'{name}' is required", name, "missing_required_parameter")
        return default
    value = body[name]
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _tuple(types)):
        raise APIError(400, f"'{name}' has the wrong type: {type(value).__name__}", name, "invalid_type")
    return value


def _tuple(types):
    return types if isinstance(types, tuple) else (types,)


def _unicode(text: str, param: str) -> None:
    """JSON escapes can spell a lone surrogate, which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"'{param}' holds a lone surrogate (\\ud800-\\udfff): not valid Unicode text",
                       param, "invalid_value") from None


def _int(body: dict, name: str, default: int | None, lo: int = INT64[0], hi: int = INT64[1]) -> int | None:
    value = _typed(body, name, int, default)
    if value is not None and not lo <= value <= hi:
        raise APIError(400, f"'{name}' must be an integer in [{lo}, {hi}], got {value}", name, "invalid_value")
    return value


def _float(body: dict, name: str, default: float, lo: float, hi: float = math.inf) -> float:
    value = _typed(body, name, (int, float), default)
    try:
        number = float(value)
    except OverflowError:  # an int past float range
        number = math.inf
    if not (math.isfinite(number) and lo <= number <= hi):  # NaN fails every comparison: test it first
        bound = f"[{lo}, {hi}]" if math.isfinite(hi) else f">= {lo}"
        raise APIError(400, f"'{name}' must be a finite number {bound}, got {value}", name, "invalid_value")
    return value


def _max_tokens(body: dict) -> tuple[int, str | None]:
    for name in ("max_completion_tokens", "max_tokens"):  # the newer name wins, as OpenAI's
        value = _int(body, name, None, 1)
        if value is not None:
            return value, name
    return SamplingParams().max_tokens, None


def _sampling(body: dict, logprobs: int | None) -> tuple[SamplingParams, str | None]:
    max_tokens, max_param = _max_tokens(body)
    top_k = _int(body, "top_k", 0, -1, INT32_MAX)
    fields = dict(max_tokens=max_tokens, temperature=_float(body, "temperature", 1.0, 0.0),
                  top_p=_float(body, "top_p", 1.0, 0.0, 1.0), top_k=max(top_k, 0),  # -1: vLLM's "off"
                  seed=_int(body, "seed", None), stop=_typed(body, "stop", (str, list), ()),
                  ignore_eos=_typed(body, "ignore_eos", bool, False), logprobs=logprobs)
    try:
        return SamplingParams(**fields), max_param
    except (TypeError, ValueError) as exc:
        param = next((f for f in fields if f in str(exc)), None)
        raise APIError(400, str(exc), max_param if param == "max_tokens" else param, "invalid_value") from None


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = _typed(body, "stream", bool, False)
    options = _typed(body, "stream_options", dict, {})
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise APIError(400, "'stream_options.include_usage' must be a boolean", "stream_options", "invalid_type")
    return stream, include


def _chat_logprobs(body: dict) -> int | None:
    """Chat: ``logprobs: true`` turns them on, ``top_logprobs: N`` adds N alternatives."""
    want = _typed(body, "logprobs", bool, False)
    top = _int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not want:  # as OpenAI: alternatives without logprobs is a mistake
        raise APIError(400, "'top_logprobs' requires 'logprobs' to be true", "top_logprobs", "invalid_value")
    return (top or 0) if want else None


def _parsed(body: dict, prompt, logprobs: int | None) -> Parsed:
    stream, include = _stream_options(body)
    params, max_param = _sampling(body, logprobs)
    n = _int(body, "n", 1, 1, MAX_N)
    return Parsed(prompt, params, stream, include, _typed(body, "model", str), max_param, n)


def parse_completion(body) -> Parsed:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", None, "invalid_body")
    prompt = _typed(body, "prompt", (str, list), required=True)
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        elif not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise APIError(400, "'prompt' must be a string or a list of token ids", "prompt", "invalid_type")
    if not prompt:
        raise APIError(400, "'prompt' must not be empty", "prompt", "invalid_value")
    if isinstance(prompt, str):
        _unicode(prompt, "prompt")
    return _parsed(body, prompt, _int(body, "logprobs", None, 0, MAX_LOGPROBS))  # legacy: an integer N


def parse_chat(body, tokenizer) -> Parsed:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", None, "invalid_body")
    messages = _typed(body, "messages", list, required=True)
    if not messages:
        raise APIError(400, "'messages' must not be empty", "messages", "invalid_value")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise APIError(400, "each message needs a string 'role' and a string 'content'", "messages", "invalid_type")
        _unicode(m["role"] + m["content"], "messages")
    try:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:
        raise APIError(400, f"could not apply the chat template: {exc}", "messages", "invalid_value") from None
    return _parsed(body, prompt, _chat_logprobs(body))
