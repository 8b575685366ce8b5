"""The engine: a thread that drives one ``EngineCore``, an injection queue, and request handles.

Data flows one way: ``submit`` validates (the core's rules) and queues a request; the
engine thread cuts a ``Plan`` from what callers did since the last step and hands it to
the core, whose state machine decides what the round is and runs it on the decode loops;
the core returns the step's events and the engine, which alone holds the handles, hands
each to its request's handle. Callers never block the engine thread.
"""

from __future__ import annotations

import asyncio
import atexit
import queue
import threading
import weakref
from typing import Iterable

import structlog

from ..errors import EngineClosed
from .config import EngineConfig
from .core import EngineCore
from .output import StepEvent
from .params import SamplingParams
from .plan import Lockstep, Plan
from .request import Request, RequestHandle
from .scheduler import Kernels, Scheduler

log = structlog.get_logger(__name__)
_engines: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def close_engines() -> None:
    """Stop every engine thread (at exit: the kernels then clean up the main thread)."""
    for engine in list(_engines):
        engine.close(timeout=10)


class Engine:
    """Speculative decoding and continuous batching together, behind one small API."""

    def __init__(self, kernels: Kernels, tokenizer, config: EngineConfig | None = None, *,
                 lockstep: Lockstep | None = None):
        """A core over ``kernels`` (``kernels.build`` makes them, and ``from_pretrained``
        the whole engine), driven from a thread of its own; ``lockstep`` publishes each
        plan to follower ranks."""
        self.core = EngineCore(kernels, tokenizer, config, lockstep=lockstep)
        self.kernels, self.tokenizer, self.config = kernels, tokenizer, self.core.config
        self.target, self.drafter = kernels.target, kernels.drafter  # the loaded pair (its names)
        self._handles: dict[str, RequestHandle] = {}  # request id -> its handle, until its final event
        self._inbox: queue.SimpleQueue[list[Request] | None] = queue.SimpleQueue()  # batches of arrivals
        self._cancels: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._on_failure: list = []
        self._in_flight_to_queue = 0  # submitted, not yet moved to the waiting list
        self._in_flight_tokens = 0  # their prompt tokens
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="specbatch-engine", daemon=True)
        self._thread.start()
        _engines.add(self)
        log.info("engine_started", model=kernels.target.name, drafter=kernels.drafter_name,
                 speculation=kernels.speculative,
                 k=self.config.num_draft_tokens, cap=self.config.speculative_width_cap)

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def lockstep(self) -> Lockstep | None:
        return self.core.lockstep

    @property
    def failure(self) -> str | None:
        """Why the engine stopped, if it failed."""
        return self.core.failure

    # -- caller side ------------------------------------------------------------------
    @property
    def context_length(self) -> int:
        return self.core.context_length

    def encode(self, prompt: str | Iterable[int]) -> list[int]:
        return self.core.encode(prompt)

    def prepare(self, prompt, params=None, pending: int = 0) -> Request:
        """Validate and build a request without queueing it (raises on bad input);
        ``pending``: requests the caller prepared and will queue with it (``n``)."""
        return self.core.prepare(prompt, params, in_transit=self._in_flight_to_queue + pending)

    def submit(self, prompt: str | list[int], params: SamplingParams | dict | None = None) -> RequestHandle:
        """Queue a request and return its handle at once."""
        [handle] = self._enqueue(self.prepare(prompt, params))
        return handle

    def submit_many(self, prompts: list, params: SamplingParams | dict | None = None) -> list[RequestHandle]:
        """Queue several requests as one arrival: the next step admits them together."""
        return self._enqueue(*[self.prepare(p, params) for p in prompts])  # all valid, or none queued

    def _enqueue(self, *requests: Request) -> list[RequestHandle]:
        handles = self._handles_for(requests)
        self._queue(requests)
        return handles

    def _handles_for(self, requests) -> list[RequestHandle]:
        """New handles for ``requests``, known to the engine before they are queued."""
        if self.failure:
            raise EngineClosed(f"engine stopped: {self.failure}")
        handles = [RequestHandle(r.id, r.params.seed, len(r.prompt)) for r in requests]
        self._handles.update((h.request_id, h) for h in handles)
        return handles

    def _queue(self, requests) -> None:
        """Hand ``requests`` to the engine thread as one arrival."""
        with self._lock:
            self._in_flight_to_queue += len(requests)
            self._in_flight_tokens += sum(len(r.prompt) for r in requests)
        self.core.submitted(len(requests))
        self._inbox.put(list(requests))

    def handle(self, request: Request | str) -> RequestHandle:
        """The handle of a queued request that has not finished yet."""
        return self._handles[request if isinstance(request, str) else request.id]

    async def stream(self, prompt, params=None):
        """``async for event in engine.stream(...)``; cancels the request if abandoned."""
        async for event in self.stream_request(self.prepare(prompt, params)):
            yield event

    async def stream_request(self, request: Request):
        """Queue a prepared request and yield its events; cancel it if the consumer leaves."""
        [events] = self.stream_requests([request])
        async for event in events:
            yield event

    def stream_requests(self, requests: list[Request]) -> list:
        """Queue prepared requests as one arrival (the next step admits them together);
        one async event stream each, which cancels its request if its consumer leaves."""
        loop = asyncio.get_running_loop()
        # listeners attach before the engine thread can see the requests: an event pushed
        # in between (a first token, under load) would reach no stream
        streams = [self._events(h, h._attach(loop)) for h in self._handles_for(requests)]
        self._queue(requests)
        return streams

    async def _events(self, handle: RequestHandle, events):
        try:
            while True:
                event = await events.get()
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            if not handle.done:
                self.cancel(handle)

    def cancel(self, handle: RequestHandle | str) -> None:
        """Remove the request at the next round boundary; its KV is freed."""
        self._cancels.put(handle if isinstance(handle, str) else handle.request_id)
        self._inbox.put(None)  # wake the loop

    def stats(self) -> dict:
        """Counters and gauges; safe from any thread (gauges are the last step's)."""
        return self.core.stats(queued=self._in_flight_to_queue, queued_tokens=self._in_flight_tokens)

    def close(self, drain: bool = False, timeout: float | None = 60.0) -> None:
        """Stop admitting; finish (``drain``) or cancel in-flight work; join the thread."""
        self.core.stop_admitting(drain)
        self._inbox.put(None)
        self._thread.join(timeout)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- engine thread --------------------------------------------------------------------
    def _intake(self, block: bool) -> Plan:
        """Cut the next plan from what callers did since the last one."""
        arrivals: list[Request] = []
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                if item is not None:
                    arrivals.extend(item)
                    with self._lock:
                        self._in_flight_to_queue -= len(item)
                        self._in_flight_tokens -= sum(len(r.prompt) for r in item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass
        cancels = []
        while not self._cancels.empty():
            cancels.append(self._cancels.get_nowait())
        return self.core.plan(arrivals, cancels, more_coming=not self._inbox.empty())

    def _run(self) -> None:
        try:
            while not self.core.closed:
                self._dispatch(self.core.apply(self._intake(block=self.core.idle)))
        except Exception as exc:  # only errors no round can recover from get here
            lockstep = self.core.lockstep
            lost = lockstep is not None and lockstep.is_fatal(exc)
            self._fail(("a peer rank was lost: " if lost else "") + f"{type(exc).__name__}: {exc}")
        finally:
            self.core.shutdown()
            self.kernels.end_thread()  # MLX needs per-thread cleanup before interpreter exit

    def _fail(self, error: str) -> None:
        """The engine cannot go on (a lost peer): every request gets an error event."""
        unseen: list[Request] = []
        try:  # arrivals the failed step never saw
            while True:
                unseen += self._inbox.get_nowait() or []
        except queue.Empty:
            pass
        self._dispatch(self.core.fail(error, unseen))
        for callback in list(self._on_failure):
            callback(error)

    def _dispatch(self, events: list[StepEvent]) -> None:
        """Each request's events of a step to its handle; a final one completes it first
        (so whoever sees that event finds the result ready) and the engine lets go."""
        for step in events:
            handle = self._handles.get(step.request_id)
            if handle is None:
                continue
            *tokens, last = step.events
            for event in tokens:
                handle._push(event)
            if step.finish_reason is not None:
                handle._complete(step.completion)
                self._handles.pop(step.request_id, None)
            handle._push(last)

    def on_failure(self, callback) -> None:
        """Call ``callback(error)`` if the engine stops on an unrecoverable error."""
        self._on_failure.append(callback)
