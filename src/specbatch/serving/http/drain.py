"""Live generation requests, why one stops early, and the shutdown drain.

A ``Watch`` is one live request's early stop: "disconnect" (its client went away) or
"shutdown" (the drain's grace ran out). Handlers race their work against it, so neither
a gone client nor a shutdown waits on the engine: the engine is told to cancel, and frees
the request's KV at its next round boundary.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from .schemas import APIError

log = structlog.get_logger(__name__)

CUT_WAIT_S = 5.0  # cut handlers end without the engine; this only bounds a stuck one


class Watch:
    """One live request's early stop; ``stopped`` resolves with the reason."""

    def __init__(self):
        self.stopped: asyncio.Future = asyncio.get_running_loop().create_future()

    def stop(self, reason: str) -> None:
        if not self.stopped.done():
            self.stopped.set_result(reason)

    @property
    def reason(self) -> str | None:
        return self.stopped.result() if self.stopped.done() else None

    async def listen(self, receive) -> None:
        """Stop when the client goes away: the ASGI server reports it as ``http.disconnect``
        once the body has been read."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.stop("disconnect")
                return


async def until_done_or_stopped(work, watch: Watch):
    """Run ``work`` (a coroutine) unless ``watch`` stops first; its result, or None if stopped."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, watch.stopped}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        return None
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class Drain:
    """The live generation requests of one app, and the shutdown that ends them."""

    def __init__(self):
        self.live: set[Watch] = set()
        self.draining = False
        self.cut = 0  # requests the drain ended before they finished
        self._idle = asyncio.Event()
        self._idle.set()

    def open(self) -> Watch:
        """Register a live request; once draining, new ones are refused with a 503."""
        if self.draining:
            raise APIError(503, "the server is shutting down", None, "shutting_down", "server_error",
                           {"Retry-After": "5"})
        watch = Watch()
        self.live.add(watch)
        self._idle.clear()
        return watch

    def close(self, watch: Watch) -> None:
        self.live.discard(watch)
        if not self.live:
            self._idle.set()

    async def finish(self, grace: float) -> int:
        """Refuse new requests, let live ones finish for up to ``grace`` seconds, then cut
        the rest (each ends with an error: SSE event or 503). Returns how many were cut."""
        self.draining = True
        log.info("drain_started", live=len(self.live), grace_s=grace)
        await self._wait_idle(grace)
        cut = list(self.live)
        for watch in cut:
            watch.stop("shutdown")
        if cut:
            await self._wait_idle(CUT_WAIT_S)
        self.cut += len(cut)
        log.info("drain_finished", cut=len(cut))
        return len(cut)

    async def _wait_idle(self, timeout: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), max(timeout, 0.0))
