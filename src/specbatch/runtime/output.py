"""What a round produced, and the core's output stage that turns it into events.

Loops return a ``RoundOutput``: per row, the token ids the round recorded (each with its
text, already cut at a stop string by ``Request.append``) and whether one ended the
request, plus a verify round's ``RoundResult``. ``Delivery`` (owned by the core) then, in
this order: records the statistics and closes finished requests (their ``Completion``,
then the final event). Closing after the statistics is what puts a row's last verify
round in its completion. A step's events leave through ``take_events`` as one
``StepEvent`` per request: the core returns them, and only ``Engine`` hands them to handles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from .params import TokenLogprob
from .request import Completion, TokenEvent

if TYPE_CHECKING:
    from .request import Request
    from .stats import EngineStats


@attrs.frozen
class StepEvent:
    """What one request produced in one step: its new tokens and their text; the last
    event of a request carries ``finish_reason`` (and ``error``, ``completion``)."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error: str | None = None
    completion: Completion | None = None  # the whole result, on the last event only
    logprobs: list[TokenLogprob] | None = None  # per token of token_ids, when the request asked
    events: tuple[TokenEvent, ...] = ()  # per token (and a final one without a token): what a handle streams

    @classmethod
    def of(cls, events: list[TokenEvent], completion: Completion | None) -> "StepEvent":
        last = events[-1]
        lps = [e.logprob for e in events if e.logprob is not None]
        return cls(last.request_id, [e.token for e in events if e.token is not None],
                   "".join(e.text for e in events), last.finish_reason, last.error,
                   completion if last.finish_reason is not None else None, lps or None, tuple(events))


@attrs.define(eq=False)
class RowOutput:
    request: Request
    tokens: list[int] = attrs.field(factory=list)  # recorded this call, in order
    texts: list[str] = attrs.field(factory=list)  # parallel to tokens: each one's text
    logprobs: list = attrs.field(factory=list)  # parallel to tokens: TokenLogprob, or None (not asked)
    finished: bool = False  # one of them ended the request


@attrs.define
class RoundOutput:
    """What one loop call produced (a round, a settle, an admission, a rebuild)."""

    rows: dict[str, RowOutput] = attrs.field(factory=dict)  # request id -> its output, first seen first
    verify: object | None = None  # a verify round's RoundResult, for statistics
    verified: list = attrs.field(factory=list)  # that round's requests, in the result's order
    round: bool = False  # a decode round ran (the ``rounds`` counter)
    done: list = attrs.field(factory=list)  # requests that left without joining (admission)

    def emit(self, request: Request, token: int, logprob=None) -> bool:
        """Record ``token`` (with its ``TokenLogprob`` if the request asked) on the request;
        True when it ended it (the loop emits nothing after it)."""
        row = self.rows.setdefault(request.id, RowOutput(request))
        row.texts.append(request.append(token, logprob))
        row.tokens.append(token)
        row.logprobs.append(logprob)
        row.finished = request.finished
        return row.finished

    def merge(self, other: RoundOutput) -> RoundOutput:
        for rid, row in other.rows.items():
            mine = self.rows.setdefault(rid, RowOutput(row.request))
            mine.tokens += row.tokens
            mine.texts += row.texts
            mine.logprobs += row.logprobs
            mine.finished = row.finished
        if other.verify is not None:
            self.verify, self.verified = other.verify, other.verified
        self.round = self.round or other.round
        self.done += other.done
        return self


class Delivery:
    """The core's output stage: statistics, completions, a step's events."""

    def __init__(self, counters: EngineStats):
        self.counters = counters
        self._events: dict[str, list[TokenEvent]] = {}  # request id -> this step's, first seen first
        self._completions: dict[str, Completion] = {}

    def __call__(self, out: RoundOutput | None) -> None:
        if out is None:
            return
        if out.round:
            self.counters.rounds += 1
        if out.verify is not None:
            self.counters.record_round(out.verified, out.verify)
        for row in out.rows.values():
            request, n = row.request, len(row.tokens)
            for i, (token, text, logprob) in enumerate(zip(row.tokens, row.texts, row.logprobs)):
                index = request.emitted - n + i
                if i == n - 1 and request.finished:
                    self.close(request, token, text, logprob)
                else:
                    self._add(TokenEvent(request.id, index, token, text, None, None, logprob))

    def close(self, request: Request, token: int | None = None, text: str | None = None,
              logprob=None) -> None:
        """Complete a finished request, then its last event (so whoever sees that event
        finds the result ready). Closing twice does nothing."""
        if request.closed:
            return
        request.closed = True
        if text is None:  # it ended without a token: a cancel, an error
            text = request.flush()
        self._completions[request.id] = request.completion()
        index = request.emitted - 1 if token is not None else request.emitted
        self._add(TokenEvent(request.id, index, token, text, request.finish_reason, request.error, logprob))

    def _add(self, event: TokenEvent) -> None:
        self._events.setdefault(event.request_id, []).append(event)

    def take_events(self) -> list[StepEvent]:
        """This step's events, one ``StepEvent`` per request, and forget them."""
        events, self._events = self._events, {}
        completions, self._completions = self._completions, {}
        return [StepEvent.of(evs, completions.get(rid)) for rid, evs in events.items()]
