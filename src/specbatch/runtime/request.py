"""A request's life on the engine side, and the handle its submitter holds.

Vocabulary: a request's *emitted* count is how many tokens it has recorded (each goes out);
output position ``p`` is the index of a token in that stream (the first generated token
is position 0). A request *finishes* exactly once, with a reason: "stop" (EOS, a stop
token or a stop string), "length" (budget), "cancelled" or "error".
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time

import attrs

from .detok import TextStream
from .params import SamplingParams, TokenLogprob

_ids = itertools.count(1)


@attrs.frozen
class TokenEvent:
    """One step of a stream: a token and its text delta; the last carries finish_reason."""

    request_id: str
    index: int
    token: int | None
    text: str
    finish_reason: str | None = None
    error: str | None = None
    logprob: TokenLogprob | None = None  # the token's, when the request asked for logprobs


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.define
class SpecStats:
    """Per request: verify rounds it took part in, tokens drafted for it, accepted."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@attrs.frozen
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    seed: int
    error: str | None = None
    spec: SpecStats = attrs.field(factory=SpecStats)
    logprobs: list[TokenLogprob] | None = None  # per token, when the request asked


class RequestHandle:
    """What ``Engine.submit`` returns: iterate for events, or ``result()`` for the whole."""

    def __init__(self, request_id: str, seed: int, prompt_tokens: int):
        self.request_id = request_id
        self.seed = seed
        self.prompt_tokens = prompt_tokens
        self._events: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        self._done = threading.Event()
        self._completion: Completion | None = None
        self._consumed_final = False
        self._listeners: list = []

    # engine side (``Engine`` alone dispatches to handles) ---------------------------------
    def _push(self, event: TokenEvent) -> None:
        self._events.put(event)
        for loop, aqueue in self._listeners:
            try:
                loop.call_soon_threadsafe(aqueue.put_nowait, event)
            except RuntimeError:  # the listener's event loop has closed: nobody is reading
                pass

    def _complete(self, completion: Completion) -> None:
        self._completion = completion
        self._done.set()

    # caller side ------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done.is_set()

    def __iter__(self):
        while not self._consumed_final:
            event = self._events.get()
            if event.finish_reason is not None:
                self._consumed_final = True
            yield event

    def result(self, timeout: float | None = None) -> Completion:
        """Block until finished; the whole completion, however many events were read."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish in {timeout}s")
        return self._completion

    def _attach(self, loop: asyncio.AbstractEventLoop) -> asyncio.Queue:
        """A queue on ``loop`` that gets every event pushed from now on (attach before the
        request is queued, or its first events go only to the blocking iterator)."""
        aqueue: asyncio.Queue = asyncio.Queue()
        self._listeners.append((loop, aqueue))
        return aqueue


@attrs.define(eq=False)
class Request:
    """Engine-side data of one request (owned by the engine thread).

    One writer per field: ``append`` records a generated id with its text and logprob and
    ends the request where the id or the text says (EOS, a stop token or string, the
    budget); ``abort`` ends it without one; the machine clears ``retire`` on a preempt;
    the plan runner sets ``cancel_requested``; the statistics count ``spec``; the core's
    output stage sets ``closed`` once the final event is out. Nobody truncates ``tokens``."""

    prompt: list[int]
    params: SamplingParams
    stream: TextStream
    eos_ids: frozenset[int]
    id: str = attrs.field(factory=lambda: f"req-{next(_ids)}")
    tokens: list[int] = attrs.field(factory=list)
    finish_reason: str | None = None
    error: str | None = None
    cancel_requested: bool = False
    retire: bool = True  # offer the KV back to the prompt cache; preempted requests don't
    submitted_at: float = attrs.field(factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    gaps: list[float] = attrs.field(factory=list)  # inter-token latencies, seconds
    spec: SpecStats = attrs.field(factory=SpecStats)
    logprobs: list[TokenLogprob] = attrs.field(factory=list)  # per token, when the request asked
    closed: bool = False  # its final event went out (the core's output stage)

    @classmethod
    def create(cls, prompt: list[int], params: SamplingParams, tokenizer,
               request_id: str | None = None) -> "Request":
        """A request (``params`` must carry its seed already); ``request_id``: reuse an id
        given elsewhere (a follower rank mirrors the driver's)."""
        return cls(prompt, params, TextStream(tokenizer, params.stop), frozenset(tokenizer.eos_token_ids),
                   **({"id": request_id} if request_id else {}))

    @property
    def emitted(self) -> int:
        return len(self.tokens)

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - self.emitted

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, logprob: TokenLogprob | None = None) -> str:
        """Record one generated id (and its logprob, where asked) and return its text: the
        detokenised delta, all that is left once the request ends. A stop string ends the
        request at the id that completes it, as EOS, a stop token or the budget do; a
        detokeniser failure ends it with an error."""
        if self.finished:
            raise RuntimeError(f"{self.id}: token after finish")
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
        else:
            self.gaps.append(now - self.last_token_at)
        self.last_token_at = now
        self.tokens.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        try:
            text = self.stream.add(token)
        except Exception as exc:  # a detokeniser failure fails this request only
            self.finish_reason, self.error = "error", f"detokenisation failed: {exc}"
            return ""
        if self.stream.stopped or (token in self.eos_ids and not self.params.ignore_eos) \
                or token in self.params.stop_token_ids:
            self.finish_reason = "stop"
        elif self.remaining <= 0:
            self.finish_reason = "length"
        return text + self.stream.finish() if self.finished else text

    def abort(self, reason: str, error: str | None = None) -> None:
        """End without a token (cancel or error); the core closes it with a final event."""
        if not self.finished:
            self.finish_reason, self.error = reason, error

    def flush(self) -> str:
        """The text still held back (a partial stop string, partial bytes), once it ended without a token."""
        return self.stream.finish() if self.finish_reason != "error" else ""

    def completion(self) -> Completion:
        """The whole result as it stands (the core takes it once the request has ended)."""
        return Completion(self.id, self.stream.text, list(self.tokens), self.finish_reason,
                          Usage(len(self.prompt), len(self.tokens)), self.params.seed, self.error,
                          attrs.evolve(self.spec),
                          list(self.logprobs) if self.params.logprobs is not None else None)
