"""A step plan: what the engine thread decided before one step, and how a step carries it out.

The engine thread turns what callers did since the last step (arrivals, cancels, close)
into a ``Plan``; a ``PlanRunner`` applies it to the waiting list and runs the scheduler's
step. Everything the state machine decides is a pure function of the plans it was given
and the tokens its rounds produced, which is what lets follower ranks of a sharded target
replay the driver's plans and stay in the same state (see ``specbatch.serving.dist``).
"""

from __future__ import annotations

import collections
from typing import Callable, Protocol

import attrs
import structlog

from .request import Request
from .scheduler import Scheduler

log = structlog.get_logger(__name__)


@attrs.frozen
class Plan:
    arrivals: tuple[Request, ...] = ()
    cancels: tuple[str, ...] = ()  # request ids
    closing: bool = False  # stop once idle
    abandon: bool = False  # closing without drain: cancel everything now
    more_coming: bool = False  # callers queued more after this plan was cut


class Lockstep(Protocol):
    """Mirrors the engine's plans elsewhere (follower ranks of a sharded target)."""

    def publish(self, plan: Plan, fingerprint: str) -> None:
        """Called on the engine thread before ``plan`` is applied here."""
        ...

    def is_fatal(self, exc: BaseException) -> bool:
        """True for errors that end the engine (a lost peer), not just the round."""
        ...

    def close(self) -> None:
        """The engine thread has ended."""
        ...


def fingerprint(scheduler: Scheduler, waiting) -> str:
    """A cheap summary of scheduling state that two ranks in lock-step must agree on."""
    live = scheduler.requests()
    return (f"{scheduler.state}/w{len(live)}/q{len(waiting)}/"
            f"e{sum(r.emitted for r in live)}")


class PlanRunner:
    """Owns the waiting list and the live table on the engine thread (or a follower)."""

    def __init__(self, scheduler: Scheduler, book: Callable[[list[Request]], None],
                 fatal: Callable[[BaseException], bool] = lambda exc: False):
        self.scheduler = scheduler
        self.book = book  # closes out requests that left the engine
        self.fatal = fatal  # errors no rank can recover from (a lost peer): re-raised
        self.waiting: collections.deque[Request] = collections.deque()
        self.live: dict[str, Request] = {}

    @property
    def idle(self) -> bool:
        return not self.scheduler.busy and not self.waiting

    def apply(self, plan: Plan) -> bool:
        """Carry out ``plan`` and step if there is work; False once closed and idle."""
        for request in plan.arrivals:
            self.live[request.id] = request
            self.waiting.append(request)
        for rid in plan.cancels:
            self._cancel(rid)
        if plan.abandon:
            self.finish(list(self.waiting))
            self.waiting.clear()
            for request in self.scheduler.requests():
                request.cancel_requested = True
        if plan.closing and self.idle:
            return False
        if not self.idle:
            self.step(plan.more_coming)
        return True

    def _cancel(self, rid: str) -> None:
        request = self.live.get(rid)
        if request is None:
            return
        request.cancel_requested = True
        if request in self.waiting:
            self.waiting.remove(request)
            self.finish([request])

    def step(self, more_coming: bool) -> None:
        try:
            finished = self.scheduler.step(self.waiting, more_coming=more_coming)
        except Exception as exc:  # a failed round fails its own requests, not the engine
            if self.fatal(exc):
                raise
            log.exception("round_failed", error=str(exc))
            finished = self.scheduler.recover()
            for request in finished:
                request.abort("error", f"internal error: {exc}")
        self.finish(finished)

    def finish(self, finished: list[Request]) -> None:
        for request in finished:
            if not request.finished:
                request.abort("cancelled")
            self.live.pop(request.id, None)
        self.book(finished)

    def fail_all(self, error: str) -> list[Request]:
        """Every request still here ends with ``error`` (the engine cannot go on)."""
        failed = list(self.live.values())
        for request in failed:
            request.abort("error", error)
        self.waiting.clear()
        self.live.clear()
        return failed
