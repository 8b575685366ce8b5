"""The engine: a thread that owns MLX, an injection queue, and request handles.

Data flows one way: ``submit`` validates and queues a request; the engine thread moves
queued requests to the scheduler between rounds; the scheduler (the state machine)
decides what each round is and runs it on the decode loops; tokens flow back to the
request handles as events. Callers never block the engine thread.
"""

from __future__ import annotations

import asyncio
import atexit
import ctypes
import queue
import threading
import weakref
from typing import Iterable

import attrs
import mlx.core as mx
import structlog

from .config import EngineConfig
from .errors import EngineClosed, InvalidRequest, QueueFull
from .models import LoadedModel
from .request import Request, RequestHandle
from .sampling import SamplingParams
from .plan import Lockstep, Plan, PlanRunner, fingerprint
from .scheduler import Scheduler, build_scheduler
from .stats import EngineStats

log = structlog.get_logger(__name__)
_engines: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_engines() -> None:
    # MLX aborts at exit if a thread still holds streams: stop engine threads first.
    for engine in list(_engines):
        engine.close(timeout=10)
    mx.clear_streams()


def release_memory() -> None:
    """Hand freed memory back to the OS when the engine goes idle: MLX's buffer cache, and
    the free pages glibc's heap keeps (RSS grew ~120 MB over 1,000 requests without it,
    with MLX's active memory flat)."""
    mx.clear_cache()
    try:
        ctypes.CDLL(None).malloc_trim(0)  # glibc only; elsewhere there is nothing to call
    except (OSError, AttributeError):
        pass


class Engine:
    """Speculative decoding and continuous batching together, behind one small API."""

    def __init__(self, target: LoadedModel, drafter: LoadedModel | None = None,
                 config: EngineConfig | None = None, *, scheduler_factory=build_scheduler,
                 lockstep: Lockstep | None = None):
        """``scheduler_factory(target, drafter, config, stats)`` builds the scheduler (the
        state machine by default); ``lockstep`` publishes each plan to follower ranks."""
        self.target = target
        self.drafter = drafter
        self.config = config or EngineConfig()
        self.tokenizer = target.tokenizer
        self._stats = EngineStats()
        self.scheduler: Scheduler = scheduler_factory(target, drafter, self.config, self._stats)
        self._inbox: queue.SimpleQueue[list[Request] | None] = queue.SimpleQueue()  # batches of arrivals
        self._cancels: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.lockstep = lockstep
        self._runner = PlanRunner(self.scheduler, self._book,
                                  fatal=lockstep.is_fatal if lockstep else (lambda exc: False))
        self.failure: str | None = None  # why the engine stopped, if it failed
        self._on_failure: list = []
        self._in_flight_to_queue = 0  # submitted, not yet moved to the waiting list
        self._lock = threading.Lock()
        self._closing = False
        self._drain = True
        self._gauges = self.scheduler.gauges()  # published by the engine thread after each step
        self._thread = threading.Thread(target=self._run, name="specbatch-engine", daemon=True)
        self._thread.start()
        _engines.add(self)
        log.info("engine_started", model=target.name, drafter=getattr(drafter, "name", None),
                 speculation=self.config.speculation and drafter is not None,
                 k=self.config.num_draft_tokens, cap=self.config.speculative_width_cap)

    @classmethod
    def from_pretrained(cls, model: str | None = None, draft_model: str | None = None, *,
                        speculation: bool = True, speculative_width_cap: int | None = None,
                        num_draft_tokens: int | None = None, **options) -> "Engine":
        """Load a target (and drafter) and start the engine; ``model=None``: the demo pair."""
        from .config import load_pair

        target, drafter, config = load_pair(model, draft_model, speculation=speculation,
                                            speculative_width_cap=speculative_width_cap,
                                            num_draft_tokens=num_draft_tokens, **options)
        return cls(target, drafter, config)

    # -- caller side ------------------------------------------------------------------
    def encode(self, prompt: str | Iterable[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        ids = list(prompt) if isinstance(prompt, (list, tuple)) else None
        if ids is None or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequest("prompt must be a string or a list of token ids", "prompt")
        if any(not 0 <= t < self.target.vocab_size for t in ids):
            raise InvalidRequest(f"prompt token ids must be in [0, {self.target.vocab_size})", "prompt")
        return ids

    def prepare(self, prompt, params=None) -> Request:
        """Validate and build a request without queueing it (raises on bad input)."""
        if self._closing:
            raise EngineClosed(f"engine stopped: {self.failure}" if self.failure else "engine is closed")
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams(**params)
        ids = self.encode(prompt)
        if not ids:
            raise InvalidRequest("prompt must not be empty", "prompt")
        room = self.target.context_length - len(ids)
        if room < 1:
            raise InvalidRequest(
                f"prompt has {len(ids)} tokens; the model's context is "
                f"{self.target.context_length}", "prompt", "context_length_exceeded")
        params = params.with_seed()
        if params.max_tokens > room:  # a prompt may fill the context up to the limit
            params = attrs.evolve(params, max_tokens=room)
        if self._in_flight_to_queue + len(self._runner.waiting) >= self.config.max_queue:
            raise QueueFull(f"{self.config.max_queue} requests are already waiting")
        return Request.create(ids, params, self.tokenizer)

    def submit(self, prompt: str | list[int], params: SamplingParams | dict | None = None) -> RequestHandle:
        """Queue a request and return its handle at once."""
        request = self.prepare(prompt, params)
        self._enqueue(request)
        return request.handle

    def submit_many(self, prompts: list, params: SamplingParams | dict | None = None) -> list[RequestHandle]:
        """Queue several requests as one arrival: the next drain sees them all together."""
        requests = [self.prepare(p, params) for p in prompts]  # all valid, or none queued
        self._enqueue(*requests)
        return [r.handle for r in requests]

    def _enqueue(self, *requests: Request) -> None:
        if self.failure:
            raise EngineClosed(f"engine stopped: {self.failure}")
        with self._lock:
            self._in_flight_to_queue += len(requests)
        self._stats.submitted += len(requests)
        self._inbox.put(list(requests))

    async def stream(self, prompt, params=None):
        """``async for event in engine.stream(...)``; cancels the request if abandoned."""
        async for event in self.stream_request(self.prepare(prompt, params)):
            yield event

    async def stream_request(self, request: Request):
        """Queue a prepared request and yield its events; cancel it if the consumer leaves."""
        events = request.handle._attach(asyncio.get_running_loop())
        self._enqueue(request)
        try:
            while True:
                event = await events.get()
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            if not request.handle.done:
                self.cancel(request.handle)

    def cancel(self, handle: RequestHandle | str) -> None:
        """Remove the request at the next round boundary; its KV is freed."""
        self._cancels.put(handle if isinstance(handle, str) else handle.request_id)
        self._inbox.put(None)  # wake the loop

    def stats(self) -> dict:
        """Counters and gauges; safe from any thread (gauges are the last step's)."""
        return self._stats.snapshot(self._gauges, queue_depth=len(self._runner.waiting) + self._in_flight_to_queue)

    def close(self, drain: bool = False, timeout: float | None = 60.0) -> None:
        """Stop admitting; finish (``drain``) or cancel in-flight work; join the thread."""
        self._closing, self._drain = True, drain
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
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass
        cancels = []
        while not self._cancels.empty():
            cancels.append(self._cancels.get_nowait())
        return Plan(tuple(arrivals), tuple(cancels), closing=self._closing,
                    abandon=self._closing and not self._drain, more_coming=not self._inbox.empty())

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # only errors no round can recover from get here
            lost = self.lockstep is not None and self.lockstep.is_fatal(exc)
            self._fail(("a peer rank was lost: " if lost else "") + f"{type(exc).__name__}: {exc}")
        finally:
            if self.lockstep is not None:
                self.lockstep.close()
            self.scheduler.shutdown()
            self._gauges = self.scheduler.gauges()
            mx.clear_streams()  # MLX needs per-thread cleanup before interpreter exit

    def _serve(self) -> None:
        runner = self._runner
        while True:
            plan = self._intake(block=runner.idle)
            if self.lockstep is not None:  # followers replay this plan before we run it
                self.lockstep.publish(plan, fingerprint(self.scheduler, runner.waiting))
            was_idle = runner.idle
            if not runner.apply(plan):
                break
            if runner.idle and not was_idle:
                release_memory()
            self._gauges = self.scheduler.gauges()

    def _fail(self, error: str) -> None:
        """The engine cannot go on (a lost peer): every request gets an error event."""
        self.failure, self._closing = error, True
        log.error("engine_failed", error=error)
        failed = self._runner.fail_all(error)
        try:  # arrivals the failed step never saw
            while True:
                failed += self._inbox.get_nowait() or []
        except queue.Empty:
            pass
        for request in failed:
            request.abort("error", error)
        self._book(failed)
        for callback in list(self._on_failure):
            callback(error)

    def on_failure(self, callback) -> None:
        """Call ``callback(error)`` if the engine stops on an unrecoverable error."""
        self._on_failure.append(callback)

    def _book(self, finished: list[Request]) -> None:
        """Close out requests that left the engine: counters and a log line."""
        for request in finished:
            self._stats.record_finish(request)
            log.info("finish", request=request.id, reason=request.finish_reason, tokens=request.emitted,
                     drafted=request.spec.drafted, accepted=request.spec.accepted, retire=request.retire)
