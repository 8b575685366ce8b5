"""Response bodies: the OpenAI objects a reply is made of, and the SSE stream that carries
them, which stops (and stops the engine's work) when its client leaves or the server cuts it."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Awaitable, Callable

import attrs
import structlog

from .drain import Watch, until_done_or_stopped
from .logprobs import LogprobFormat, Offsets
from .schemas import APIError

log = structlog.get_logger(__name__)

SHUTTING_DOWN = APIError(503, "the server shut down before this request finished", None, "shutting_down",
                         "server_error", {"Retry-After": "5"})


@attrs.frozen
class Reply:
    """What every object of one response shares."""

    id: str
    chat: bool
    model: str
    created: int  # unix seconds when this response began (every chunk of a stream shares it)
    fingerprint: str
    include_usage: bool = False
    logprobs: LogprobFormat | None = None  # None: the request did not ask
    echo: str = ""  # completions with ``echo``: the prompt's text, before each choice's

    def envelope(self, kind: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices, **extra}

    def format(self, entries: list) -> dict | None:
        """The choice's ``logprobs`` object for (TokenLogprob, text offset) ``entries``."""
        return self.logprobs(entries) if self.logprobs is not None else None

    def chunk(self, text: str, finish: str | None, index: int = 0, entries: list = ()) -> dict:
        if self.chat:
            choice = {"index": index, "delta": {"content": text} if text or not finish else {},
                      "logprobs": self.format(entries) if entries else None, "finish_reason": finish}
            return self.envelope("chat.completion.chunk", [choice])
        return self.envelope("text_completion", [{"index": index, "text": text,
                                                  "logprobs": self.format(entries) if entries else None,
                                                  "finish_reason": finish}])

    def whole(self, outcomes: list, usage: dict) -> dict:
        """``outcomes``: (text, finish_reason, logprob entries) per completion, in index order."""
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": text},
                        "logprobs": self.format(entries), "finish_reason": finish}
                       for i, (text, finish, entries) in enumerate(outcomes)]
            return self.envelope("chat.completion", choices, usage=usage)
        choices = [{"index": i, "text": self.echo + text, "logprobs": self.format(entries), "finish_reason": finish}
                   for i, (text, finish, entries) in enumerate(outcomes)]
        return self.envelope("text_completion", choices, usage=usage)


def usage_of(handles, dropped: list[int] | None = None) -> dict:
    """One prompt's tokens (the n completions share it) and every completion's tokens, less
    the ``dropped`` ones that produced no text before a stop (see ``Offsets``)."""
    done = [h.result(0) for h in handles]  # complete before their last events were pushed: never blocks
    prompt = done[0].usage.prompt_tokens
    completion = sum(d.usage.completion_tokens for d in done) - sum(dropped or ())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def data(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


DONE = "data: [DONE]\n\n"


async def sse(events, reply: Reply, handles: list) -> AsyncIterator[str]:
    """The engine's (index, event) pairs as SSE lines, ending with ``[DONE]`` (after an
    error event, too)."""
    if reply.chat:
        for i in range(len(handles)):
            first = reply.chunk("", None, i)
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            yield data(first)
    for i in range(len(handles) if reply.echo else 0):
        yield data(reply.chunk(reply.echo, None, i))
    offsets = Offsets(len(handles))
    async for i, event in events:
        if event.finish_reason == "error":
            yield data(APIError(500, event.error or "generation failed", None, "generation_failed",
                                "server_error").body())
            break
        if event.finish_reason == "cancelled":
            break
        entries = offsets.entry(i, event)
        entries = entries if reply.logprobs is not None else []
        if event.text or event.finish_reason or entries:  # a token with no text yet still has its logprob
            yield data(reply.chunk(event.text, event.finish_reason, i, entries))
    if reply.include_usage:
        kind = "chat.completion.chunk" if reply.chat else "text_completion"
        yield data(reply.envelope(kind, [], usage=usage_of(handles, offsets.dropped)))
    yield DONE


class EventStream:
    """An ASGI SSE response over ``lines`` that races them against ``watch``: a gone
    client stops it silently; a shutdown cut ends it with an error event and ``[DONE]``.
    ``on_close`` runs last whatever happened (it cancels the engine's work)."""

    def __init__(self, lines: AsyncIterator[str], watch: Watch, on_close: Callable[[], Awaitable[None]],
                 headers: dict | None = None):
        self.lines, self.watch, self.on_close = lines, watch, on_close
        self.headers = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache",
                        **(headers or {})}

    async def __call__(self, scope, receive, send) -> None:
        listener = asyncio.ensure_future(self.watch.listen(receive))
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(k.encode(), v.encode()) for k, v in self.headers.items()]})
            finished = await until_done_or_stopped(self._pump(send), self.watch)
            if finished is None and self.watch.reason == "shutdown":
                await self._body(send, data(SHUTTING_DOWN.body()) + DONE)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)
            await self.on_close()

    async def _pump(self, send) -> bool:
        try:
            async for line in self.lines:
                await self._body(send, line)
        finally:
            await self.lines.aclose()  # cancelled mid-send: close the generators now, not at GC
        return True

    @staticmethod
    async def _body(send, text: str) -> None:
        await send({"type": "http.response.body", "body": text.encode(), "more_body": True})
