"""The engine core: add, cancel, step. No thread and no queue: the caller's loop drives it.

``step()`` cuts a ``Plan`` from what was added and cancelled since the last step, applies
it (one ``PlanRunner.apply``: at most one round of the state machine) and returns what
each request produced in that round as ``StepEvent``s. Every decision is a function of
the plans and the tokens, so a step sequence replays exactly: tests reach every
transition with it, and other servers call it from their own loop. ``Engine`` drives one
core from its thread; a follower rank of a sharded target drives one with the driver's
plans (``apply``).
"""

from __future__ import annotations

from typing import Callable, Iterable

import attrs
import structlog

from ..errors import EngineClosed, InvalidRequest, QueueFull
from .config import EngineConfig
from .machine import SpecMachine
from .output import Delivery, StepEvent
from .params import SamplingParams
from .plan import Lockstep, Plan, PlanRunner, fingerprint
from .request import Request
from .scheduler import Kernels, Scheduler
from .stats import EngineStats, admitting

log = structlog.get_logger(__name__)


class EngineCore:
    """Speculative decoding and continuous batching, stepped by the caller (one thread)."""

    def __init__(self, kernels: Kernels, tokenizer, config: EngineConfig | None = None, *,
                 lockstep: Lockstep | None = None,
                 fatal: Callable[[BaseException], bool] | None = None):
        """The state machine over ``kernels`` (``kernels.build`` makes them); ``lockstep``
        publishes each plan to follower ranks; ``fatal(exc)``: errors that end the core
        instead of failing one round."""
        self.kernels, self.tokenizer = kernels, tokenizer
        self.config = config or EngineConfig()
        self.counters = EngineStats()
        self.delivery = Delivery(self.counters)  # round outputs -> text, stops, stats, events
        self.scheduler: Scheduler = SpecMachine(kernels, self.config, self.counters, self.delivery)
        self.lockstep = lockstep
        if fatal is None:
            fatal = lockstep.is_fatal if lockstep else (lambda exc: False)
        self.runner = PlanRunner(self.scheduler, self.book, fatal=fatal)
        self.closing = False  # admits nothing new; steps finish (drain) or cancel the rest
        self.drain = True
        self.closed = False  # a closing plan found the core idle: no step does anything more
        self.failure: str | None = None  # why the core stopped, if it failed
        self.gauges = self.scheduler.gauges()  # the last step's: safe to read from any thread
        self._arrivals: list[Request] = []  # added since the last step
        self._cancels: list[str] = []

    # -- input -------------------------------------------------------------------------
    def encode(self, prompt: str | Iterable[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        ids = list(prompt) if isinstance(prompt, (list, tuple)) else None
        if ids is None or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequest("prompt must be a string or a list of token ids", "prompt")
        if any(not 0 <= t < self.kernels.target.vocab_size for t in ids):
            raise InvalidRequest(f"prompt token ids must be in [0, {self.kernels.target.vocab_size})", "prompt")
        return ids

    def prepare(self, prompt, params: SamplingParams | dict | None = None, *,
                in_transit: int = 0) -> Request:
        """Validate and build a request without queueing it (raises on bad input).
        ``in_transit``: requests a driver accepted but has not handed over yet (they count
        against ``max_queue`` too)."""
        if self.closing:
            raise EngineClosed(f"engine stopped: {self.failure}" if self.failure else "engine is closed")
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams(**params)
        ids = self.encode(prompt)
        if not ids:
            raise InvalidRequest("prompt must not be empty", "prompt")
        room = self.context_length - len(ids)
        if room < 1:
            limit = ("--max-model-len" if self.context_length < self.kernels.target.context_length
                     else "the model's context")
            raise InvalidRequest(
                f"prompt has {len(ids)} tokens; {limit} is {self.context_length} tokens, so no "
                "token could be generated", "prompt", "context_length_exceeded")
        if any(token >= self.kernels.target.vocab_size for token, _ in params.logit_bias):
            raise InvalidRequest(f"logit_bias token ids must be in [0, {self.kernels.target.vocab_size})", "logit_bias")
        params = params.with_seed()
        if params.max_tokens > room:  # a prompt may fill the context up to the limit
            params = attrs.evolve(params, max_tokens=room)
        if in_transit + len(self._arrivals) + len(self.runner.waiting) >= self.config.max_queue:
            raise QueueFull(f"{self.config.max_queue} requests are already waiting")
        return Request.create(ids, params, self.tokenizer)

    @property
    def context_length(self) -> int:
        """Prompt + completion tokens a request may hold: the model's context, or
        ``max_model_len`` where that is shorter."""
        limit = self.config.max_model_len
        return min(self.kernels.target.context_length, limit) if limit else self.kernels.target.context_length

    def add(self, prompt, params: SamplingParams | dict | None = None) -> str:
        """Validate and queue a request for the next step; its id names its events."""
        request = self.prepare(prompt, params)
        self._arrivals.append(request)
        self.submitted(1)
        return request.id

    def submitted(self, n: int) -> None:
        """``n`` requests were accepted (here, or by a driver that queues them)."""
        self.counters.submitted += n

    def cancel(self, request_id: str) -> None:
        """Remove the request at the next step; its KV is freed (unknown ids are ignored)."""
        self._cancels.append(request_id)

    # -- stepping ----------------------------------------------------------------------
    def step(self) -> list[StepEvent]:
        """Apply what was added and cancelled since the last step and run at most one round."""
        plan = self.plan(self._arrivals, self._cancels)
        self._arrivals, self._cancels = [], []
        return self.apply(plan)

    def plan(self, arrivals, cancels, more_coming: bool = False) -> Plan:
        """The next plan: these arrivals and cancels, and whether the core is closing."""
        return Plan(tuple(arrivals), tuple(cancels), closing=self.closing,
                    abandon=self.closing and not self.drain, more_coming=more_coming)

    def apply(self, plan: Plan) -> list[StepEvent]:
        """Run one plan cut elsewhere (an Engine's inbox, a driver rank's message)."""
        if self.closed:
            return []
        if self.lockstep is not None:  # followers replay this plan before we run it
            self.lockstep.publish(plan, self.fingerprint())
        was_idle = self.runner.idle
        if not self.runner.apply(plan):
            self.closed = True
        elif self.runner.idle and not was_idle:
            self.kernels.release_memory()
        self.gauges = self.scheduler.gauges()
        return self.delivery.take_events()

    def close(self, drain: bool = False) -> list[StepEvent]:
        """Stop admitting; step until in-flight work is finished (``drain``) or cancelled;
        release the kernels. Returns the events of those last steps."""
        self.stop_admitting(drain)
        events = []
        while not self.closed and self.failure is None:  # a failed core has nothing left to run
            events += self.step()
        self.shutdown()
        return events

    def stop_admitting(self, drain: bool = False) -> None:
        """From now on ``add`` raises and plans say closing (a driver's ``close``)."""
        self.closing, self.drain = True, drain

    def shutdown(self) -> None:
        """The driver has stopped stepping: drop the loops and their KV."""
        if self.lockstep is not None:
            self.lockstep.close()
        self.scheduler.shutdown()
        self.gauges = self.scheduler.gauges()

    def fail(self, error: str, unseen: Iterable[Request] = ()) -> list[StepEvent]:
        """The core cannot go on (a lost peer): every request, and ``unseen`` ones a driver
        still held, ends with an error event."""
        self.failure, self.closing = error, True
        log.error("engine_failed", error=error)
        failed = self.runner.fail_all(error)
        for request in unseen:
            request.abort("error", error)
            failed.append(request)
        self.book(failed)
        return self.delivery.take_events()

    def book(self, finished: list[Request]) -> None:
        """Close out requests that left the engine: the final event of any that ended
        without one (cancels, errors), counters and a log line."""
        for request in finished:
            self.delivery.close(request)
            self.counters.record_finish(request)
            log.info("finish", request=request.id, reason=request.finish_reason, tokens=request.emitted,
                     drafted=request.spec.drafted, accepted=request.spec.accepted, retire=request.retire)

    # -- reading -----------------------------------------------------------------------
    @property
    def state(self) -> str:
        """The machine's state: "Idle", "Scalar", "Batched" or "Gated"."""
        return self.scheduler.state

    @property
    def idle(self) -> bool:
        return self.runner.idle

    def has_work(self) -> bool:
        """True while a step would do something: queued input, waiting or live requests."""
        return bool(self._arrivals or self._cancels) or not self.runner.idle

    def fingerprint(self) -> str:
        return fingerprint(self.scheduler, self.runner.waiting)

    def stats(self, queued: int = 0, queued_tokens: int = 0) -> dict:
        """Counters and the last step's gauges; ``queued``: requests a driver still holds
        (``queued_tokens``: their prompt tokens)."""
        waiting = list(self.runner.waiting) + list(self._arrivals)  # copies: read from any thread
        depth = len(waiting) + queued
        return self.counters.snapshot(self.gauges, queue_depth=depth,
                                      queued_prompt_tokens=queued_tokens + sum(len(r.prompt) for r in waiting),
                                      admitting=admitting(self.runner.live.values(), waiting))

    def __enter__(self) -> "EngineCore":
        return self

    def __exit__(self, *exc) -> None:
        if not self.closed:
            self.close()
