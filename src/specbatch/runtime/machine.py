"""The speculative-batching state machine: Scalar, Batched, Gated.

    [*] --> Scalar: first request          Scalar --> [*]: request finishes, no waiters
    Scalar --> Batched: ready waiters      Batched --> Gated: over the cap
    Batched --> Batched: capture round (arms the batch)
    Gated --> Batched: back within the cap (re-arm: settle; the capture round follows)
    Batched --> [*], Gated --> [*]: last row finishes

``Idle`` is the diagram's ``[*]``. The machine decides; the loops run rounds. Guards are
pure (``may_<trigger>()`` evaluates them too); hooks only call the kernels, which are
built elsewhere (``kernels/build.py``) and reached through ``scheduler``'s Protocols: this
module imports no MLX. What a loop call produced goes straight to ``deliver`` (the core's
output stage), so a row ended by a stop string is gone before the next check reads it.
Vocabulary: *width* = rows in the batch; *cap* = ``speculative_width_cap``, the widest
batch that still speculates (inclusive; 0 = uncapped); a *ready* waiter may join now: its
prompt fits one prefill chunk, or a long prompt's chunks (the ``prefill`` action: one
between two of the live rows' rounds) are all done. Only ready waiters preempt, gate or
join while rows decode; at Idle nobody decodes, so every waiter is admitted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import structlog
from transitions import Machine

from .admission import room, within_budget
from .policy import AcceptanceBook
from .scheduler import BatchRounds, Kernels, ScalarRounds, take

if TYPE_CHECKING:
    from .output import RoundOutput

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
    ("drain", ["Batched", "Gated"], "Idle", "no_rows", "end_batch", "last row finishes"),
]

# What a state's round does, in order: a trigger fires when its guard holds and then ends
# the round; an action always runs. This is the one place that says, for instance, that
# the injection drain (``inject``) runs before a pending re-arm or capture, so an arrival
# over the cap trips the gate and a batch never arms over the cap.
ROUNDS = {
    "Idle": ("start_scalar", "start_batch", "start_plain"),
    "Scalar": ("finish", "preempt", "prefill", "scalar_round"),
    "Batched": ("gate", "inject", "drain", "capture", "prefill", "spec_round", "reap", "drain"),
    "Gated": ("inject", "count_calm", "drain", "rearm", "prefill", "plain_round", "reap"),
}
ACTIONS = ("inject", "count_calm", "prefill", "scalar_round", "spec_round", "plain_round", "reap")
GUARDS = {t: g for t, _, _, g, _, _ in TRANSITIONS}
_SOURCES = {t: (s if isinstance(s, list) else [s]) for t, s, *_ in TRANSITIONS}
assert all(step in ACTIONS or state in _SOURCES.get(step, ())
           for state, steps in ROUNDS.items() for step in steps), "ROUNDS names a step its state lacks"


def build_machine(model, cls=Machine, **kw) -> Machine:
    """The transitions machine over ``model`` (a SpecMachine, or a stub for charts)."""
    table = [dict(trigger=t, source=s, dest=d, conditions=g, after=h) for t, s, d, g, h, _ in TRANSITIONS]
    return cls(model=model, states=STATES, transitions=table, initial="Idle",
               auto_transitions=False, queued=True, **kw)


class SpecMachine:
    """The engine's scheduler: one state, one loop object at a time."""

    def __init__(self, kernels: Kernels, config, stats, deliver: Callable[[RoundOutput], None]):
        """``deliver(output)``: the core's output stage, called with each loop call's output."""
        self.kernels, self.config, self.stats, self.deliver = kernels, config, stats, deliver
        self.scalar: ScalarRounds | None = None
        self.batch: BatchRounds | None = None
        self.waiting, self.more_coming, self.done = None, False, []
        self.calm_rounds = 0  # gated rounds in a row spent within the cap (re-arm hysteresis)
        self.policy = config.policy()  # decides every round's draft (pure)
        self.book = AcceptanceBook(config.prior, config.num_draft_tokens)  # live rows' acceptance
        self.machine = build_machine(self)

    # -- guards (pure) ------------------------------------------------------------------
    @property
    def speculative(self) -> bool:
        return self.kernels.speculative

    def lone_arrival(self) -> bool:
        return self.speculative and len(self.waiting) == 1 and self._speculates(self.waiting)

    def burst_within_cap(self) -> bool:
        n = self._room()
        return self.speculative and n >= 2 and self._speculates(list(self.waiting)[:n])

    def plain_arrivals(self) -> bool:
        return bool(self.waiting) and not self.lone_arrival() and not self.burst_within_cap()

    def scalar_done(self) -> bool:
        return self.scalar.request.finished or self.scalar.request.cancel_requested

    def waiters_behind_scalar(self) -> bool:
        first_token_out = self.scalar.request.emitted >= 1
        return self.config.preempt and first_token_out and not self.scalar_done() and bool(self._ready())

    def unarmed(self) -> bool:
        return not self.batch.armed and self.batch.width > 0

    def over_cap(self) -> bool:
        """Arrivals would take the batch over the cap, or one is too hot for speculation."""
        ready = self._ready()
        joining = [r.request for r in self.batch.rows] + ready[:self._room()]
        return bool(ready) and not self._speculates(joining)

    def rearm_pays(self) -> bool:
        rows = self.batch.rows
        live = [r.request.remaining for r in rows if not r.request.finished]
        return (self.speculative and self.config.resume and not self._ready() and bool(live)
                and self._speculates([r.request for r in rows])
                and max(live) >= self.config.rearm_min_remaining
                and self.calm_rounds >= self.config.rearm_patience)

    def no_rows(self) -> bool:
        return self.batch.width == 0

    def _speculates(self, requests) -> bool:
        return self.policy.speculates([r.params.temperature for r in requests])

    # -- hooks ------------------------------------------------------------------------
    def begin_scalar(self) -> None:
        request = self.waiting.popleft()
        self.scalar, out = self.kernels.scalar(request)
        self.deliver(out)

    def begin_batch(self) -> None:
        self.batch = self.kernels.batch(self.speculative)
        self._admit()

    def end_scalar(self) -> None:
        self.kernels.retire(self.scalar)
        self.done.append(self.scalar.request)
        self.scalar = None
        self.kernels.forget(self.waiting)  # partial prefills of waiters that were cancelled

    def do_preempt(self) -> None:
        handoff = self.scalar.close()
        handoff.request.retire = False  # its prefix is not offered back to the prompt cache
        self.batch, self.scalar = self.kernels.batch(self.speculative), None
        self.deliver(self.batch.rebuild(handoff))
        log.info("preempt", request=handoff.request.id, undelivered=len(handoff.undelivered),
                 emitted=handoff.emitted, waiters=len(self.waiting))
        if handoff.request.finished:  # it ended inside its undelivered tail: it never joined
            self.done.append(handoff.request)

    def do_capture(self) -> None:
        self.deliver(self.batch.capture_round())
        log.info("capture", width=self.batch.width)

    def do_gate(self) -> None:
        self.batch.disarm()
        self.calm_rounds = 0
        log.info("gate", width=self.batch.width, waiting=len(self.waiting), cap=self.config.speculative_width_cap)

    def do_rearm(self) -> None:
        self.deliver(self.batch.settle())  # the gated round's lookahead already holds KV
        log.info("re-arm", width=self.batch.width, calm_rounds=self.calm_rounds)

    def end_batch(self) -> None:
        self.batch = None
        self.kernels.forget(self.waiting)

    # -- actions: the loops' work in a round (ROUNDS orders them) ----------------------
    def inject(self) -> None:
        """The injection drain: rows that ended leave, waiters join (settled first)."""
        loop = self.batch
        if self._ready() or any(r.request.finished or r.request.cancel_requested for r in loop.rows):
            self.deliver(loop.settle())
            self.done += loop.reap()
            self._admit()

    def count_calm(self) -> None:
        self.calm_rounds = self.calm_rounds + 1 if self.policy.within_cap(self.batch.width) else 0

    def prefill(self) -> None:
        """One chunk of the oldest long arrival still prefilling, between two rounds (a
        scalar round's buffered tokens go out first, one a step: they run no forward)."""
        self.kernels.forget(self.waiting)  # the partial prefills of waiters cancelled since
        if self.scalar is not None and self.scalar.buffered:
            return
        out = self.kernels.prefill_step(self._within_budget(self.requests(), list(self.waiting)))
        self.done += take(self.waiting, out.done)  # a failed prefill leaves without joining
        self.deliver(out)

    def scalar_round(self) -> None:
        self._observe(self.scalar.step(self._decide([self.scalar.request])))

    def spec_round(self) -> None:
        self._observe(self.batch.spec_round(self._decide([r.request for r in self.batch.rows])))

    def _decide(self, requests):
        self.book.keep(requests)  # the policy decides the round from the live rows' acceptance
        return self.policy.decide(self.book.rows(requests))

    def _observe(self, out) -> None:
        self.deliver(out)
        if out.verify is not None:  # a verify round updates its rows' acceptance
            self.book.observe(out.verified, out.verify.drafted, out.verify.accepted)

    def plain_round(self) -> None:
        pipelined = self.config.pipeline and not (self.more_coming or self._ready())
        self.deliver(self.batch.plain_round(successor=pipelined))

    def reap(self) -> None:
        if self.batch.settled:
            self.done += self.batch.reap()

    # -- rounds ---------------------------------------------------------------------------
    def step(self, waiting, more_coming: bool):
        self.waiting, self.more_coming, self.done = waiting, more_coming, []
        for name in ROUNDS[self.state]:
            if name in GUARDS:
                if self._fire(name):
                    break
            else:
                getattr(self, name)()
        return self.done

    def _admit(self) -> None:
        out = self.kernels.admit(self.batch, take(self.waiting, self._ready()[:self._room()]))
        self.deliver(out)
        self.done += out.done

    def _ready(self) -> list:
        """Waiters that may join, in arrival order (pure): while rows decode, short prompts
        and long ones whose chunks are all done; with none, all (nobody waits on a prefill)."""
        return [r for r in self.waiting if self.kernels.ready(r)] if self.requests() else list(self.waiting)

    def _room(self) -> int:
        return room(self.requests(), self._ready(), self.config, self.kernels)

    def _within_budget(self, live: list, waiters: list) -> list:
        return within_budget(live, waiters, self.config, self.kernels.token_bytes)

    def _fire(self, trigger: str) -> bool:
        """Fire ``trigger`` if its guard holds (then the round ends)."""
        if not getattr(self, GUARDS[trigger])():  # cheap pre-check: most rounds fire nothing
            return False
        before = self.state
        getattr(self, trigger)()
        self.stats.transitions[f"{before}->{self.state}"] += 1
        log.info("transition", trigger=trigger, source=before, dest=self.state, width=self.width,
                 cap=self.config.speculative_width_cap)
        return True

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

