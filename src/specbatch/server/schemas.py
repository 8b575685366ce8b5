"""OpenAI request bodies -> (prompt, SamplingParams, options); errors in the OpenAI envelope."""

from __future__ import annotations

import attrs

from ..sampling import SamplingParams


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


def _sampling(body: dict) -> SamplingParams:
    max_tokens = _typed(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = _typed(body, "max_tokens", int, 256)
    n = _typed(body, "n", int, 1)
    if n != 1:
        raise APIError(400, "only n = 1 is supported", "n", "unsupported_value")
    stop = _typed(body, "stop", (str, list), ())
    fields = dict(max_tokens=max_tokens, temperature=_typed(body, "temperature", (int, float), 1.0),
                  top_p=_typed(body, "top_p", (int, float), 1.0), top_k=_typed(body, "top_k", int, 0),
                  seed=_typed(body, "seed", int), stop=stop)
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as exc:
        param = next((f for f in fields if f in str(exc)), None)
        if param == "max_tokens" and "max_completion_tokens" in body:
            param = "max_completion_tokens"
        raise APIError(400, str(exc), param, "invalid_value") from None


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = _typed(body, "stream", bool, False)
    options = _typed(body, "stream_options", dict, {})
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise APIError(400, "'stream_options.include_usage' must be a boolean", "stream_options", "invalid_type")
    return stream, include


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
    stream, include = _stream_options(body)
    return Parsed(prompt, _sampling(body), stream, include, _typed(body, "model", str))


def parse_chat(body, tokenizer) -> Parsed:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", None, "invalid_body")
    messages = _typed(body, "messages", list, required=True)
    if not messages:
        raise APIError(400, "'messages' must not be empty", "messages", "invalid_value")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise APIError(400, "each message needs a string 'role' and a string 'content'", "messages", "invalid_type")
    try:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:
        raise APIError(400, f"could not apply the chat template: {exc}", "messages", "invalid_value") from None
    stream, include = _stream_options(body)
    return Parsed(prompt, _sampling(body), stream, include, _typed(body, "model", str))
