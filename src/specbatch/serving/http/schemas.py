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
    echo: bool = False  # completions: the prompt's text before each completion's


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
    values = {name: _int(body, name, None, 1) for name in ("max_completion_tokens", "max_tokens")}  # both checked
    for name, value in values.items():  # the newer name wins, as OpenAI's
        if value is not None:
            return value, name
    return SamplingParams().max_tokens, None


ROLES = ("system", "user", "assistant", "tool")
MEDIA_PARTS = ("image_url", "input_audio", "image", "audio", "file", "input_image", "input_file")


# Fields other servers honour that would change the output here: refused unless they hold
# their no-op value (OpenAI's audio and search, vLLM's sampling and guided decoding).
NO_OP = {"modalities": (["text"],), "audio": (), "web_search_options": (), "reasoning_effort": (),
         "min_p": (0,), "repetition_penalty": (1,), "min_tokens": (0,), "guided_json": (), "guided_regex": (),
         "guided_choice": (), "guided_grammar": ()}


def _unsupported(body: dict, chat: bool) -> None:
    """Fields the engine cannot honour: a 400 naming them, never a silent 200."""
    def refuse(name: str, why: str):
        raise APIError(400, f"'{name}' is not supported by this server: {why}", name, "unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        refuse("response_format", "only {'type': 'text'} (no JSON mode or schemas)")
    for name in ("tools", "functions"):
        if body.get(name):
            refuse(name, "no tool or function calling")
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none"):
            refuse(name, "no tool or function calling (only 'none')")
    for name, harmless in NO_OP.items():
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or value not in harmless):
            refuse(name, "this engine does not implement it" + (f" (only {harmless[0]!r})" if harmless else ""))
    if body.get("stream_options") is not None and not body.get("stream"):
        refuse("stream_options", "it is only allowed with 'stream': true")
    if not chat and body.get("suffix") is not None:
        refuse("suffix", "no insertion")
    if not chat and body.get("best_of") not in (None, 1):
        refuse("best_of", "use 'n'")
    if not chat and body.get("echo") and body.get("logprobs") is not None:
        refuse("echo", "no prompt logprobs with 'echo'")


def _bias(body: dict) -> dict:
    return _typed(body, "logit_bias", dict, {})  # keys and values: SamplingParams checks them


def _sampling(body: dict, logprobs: int | None) -> tuple[SamplingParams, str | None]:
    max_tokens, max_param = _max_tokens(body)
    top_k = _int(body, "top_k", 0, -1, INT32_MAX)
    fields = dict(max_tokens=max_tokens, temperature=_float(body, "temperature", 1.0, 0.0),
                  top_p=_float(body, "top_p", 1.0, 0.0, 1.0), top_k=max(top_k, 0),  # -1: vLLM's "off"
                  seed=_int(body, "seed", None), stop=_typed(body, "stop", (str, list), ()),
                  ignore_eos=_typed(body, "ignore_eos", bool, False), logprobs=logprobs,
                  logit_bias=_bias(body),
                  presence_penalty=_float(body, "presence_penalty", 0.0, -2.0, 2.0),
                  frequency_penalty=_float(body, "frequency_penalty", 0.0, -2.0, 2.0))
    try:
        return SamplingParams(**fields), max_param
    except (TypeError, ValueError) as exc:
        param = next((f for f in fields if f in str(exc)), None)
        param = "logit_bias" if "logit_bias" in str(exc) else param
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


def _parsed(body: dict, prompt, logprobs: int | None, chat: bool = True) -> Parsed:
    _unsupported(body, chat)
    stream, include = _stream_options(body)
    params, max_param = _sampling(body, logprobs)
    n = _int(body, "n", 1, 1, MAX_N)
    echo = False if chat else _typed(body, "echo", bool, False)
    return Parsed(prompt, params, stream, include, _typed(body, "model", str), max_param, n, echo)


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
    return _parsed(body, prompt, _int(body, "logprobs", None, 0, MAX_LOGPROBS), chat=False)  # legacy: an integer N


def parse_chat(body, tokenizer) -> Parsed:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", None, "invalid_body")
    messages = _typed(body, "messages", list, required=True)
    if not messages:
        raise APIError(400, "'messages' must not be empty", "messages", "invalid_value")
    messages = [_message(m, i) for i, m in enumerate(messages)]
    try:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:
        raise APIError(400, f"could not apply the chat template: {exc}", "messages", "invalid_value") from None
    return _parsed(body, prompt, _chat_logprobs(body))


def _message(m, i: int) -> dict:
    """One chat turn as the template reads it: a known role, and its content as text
    (text parts joined; an assistant turn that only calls tools has empty content)."""
    param = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise APIError(400, f"{param} needs a string 'role'", param, "invalid_type")
    if m["role"] not in ROLES:
        raise APIError(400, f"{param}.role must be one of {', '.join(ROLES)}, got {m['role']!r}",
                       f"{param}.role", "invalid_value")
    content = m.get("content")
    if content is None and m["role"] == "assistant" and m.get("tool_calls"):
        content = ""
    elif isinstance(content, list):
        content = "".join(_text_part(part, f"{param}.content[{j}]") for j, part in enumerate(content))
    elif not isinstance(content, str):
        raise APIError(400, f"{param}.content must be a string or a list of text parts", f"{param}.content",
                       "invalid_type")
    _unicode(content, "messages")
    out = {"role": m["role"], "content": content}
    if m["role"] == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = m["tool_calls"]
    return out


def _text_part(part, param: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return part["text"]
    if kind in MEDIA_PARTS:
        raise APIError(400, f"{param}: content parts of type {kind!r} are not supported (text only)",
                       param, "unsupported_parameter")
    raise APIError(400, f"{param} must be {{'type': 'text', 'text': str}}, got type {kind!r}", param, "invalid_type")
