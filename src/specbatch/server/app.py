"""The OpenAI-compatible ASGI app (Starlette). Handlers never block the engine thread:
they submit, then await events through the engine's asyncio stream."""

from __future__ import annotations

import json
import time
import uuid

import structlog
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from ..errors import EngineClosed, InvalidRequest, QueueFull
from .metrics import render_metrics
from .guard import Guard, error_response
from .schemas import APIError, Parsed, load_json, parse_chat, parse_completion

log = structlog.get_logger(__name__)


class API:
    """The endpoints over one engine; handlers submit and await, never block it."""

    def __init__(self, engine, name: str, max_body: int):
        self.engine, self.name, self.max_body = engine, name, max_body
        self.created = int(time.time())

    async def read_json(self, request: Request):
        raw = await request.body()
        if len(raw) > self.max_body:
            raise APIError(413, f"request body over {self.max_body} bytes", None, "body_too_large")
        return load_json(raw)

    def prepare(self, parsed: Parsed):
        """Validate fully before any byte is sent: the model, the prompt, the queue."""
        if parsed.model is not None and parsed.model != self.name:
            raise APIError(404, f"model {parsed.model!r} not found; this server serves {self.name!r}",
                           "model", "model_not_found")
        try:
            return self.engine.prepare(parsed.prompt, parsed.params)
        except InvalidRequest as exc:
            raise APIError(400, exc.message, exc.param, exc.code or "invalid_value") from None
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), "prompt", "invalid_value") from None
        except QueueFull as exc:
            raise APIError(503, str(exc), None, "queue_full", "server_error", {"Retry-After": "1"}) from None
        except EngineClosed as exc:
            raise APIError(503, str(exc), None, "shutting_down", "server_error", {"Retry-After": "5"}) from None

    async def generate(self, request: Request, chat: bool):
        try:
            body = await self.read_json(request)
            parsed = parse_chat(body, self.engine.tokenizer) if chat else parse_completion(body)
            req = self.prepare(parsed)
        except APIError as err:
            return error_response(err)
        kind = "chat.completion" if chat else "text_completion"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        events = self.engine.stream_request(req)
        if parsed.stream:
            sse = _sse(events, rid, kind, self.name, self.created, chat, parsed.include_usage, req)
            return StreamingResponse(sse, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        text, finish, error = [], None, None
        async for event in events:
            text.append(event.text)
            finish, error = event.finish_reason, event.error
        if finish == "error":
            return error_response(APIError(500, error or "generation failed", None, "generation_failed", "server_error"))
        done = req.handle.result(0)  # complete before its last event was pushed: never blocks
        finish = "stop" if finish == "cancelled" else finish
        choice = ({"index": 0, "message": {"role": "assistant", "content": "".join(text)}, "finish_reason": finish}
                  if chat else {"index": 0, "text": "".join(text), "logprobs": None, "finish_reason": finish})
        return JSONResponse({"id": rid, "object": kind, "created": self.created, "model": self.name,
                             "choices": [choice], "usage": _usage(done), "system_fingerprint": f"seed-{done.seed}"})

    async def completions(self, request: Request):
        return await self.generate(request, chat=False)

    async def chat_completions(self, request: Request):
        return await self.generate(request, chat=True)

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [{"id": self.name, "object": "model",
                                                         "created": self.created, "owned_by": "specbatch"}]})

    async def health(self, request: Request):
        return JSONResponse({"status": "ok", "state": self.engine.stats()["state"]})

    async def metrics(self, request: Request):
        return PlainTextResponse(render_metrics(self.engine.stats()), media_type="text/plain; version=0.0.4")

    async def not_found(self, request: Request, exc):
        status = getattr(exc, "status_code", 404)
        return error_response(APIError(status, f"{request.method} {request.url.path}: {getattr(exc, 'detail', '')}",
                                       None, "not_found" if status == 404 else "method_not_allowed"))

    async def server_error(self, request: Request, exc):
        log.exception("handler_failed", path=request.url.path, error=str(exc))
        return error_response(APIError(500, "internal server error", None, "internal_error", "server_error"))


def create_app(engine, model_name: str | None = None, api_key: str | None = None,
               max_body: int = 1 << 20) -> Starlette:
    api = API(engine, model_name or engine.target.name.rstrip("/").split("/")[-1], max_body)
    routes = [Route("/v1/completions", api.completions, methods=["POST"]),
              Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
              Route("/v1/models", api.models), Route("/health", api.health), Route("/metrics", api.metrics)]
    return Starlette(routes=routes, middleware=[Middleware(Guard, api_key=api_key, max_body=max_body)],
                     exception_handlers={404: api.not_found, 405: api.not_found, Exception: api.server_error})


def _usage(done) -> dict:
    return {"prompt_tokens": done.usage.prompt_tokens, "completion_tokens": done.usage.completion_tokens,
            "total_tokens": done.usage.total_tokens}


async def _sse(events, rid, kind, name, created, chat, include_usage, req):
    chunk_kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta_text, finish):
        choice = ({"index": 0, "delta": {"content": delta_text} if delta_text or not finish else {},
                   "finish_reason": finish} if chat else
                  {"index": 0, "text": delta_text, "logprobs": None, "finish_reason": finish})
        return {"id": rid, "object": chunk_kind, "created": created, "model": name, "choices": [choice]}

    if chat:
        first = chunk("", None)
        first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        yield _data(first)
    async for event in events:
        if event.finish_reason == "error":
            yield _data(APIError(500, event.error or "generation failed", None, "generation_failed",
                                 "server_error").body())
            break
        finish = event.finish_reason
        if finish == "cancelled":
            break
        if event.text or finish:
            yield _data(chunk(event.text, finish))
    if include_usage:
        usage = _usage(req.handle.result(0))  # complete before its last event was pushed
        yield _data({"id": rid, "object": chunk_kind, "created": created, "model": name, "choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


def _data(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"

