"""What the engine thread asks of a scheduler, and the plain (no-drafter) scheduler."""

from __future__ import annotations

import collections
from typing import Protocol

import structlog

from .loops.batch import BatchLoop
from .request import Request
from .runner import ModelRunner

log = structlog.get_logger(__name__)


class Scheduler(Protocol):
    @property
    def busy(self) -> bool: ...

    def step(self, waiting: collections.deque, more_coming: bool) -> list[Request]:
        """Admit from ``waiting`` as policy allows, run one round; return removed requests."""
        ...

    def recover(self) -> list[Request]:
        """After a failed round: drop all rows; return their requests."""
        ...

    def requests(self) -> list[Request]: ...

    def gauges(self) -> dict: ...

    def shutdown(self) -> None: ...


def admit_each(loop: BatchLoop, requests: list[Request], **kw) -> list[Request]:
    """Admit requests one by one; one that fails (or finishes at once) is returned."""
    done = []
    for request in requests:
        try:
            loop.admit(request, **kw)
        except Exception as exc:  # one bad request never takes down the batch
            log.exception("admit_failed", request=request.id, error=str(exc))
            request.abort("error", f"admission failed: {exc}")
        if request.finished:
            done.append(request)
        log.info("admit", request=request.id, prompt_tokens=len(request.prompt), width=loop.width)
    return done


def take(waiting: collections.deque, n: int) -> list[Request]:
    return [waiting.popleft() for _ in range(min(n, len(waiting)))]


class PlainScheduler:
    """Continuous batching without speculation: every round is a plain round."""

    def __init__(self, target, config, stats):
        self.loop = BatchLoop(ModelRunner(target.model) if hasattr(target, "model") else target)
        self.config = config
        self.stats = stats

    @property
    def busy(self) -> bool:
        return self.loop.width > 0

    def step(self, waiting, more_coming):
        loop, done = self.loop, []
        boundary = waiting or any(r.request.finished or r.request.cancel_requested for r in loop.rows)
        if boundary:
            loop.settle()
            done += loop.reap()
            done += admit_each(loop, take(waiting, self.config.max_batch - loop.width))
        if loop.width:
            loop.plain_round(successor=not (more_coming or waiting))
            self.stats.rounds += 1
        if loop.settled:
            done += loop.reap()
        return done

    def recover(self):
        return self.loop.fail_all()

    def requests(self):
        return [r.request for r in self.loop.rows]

    def gauges(self):
        return {"state": "Gated" if self.loop.width else "Idle", "width": self.loop.width,
                "kv_bytes": self.loop.kv.nbytes, "kv_used_bytes": self.loop.kv.used_bytes()}

    def shutdown(self):
        self.loop.fail_all()


def build_scheduler(target, drafter, config, stats) -> Scheduler:
    return PlainScheduler(target, config, stats)
