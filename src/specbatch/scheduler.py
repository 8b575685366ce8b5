"""What the engine thread asks of a scheduler, and admission helpers the machine uses."""

from __future__ import annotations

import collections
from typing import Protocol

import structlog

from .loops.batch import BatchLoop
from .request import Request

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


def admit_each(loop: BatchLoop, requests: list[Request], prompt_cache=None) -> list[Request]:
    """Admit requests one by one (reusing cached prefixes); one that fails or finishes at
    once is returned."""
    done = []
    for request in requests:
        try:
            cache, _ = prompt_cache.lookup(request.prompt) if prompt_cache else (None, 0)
            loop.admit(request, cache=cache)
        except Exception as exc:  # one bad request never takes down the batch
            log.exception("admit_failed", request=request.id, error=str(exc))
            request.abort("error", f"admission failed: {exc}")
        if request.finished:
            done.append(request)
        log.info("admit", request=request.id, prompt_tokens=len(request.prompt), width=loop.width)
    return done


def take(waiting: collections.deque, n: int) -> list[Request]:
    return [waiting.popleft() for _ in range(min(n, len(waiting)))]


def build_scheduler(target, drafter, config, stats) -> Scheduler:
    from .machine import SpecMachine
    return SpecMachine(target, drafter, config, stats)
