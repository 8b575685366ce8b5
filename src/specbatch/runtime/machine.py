"""The speculative-batching state machine: Scalar, Batched, Gated.

    [*] --> Scalar: first request            Scalar --> [*]: request finishes, no waiters
    [*] --> Batched: a burst within the cap  [*] --> Gated: plain arrivals (or over the cap)
    Scalar --> Batched: ready waiters (preempt)
    Batched --> Batched: capture round (arms the batch)
    Batched --> Gated: over the cap          Gated --> Batched: back within the cap (re-arm)
    Batched --> [*], Gated --> [*]: last row finishes

``Idle`` is the diagram's ``[*]``. A step walks its state's ``ROUNDS``: an action runs; a
trigger fires when its guard holds (``transitions`` checks it and moves the state), its
hook runs, and the step ends. Guards are pure functions of the loops and the ``Step``;
hooks and actions (``moves``) return what the loops produced, which the step hands to
``deliver`` (the core's output stage). No MLX here. Vocabulary: *width* = rows in the
batch; *cap* = ``speculative_width_cap``, the widest batch that still speculates
(inclusive; 0 = uncapped); a *ready* waiter may join now (its prompt fits one prefill
chunk, or its chunks are all done): only ready waiters preempt, gate or join while rows
decode; at Idle every waiter is admitted. *Injection* (``inject``) is where rows that
ended leave and waiters join, between two rounds.
"""

from __future__ import annotations

import collections
from typing import Callable

import structlog
from transitions import Machine

from .moves import Moves, Step
from .output import RoundOutput
from .book import AcceptanceBook
from .scheduler import BatchRounds, Kernels, ScalarRounds

log = structlog.get_logger(__name__)

STATES = ["Idle", "Scalar", "Batched", "Gated"]

# trigger, source, dest, guard, hook, why (the chart shows trigger and guard)
TRANSITIONS = [
    ("start_scalar", "Idle", "Scalar", "lone_arrival", "begin_scalar", "first request"),
    ("start_batch", "Idle", "Batched", "burst_within_cap", "begin_batch",
     "added: a burst of arrivals at idle goes straight to the batch loop"),
    ("start_plain", "Idle", "Gated", "plain_arrivals", "begin_batch",
     "added: no drafter, speculation off, or a burst over the cap"),
    ("finish", "Scalar", "Idle", "scalar_done", "end_scalar", "request finishes, no waiters"),
    ("preempt", "Scalar", "Batched", "waiters_behind_scalar", "do_preempt",
     "waiters ready to decode (a long prompt's chunks all done)"),
    ("capture", "Batched", "Batched", "unarmed", "do_capture",
     "the capture round: one plain token per row, the drafter cold-starts from it (arms)"),
    ("gate", "Batched", "Gated", "over_cap", "do_gate", "over the cap"),
    ("rearm", "Gated", "Batched", "rearm_pays", "do_rearm",
     "back within the cap: settle the in-flight plain round; the capture round follows"),
    ("finish", ["Batched", "Gated"], "Idle", "no_rows", "end_batch", "last row finishes"),
]

# What a state's step does, in order: a trigger fires when its guard holds and then ends
# the step; an action always runs. This is the one place that says, for instance, that
# injection (``inject``) runs before a pending re-arm or capture, so an arrival over the
# cap trips the gate and a batch never arms over the cap.
ROUNDS = {
    "Idle": ("start_scalar", "start_batch", "start_plain"),
    "Scalar": ("finish", "preempt", "prefill", "scalar_round"),
    "Batched": ("gate", "inject", "finish", "capture", "prefill", "spec_round", "reap", "finish"),
    "Gated": ("inject", "count_calm", "finish", "rearm", "prefill", "plain_round", "reap"),
}
ACTIONS = ("inject", "count_calm", "prefill", "scalar_round", "spec_round", "plain_round", "reap")
TRIGGERS = {t for t, *_ in TRANSITIONS}
_SOURCES = [(t, s) for t, src, *_ in TRANSITIONS for s in (src if isinstance(src, list) else [src])]
HOOKS = {(t, s): h for t, src, _, _, h, _ in TRANSITIONS for s in (src if isinstance(src, list) else [src])}
assert all(step in ACTIONS or (step, state) in _SOURCES
           for state, steps in ROUNDS.items() for step in steps), "ROUNDS names a step its state lacks"


def build_machine(model, cls=Machine, **kw) -> Machine:
    """The transitions machine over ``model`` (a SpecMachine, or a stub for charts): the
    table's states, edges and guards; the hooks are the SpecMachine's to call."""
    table = [dict(trigger=t, source=s, dest=d, conditions=g) for t, s, d, g, _, _ in TRANSITIONS]
    return cls(model=model, states=STATES, transitions=table, initial="Idle", auto_transitions=False, **kw)


class SpecMachine(Moves):
    """The engine's scheduler: one state, one loop object at a time (its moves: ``Moves``)."""

    def __init__(self, kernels: Kernels, config, stats, deliver: Callable[[RoundOutput | None], None]):
        """``deliver(output)``: the core's output stage, handed each loop call's output."""
        self.kernels, self.config, self.stats, self.deliver = kernels, config, stats, deliver
        self.scalar: ScalarRounds | None = None
        self.batch: BatchRounds | None = None
        self.calm_rounds = 0  # gated rounds in a row spent within the cap (re-arm hysteresis)
        self.policy = config.policy()  # decides every round's draft (pure)
        self.book = AcceptanceBook(config.drafts.prior, config.num_draft_tokens)  # live rows' acceptance
        self.decided = None  # the last round's Decision (a change is logged)
        self.machine = build_machine(self)

    # -- guards (pure) ------------------------------------------------------------------
    def lone_arrival(self, step: Step) -> bool:
        return self.kernels.speculative and len(step.waiting) == 1 and self._speculates(step.waiting)

    def burst_within_cap(self, step: Step) -> bool:
        n = self._room(step)
        return self.kernels.speculative and n >= 2 and self._speculates(list(step.waiting)[:n])

    def plain_arrivals(self, step: Step) -> bool:
        return bool(step.waiting) and not self.lone_arrival(step) and not self.burst_within_cap(step)

    def scalar_done(self, step: Step) -> bool:
        return self.scalar.request.finished or self.scalar.request.cancel_requested

    def waiters_behind_scalar(self, step: Step) -> bool:
        first_token_out = self.scalar.request.emitted >= 1
        return self.config.preempt and first_token_out and not self.scalar_done(step) and bool(self._ready(step))

    def unarmed(self, step: Step) -> bool:
        return not self.batch.armed and self.batch.width > 0

    def over_cap(self, step: Step) -> bool:
        """Arrivals would take the batch over the cap, or one is too hot for speculation."""
        ready = self._ready(step)
        return bool(ready) and not self._speculates([r.request for r in self.batch.rows] + ready[:self._room(step)])

    def rearm_pays(self, step: Step) -> bool:
        rows, live = self.batch.rows, [r.request.remaining for r in self.batch.rows if not r.request.finished]
        return (self.kernels.speculative and self.config.resume and not self._ready(step) and bool(live)
                and self._speculates([r.request for r in rows]) and max(live) >= self.config.rearm.rearm_min_remaining
                and self.calm_rounds >= self.config.rearm.rearm_patience)

    def no_rows(self, step: Step) -> bool:
        return self.batch.width == 0

    # -- a step ------------------------------------------------------------------------
    def step(self, waiting: collections.deque, more_coming: bool) -> list:
        """Walk this state's ROUNDS once; the requests that left (finished, failed)."""
        step, left = Step(waiting, more_coming), []
        for name in ROUNDS[self.state]:
            if name not in TRIGGERS:
                self._hand_on(getattr(self, name)(step), left)
                continue
            source = self.state
            if self.trigger(name, step):  # transitions checks the guard and moves the state
                self._hand_on(getattr(self, HOOKS[(name, source)])(step), left)
                self._count(name, source)
                break
        return left

    def _hand_on(self, out: RoundOutput | None, left: list) -> None:
        if out is not None:
            self.deliver(out)
            left += out.done

    def _count(self, trigger: str, source: str) -> None:
        self.stats.transitions[f"{source}->{self.state}"] += 1
        log.info("transition", trigger=trigger, source=source, dest=self.state, width=self.width,
                 cap=self.config.speculative_width_cap)

    # -- what the engine reads ------------------------------------------------------------
    @property
    def width(self) -> int:
        return 1 if self.scalar else (self.batch.width if self.batch else 0)

    @property
    def busy(self) -> bool:
        return self.state != "Idle"

    def requests(self):
        if self.scalar:
            return [self.scalar.request]
        return [r.request for r in self.batch.rows] if self.batch else []

    def recover(self):
        """A round raised: fail the rows it touched, go back to Idle, keep serving."""
        failed = self.requests()
        self.scalar, self.batch = None, None
        if self.state != "Idle":  # a failed hook may fail before its transition completed
            self.stats.transitions[f"{self.state}->Idle"] += 1
            self.machine.set_state("Idle", model=self)
        return failed

    def gauges(self) -> dict:
        """Read on the engine thread after each step (the engine publishes a copy)."""
        loop = self.scalar or self.batch
        memory = loop.memory() if loop else {"kv_bytes": 0, "kv_used_bytes": 0, "drafter_kv_bytes": 0}
        return {"state": self.state, "width": self.width, **memory, **self.kernels.gauges()}

    def shutdown(self) -> None:
        self.scalar, self.batch = None, None
        self.kernels.forget(())
