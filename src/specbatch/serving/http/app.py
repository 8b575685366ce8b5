"""The OpenAI-compatible ASGI app (Starlette). Handlers never block the engine thread:
they submit, then await events through the engine's asyncio stream, racing them against
the request's ``Watch`` (its client leaving, or the shutdown drain cutting it)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid

import attrs
import structlog
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from ...errors import EngineClosed, InvalidRequest, QueueFull
from .drain import Drain, until_done_or_stopped
from .fanout import merge, siblings
from .guard import Guard, error_response
from .logprobs import LogprobFormat, Offsets
from .metrics import render_metrics
from .schemas import APIError, Parsed, load_json, parse_chat, parse_completion
from .stream import SHUTTING_DOWN, EventStream, Reply, sse, usage_of

log = structlog.get_logger(__name__)


def fingerprint(engine) -> str:
    """``system_fingerprint``: the same for the same model pair and engine configuration, so
    a client can tell when a seeded request may decode differently."""
    drafter = engine.drafter
    pair = {"target": engine.target.name, "drafter": getattr(drafter, "name", type(drafter).__name__),
            "config": attrs.asdict(engine.config)}
    return "fp_" + hashlib.sha256(json.dumps(pair, sort_keys=True, default=str).encode()).hexdigest()[:12]


class API:
    """The endpoints over one engine; handlers submit and await, never block it."""

    def __init__(self, engine, name: str, max_body: int, body_timeout: float = 60.0):
        self.engine, self.name, self.max_body, self.body_timeout = engine, name, max_body, body_timeout
        path = str(engine.target.name)
        self.names = {name, path, path.rstrip("/")}  # the served name and the model's path
        self.created = int(time.time())  # the model's "created" in /v1/models: when it was loaded
        self.fingerprint = fingerprint(engine)
        self.drain = Drain()

    async def read_json(self, request: Request):
        try:
            raw = await asyncio.wait_for(request.body(), self.body_timeout)
        except asyncio.TimeoutError:
            log.info("body_read_timeout", path=request.url.path, timeout_s=self.body_timeout)
            raise APIError(408, f"the request body did not arrive within {self.body_timeout:g} s", None,
                           "body_timeout", headers={"Connection": "close"}) from None
        except ClientDisconnect:
            log.info("client_disconnected", path=request.url.path, during="body")
            raise APIError(499, "the client left before its body arrived", None, "client_disconnected") from None
        if len(raw) > self.max_body:
            raise APIError(413, f"request body over {self.max_body} bytes", None, "body_too_large")
        return load_json(raw)

    def prepare(self, parsed: Parsed) -> list:
        """Validate fully before any byte is sent: the model, the prompt, the budget, the queue.
        One engine request per completion (``n``), each with its derived seed."""
        if parsed.model is not None and parsed.model not in self.names:
            raise APIError(404, f"The model {parsed.model!r} does not exist; this server serves {self.name!r}",
                           "model", "model_not_found")
        try:
            first = self.engine.prepare(parsed.prompt, parsed.params)  # gives it a seed if it had none
            reqs = [first] + [self.engine.prepare(first.prompt, p, pending=i + 1)  # n counts n against the queue
                              for i, p in enumerate(siblings(first.params, parsed.n)[1:])]
        except InvalidRequest as exc:
            raise APIError(400, exc.message, exc.param, exc.code or "invalid_value") from None
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), "prompt", "invalid_value") from None
        except QueueFull as exc:
            raise APIError(503, str(exc), None, "queue_full", "server_error", {"Retry-After": "1"}) from None
        except EngineClosed as exc:
            raise APIError(503, str(exc), None, "shutting_down", "server_error", {"Retry-After": "5"}) from None
        self.check_room(parsed, first)
        return reqs

    def echo_text(self, parsed: Parsed) -> str:
        if not parsed.echo:
            return ""
        prompt = parsed.prompt
        return prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(prompt)

    def check_room(self, parsed: Parsed, req) -> None:
        """An explicit budget past the context is a 400 stating the room, as vLLM answers (the
        engine clamps it; the default budget is still clamped quietly)."""
        asked = parsed.params.max_tokens
        if parsed.max_tokens_param is None or req.params.max_tokens >= asked:
            return
        context, prompt = self.engine.context_length, len(req.prompt)  # --max-model-len where shorter
        raise APIError(400, f"'{parsed.max_tokens_param}' is too large: {asked}. The maximum context length "
                            f"is {context} tokens and your request has {prompt} input tokens, which "
                            f"leaves room for {context - prompt} ({asked} > {context} - {prompt})",
                       parsed.max_tokens_param, "context_length_exceeded")

    async def generate(self, request: Request, chat: bool):
        try:
            body = await self.read_json(request)
            parsed = parse_chat(body, self.engine.tokenizer) if chat else parse_completion(body)
            reqs = self.prepare(parsed)
            watch = self.drain.open()
        except APIError as err:
            return error_response(err)
        wants = parsed.params.logprobs is not None
        reply = Reply(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", chat, self.name, int(time.time()),
                      self.fingerprint, parsed.include_usage,
                      LogprobFormat(self.engine.tokenizer, chat) if wants else None, self.echo_text(parsed))
        streams = self.engine.stream_requests(reqs)  # one arrival: prefilled and decoded together
        handles = [self.engine.handle(r) for r in reqs]
        events = merge(streams)

        async def close():  # whatever ended the response: the engine stops its work, the drain forgets it
            await events.aclose()
            for stream in streams:
                await stream.aclose()
            for req, handle in zip(reqs, handles):
                if not handle.done:
                    self.engine.cancel(handle)
                    log.info("request_abandoned", request=req.id, reason=watch.reason or "handler_ended")
            self.drain.close(watch)

        # replays an unseeded request exactly (one seed per completion)
        headers = {"x-request-seed": ",".join(str(r.params.seed) for r in reqs)}
        if parsed.stream:
            return EventStream(sse(events, reply, handles), watch, close, headers)
        listener = asyncio.ensure_future(watch.listen(request.receive))
        offsets = Offsets(len(reqs))
        try:
            outcome = await until_done_or_stopped(_collect(events, offsets), watch)
        finally:
            listener.cancel()
            await close()
        return self.whole(reply, handles, outcome, watch.reason, headers, offsets.dropped)

    def whole(self, reply: Reply, handles: list, outcome, stopped: str | None, headers: dict,
              dropped: list[int]) -> Response:
        if outcome is None:  # cut by the drain, or nobody is left to read it
            return error_response(SHUTTING_DOWN) if stopped == "shutdown" else Response(status_code=499)
        failed = [error for _, finish, error, _ in outcome if finish == "error"]
        if failed:
            return error_response(APIError(500, failed[0] or "generation failed", None, "generation_failed",
                                           "server_error"))
        choices = [(text, "stop" if finish == "cancelled" else finish, entries) for text, finish, _, entries in outcome]
        return JSONResponse(reply.whole(choices, usage_of(handles, dropped)), headers=headers)

    async def completions(self, request: Request):
        return await self.generate(request, chat=False)

    async def chat_completions(self, request: Request):
        return await self.generate(request, chat=True)

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [{"id": self.name, "object": "model",
                                                         "created": self.created, "owned_by": "specbatch"}]})

    async def model(self, request: Request):
        name = request.path_params["model"]
        if name not in self.names:
            raise_404 = APIError(404, f"The model {name!r} does not exist; this server serves {self.name!r}",
                                 "model", "model_not_found")
            return error_response(raise_404)
        return JSONResponse({"id": name, "object": "model", "created": self.created, "owned_by": "specbatch"})

    async def health(self, request: Request):
        stats = self.engine.stats()
        keys = ("state", "width", "queue_depth", "queued_prompt_tokens", "prefilling", "prefill_tokens", "admitting",
                "admitting_prompt_tokens")
        return JSONResponse({"status": "ok", **{k: stats.get(k, 0) for k in keys}})

    async def metrics(self, request: Request):
        return PlainTextResponse(render_metrics(self.engine.stats()), media_type="text/plain; version=0.0.4")

    async def not_found(self, request: Request, exc):
        status = getattr(exc, "status_code", 404)
        return error_response(APIError(status, f"{request.method} {request.url.path}: {getattr(exc, 'detail', '')}",
                                       None, "not_found" if status == 404 else "method_not_allowed"))

    async def server_error(self, request: Request, exc):
        log.exception("handler_failed", path=request.url.path, error=str(exc))
        return error_response(APIError(500, "internal server error", None, "internal_error", "server_error"))


async def _collect(events, offsets: Offsets) -> list[tuple[str, str | None, str | None, list]]:
    """(text, finish_reason, error, logprob entries) per completion, from the merged
    (index, event) stream; entries are (TokenLogprob, text offset), empty when not asked."""
    n = len(offsets.at)
    texts, ends, entries = [[] for _ in range(n)], [(None, None)] * n, [[] for _ in range(n)]
    async for i, event in events:
        entries[i] += offsets.entry(i, event)
        texts[i].append(event.text)
        ends[i] = (event.finish_reason, event.error)
    return [("".join(t), *end, e) for t, end, e in zip(texts, ends, entries)]


def create_app(engine, model_name: str | None = None, api_key: str | None = None,
               max_body: int = 1 << 20, body_timeout: float = 60.0) -> Starlette:
    """The app; ``app.state.drain`` is its live requests (``serve`` drains them on SIGTERM)."""
    api = API(engine, model_name or engine.target.name.rstrip("/").split("/")[-1], max_body, body_timeout)
    routes = [Route("/v1/completions", api.completions, methods=["POST"]),
              Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
              Route("/v1/models", api.models), Route("/v1/models/{model:path}", api.model),
              Route("/health", api.health), Route("/metrics", api.metrics)]
    app = Starlette(routes=routes, middleware=[Middleware(Guard, api_key=api_key, max_body=max_body)],
                    exception_handlers={404: api.not_found, 405: api.not_found, Exception: api.server_error})
    app.state.drain = api.drain
    return app
