"""Admission into a batch loop: prefix-cache hits and long prompts one by one, the rest in
left-padded groups of similar length. A failing group falls back to one by one, so one bad
request never takes down the others. The machine decides who joins; this decides how."""

from __future__ import annotations

import structlog

from ...runtime.output import RoundOutput
from ...runtime.request import Request
from .batch import BatchLoop

log = structlog.get_logger(__name__)

BATCH_PREFILL_CHUNKS = 16  # padded tokens per batched prefill, in prefill chunks: bounds its activations


def admit_each(loop: BatchLoop, requests: list[Request], prompt_cache=None, prefilled=None) -> RoundOutput:
    """Admit ``requests``; a request that fails or finishes at once is in ``out.done``.
    ``prefilled``: request id -> its chunked prefill so far (``loops.prefill.Partial``)."""
    out, fresh, prefilled = RoundOutput(), [], prefilled or {}
    for request in requests:
        if (p := prefilled.get(request.id)) is not None:
            out.merge(_admit_one(loop, request, p.cache, p.logits, p.hidden))
            continue
        cache, _ = prompt_cache.lookup(request.prompt) if prompt_cache else (None, 0)
        if cache is None and len(request.prompt) <= loop.target.prefill_chunk:
            fresh.append(request)
        else:
            out.merge(_admit_one(loop, request, cache))
    for group in _groups(fresh, BATCH_PREFILL_CHUNKS * loop.target.prefill_chunk):
        try:
            got = loop.admit_many(group) if len(group) > 1 else loop.admit(group[0])
        except Exception as exc:
            log.warning("group_admit_failed", requests=len(group), error=str(exc))
            out.merge(_fall_back(loop, group, exc))
            continue
        out.merge(got)
        out.done += [r for r in group if r.finished]
        for request in group:
            log.info("admit", request=request.id, prompt_tokens=len(request.prompt), width=loop.width)
    return out


def _fall_back(loop: BatchLoop, group: list[Request], exc: Exception) -> RoundOutput:
    """After a failed group prefill: admit alone whoever never started."""
    out = RoundOutput()
    joined = {id(r.request) for r in loop.rows}
    for request in group:
        if id(request) in joined or request.finished:
            out.done += [request] if request.finished else []
        elif request.emitted == 0:  # never started: admit it alone
            out.merge(_admit_one(loop, request, None))
        else:  # its first token went out but it never joined: it cannot go on
            request.abort("error", f"admission failed: {exc}")
            out.done.append(request)
    return out


def _groups(requests: list[Request], most: int) -> list[list[Request]]:
    """Similar lengths together (little padding), each within ``most`` padded tokens."""
    groups: list[list[Request]] = []
    for request in sorted(requests, key=lambda r: len(r.prompt)):
        group = groups[-1] if groups else None
        if group is None or len(request.prompt) * (len(group) + 1) > most:
            groups.append([request])
        else:
            group.append(request)
    return groups


def _admit_one(loop: BatchLoop, request: Request, cache, logits=None, hidden=None) -> RoundOutput:
    out = RoundOutput()
    try:
        out = loop.admit(request, cache=cache, logits=logits, hidden=hidden)
    except Exception as exc:  # one bad request never takes down the batch
        log.exception("admit_failed", request=request.id, error=str(exc))
        request.abort("error", f"admission failed: {exc}")
    log.info("admit", request=request.id, prompt_tokens=len(request.prompt), width=loop.width)
    out.done += [request] if request.finished else []
    return out
