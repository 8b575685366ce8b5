"""What a round produced, and the core's output stage that turns it into events.

Loops return a ``RoundOutput``: per row, the token ids the round appended and whether the
ids alone ended the request (EOS, a stop token, its budget), plus a verify round's
``RoundResult``. ``Delivery`` (owned by the core) then, in this order: detokenises each
row and applies stop strings (which may end a row earlier in its run), records the
statistics, and closes finished requests (their ``Completion``, then the final event).
Closing after the statistics is what puts a row's last verify round in its completion.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from .request import Request
    from .stats import EngineStats


@attrs.define(eq=False)
class RowOutput:
    request: Request
    tokens: list[int] = attrs.field(factory=list)  # appended this call, in order
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
        """Append ``token`` (with its ``TokenLogprob`` if the request asked) to the request;
        True when the ids alone end it."""
        row = self.rows.setdefault(request.id, RowOutput(request))
        row.tokens.append(token)
        row.logprobs.append(logprob)
        row.finished = request.append(token)
        return row.finished

    def merge(self, other: RoundOutput) -> RoundOutput:
        for rid, row in other.rows.items():
            mine = self.rows.setdefault(rid, RowOutput(row.request))
            mine.tokens += row.tokens
            mine.logprobs += row.logprobs
            mine.finished = row.finished
        if other.verify is not None:
            self.verify, self.verified = other.verify, other.verified
        self.round = self.round or other.round
        self.done += other.done
        return self


class Delivery:
    """The core's output stage: text, stop strings, statistics, completions, events."""

    def __init__(self, counters: EngineStats):
        self.counters = counters

    def __call__(self, out: RoundOutput) -> None:
        texts = {rid: self._detokenise(row) for rid, row in out.rows.items()}
        if out.round:
            self.counters.rounds += 1
        if out.verify is not None:
            self.counters.record_round(out.verified, out.verify)
        for rid, row in out.rows.items():
            request, pieces = row.request, texts[rid]
            for i, (token, text) in enumerate(pieces):
                logprob = row.logprobs[i]
                if logprob is not None:  # only delivered tokens: a stop string cut the rest
                    request.logprobs.append(logprob)
                if i == len(pieces) - 1 and request.finished:
                    self.close(request, token, text, logprob)
                else:
                    request.handle._push(_event(request, request.emitted - len(pieces) + i, token, text, logprob))

    def _detokenise(self, row: RowOutput) -> list[tuple[int, str]]:
        """Each new token's text; a stop string ends the row at the token that completes it
        (the ids after it in this round's run are dropped: they never went out)."""
        request, pieces = row.request, []
        for i, token in enumerate(row.tokens):
            try:
                pieces.append((token, request.stream.add(token)))
            except Exception as exc:  # a detokeniser failure fails this request only
                del request.tokens[len(request.tokens) - len(row.tokens) + i + 1:]
                request.finish_reason, request.error = "error", f"detokenisation failed: {exc}"
                pieces.append((token, ""))
                return pieces
            if request.stream.stopped:
                del request.tokens[len(request.tokens) - len(row.tokens) + i + 1:]
                request.finish_reason = "stop"
                break
        if request.finished and request.finish_reason != "error" and pieces:
            token, text = pieces[-1]
            pieces[-1] = (token, text + request.stream.finish())
        return pieces

    def close(self, request: Request, token: int | None = None, text: str | None = None,
              logprob=None) -> None:
        """Complete a finished request, then push its last event (so whoever sees that
        event finds the result ready). Closing twice does nothing."""
        if request.handle.done:
            return
        if text is None:  # it ended without a token: a cancel, an error
            text = request.stream.finish() if request.finish_reason != "error" else ""
        request.handle._complete(request.completion())
        index = request.emitted - 1 if token is not None else request.emitted
        request.handle._push(_event(request, index, token, text, logprob))


def _event(request: Request, index: int, token: int | None, text: str, logprob=None):
    from .request import TokenEvent

    last = request.finished and (token is None or index == request.emitted - 1)
    reason = request.finish_reason if last else None
    return TokenEvent(request.id, index, token, text, reason, request.error if last else None, logprob)
