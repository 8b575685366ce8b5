"""What the engine thread asks of a scheduler, and admission helpers the machine uses."""

from __future__ import annotations

import collections
from typing import Protocol

import structlog

from .loops.batch import BatchLoop
from .request import Request
from .runner import PREFILL_CHUNK

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


BATCH_PREFILL_TOKENS = 2048  # padded tokens per batched prefill: bounds its activations


def admit_each(loop: BatchLoop, requests: list[Request], prompt_cache=None) -> list[Request]:
    """Admit ``requests``: those with a cached prefix (or a long prompt) one by one, the
    rest in left-padded groups of similar length. A request that fails or finishes at
    once is returned; a failing group falls back to one by one, so one bad request never
    takes down the others."""
    done, fresh = [], []
    for request in requests:
        cache, _ = prompt_cache.lookup(request.prompt) if prompt_cache else (None, 0)
        if cache is None and len(request.prompt) <= PREFILL_CHUNK:
            fresh.append(request)
        else:
            done += _admit_one(loop, request, cache)
    for group in _groups(fresh):
        try:
            loop.admit_many(group) if len(group) > 1 else loop.admit(group[0])
        except Exception as exc:
            log.warning("group_admit_failed", requests=len(group), error=str(exc))
            joined = {id(r.request) for r in loop.rows}
            for request in group:
                if id(request) in joined or request.finished:
                    done += [request] if request.finished else []
                elif request.emitted == 0:  # never started: admit it alone
                    done += _admit_one(loop, request, None)
                else:  # its first token went out but it never joined: it cannot go on
                    request.abort("error", f"admission failed: {exc}")
                    done.append(request)
            continue
        done += [r for r in group if r.finished]
        for request in group:
            log.info("admit", request=request.id, prompt_tokens=len(request.prompt), width=loop.width)
    return done


def _groups(requests: list[Request]) -> list[list[Request]]:
    """Similar lengths together (little padding), each within BATCH_PREFILL_TOKENS."""
    groups: list[list[Request]] = []
    for request in sorted(requests, key=lambda r: len(r.prompt)):
        group = groups[-1] if groups else None
        if group is None or len(request.prompt) * (len(group) + 1) > BATCH_PREFILL_TOKENS:
            groups.append([request])
        else:
            group.append(request)
    return groups


def _admit_one(loop: BatchLoop, request: Request, cache) -> list[Request]:
    try:
        loop.admit(request, cache=cache)
    except Exception as exc:  # one bad request never takes down the batch
        log.exception("admit_failed", request=request.id, error=str(exc))
        request.abort("error", f"admission failed: {exc}")
    log.info("admit", request=request.id, prompt_tokens=len(request.prompt), width=loop.width)
    return [request] if request.finished else []


def take(waiting: collections.deque, n: int) -> list[Request]:
    return [waiting.popleft() for _ in range(min(n, len(waiting)))]


def build_scheduler(target, drafter, config, stats) -> Scheduler:
    from .machine import SpecMachine
    return SpecMachine(target, drafter, config, stats)
