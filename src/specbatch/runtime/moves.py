"""The machine's moves: each transition's hook and each action of a step (``machine.ROUNDS``).

They call the kernels (through ``scheduler``'s Protocols) and return what the loops
produced, a ``RoundOutput`` (its ``done``: requests that left) or None; they decide
nothing: ``SpecMachine`` (which these are the methods of) fires a hook only once its
guard held. The helpers at the end (``_ready``, ``_room``, ``_speculates``) are pure; the
guards read them too.
"""

from __future__ import annotations

import collections

import attrs
import structlog

from .admission import room, within_budget
from .output import RoundOutput
from .policy import PLAIN
from .scheduler import take

log = structlog.get_logger(__name__)


@attrs.define
class Step:
    """What one step's guards read besides the loops: the waiting list (rows join from it)
    and whether callers queued more after this step's plan was cut."""

    waiting: collections.deque
    more_coming: bool = False


class Moves:
    """Hooks and actions over ``self.scalar`` / ``self.batch`` (the machine's loops)."""

    # -- hooks: a transition's work, run once it fired ----------------------------------
    def begin_scalar(self, step: Step) -> RoundOutput:
        self.scalar, out = self.kernels.scalar(step.waiting.popleft())
        return out

    def begin_batch(self, step: Step) -> RoundOutput:
        self.batch = self.kernels.batch(self.kernels.speculative)
        return self._admit(step)

    def end_scalar(self, step: Step) -> RoundOutput:
        self.kernels.retire(self.scalar)
        request, self.scalar = self.scalar.request, None
        self.kernels.forget(step.waiting)  # partial prefills of waiters that were cancelled
        return RoundOutput(done=[request])

    def do_preempt(self, step: Step) -> RoundOutput:
        handoff = self.scalar.close()
        handoff.request.retire = False  # its prefix is not offered back to the prompt cache
        self.batch, self.scalar = self.kernels.batch(self.kernels.speculative), None
        out = self.batch.rebuild(handoff)
        log.info("preempt", request=handoff.request.id, undelivered=len(handoff.undelivered),
                 emitted=handoff.emitted, waiters=len(step.waiting))
        if handoff.request.finished:  # it ended inside its undelivered tail: it never joined
            out.done.append(handoff.request)
        return out

    def do_capture(self, step: Step) -> RoundOutput:
        log.info("capture", width=self.batch.width)
        return self.batch.capture_round()

    def do_gate(self, step: Step) -> None:
        self.batch.disarm()
        self.calm_rounds = 0
        log.info("gate", width=self.batch.width, waiting=len(step.waiting), cap=self.config.speculative_width_cap)

    def do_rearm(self, step: Step) -> RoundOutput:
        log.info("re-arm", width=self.batch.width, calm_rounds=self.calm_rounds)
        return self.batch.settle()  # the gated round's lookahead already holds KV

    def end_batch(self, step: Step) -> None:
        self.batch = None
        self.kernels.forget(step.waiting)

    # -- actions: the loops' work in a step (ROUNDS orders them) -------------------------
    def inject(self, step: Step) -> RoundOutput | None:
        """Injection: rows that ended leave, waiters join (the batch settled first)."""
        loop = self.batch
        if not (self._ready(step) or any(r.request.finished or r.request.cancel_requested for r in loop.rows)):
            return None
        out = loop.settle()
        out.done += loop.reap()
        return out.merge(self._admit(step))

    def count_calm(self, step: Step) -> None:
        self.calm_rounds = self.calm_rounds + 1 if self.policy.within_cap(self.batch.width) else 0

    def prefill(self, step: Step) -> RoundOutput | None:
        """One chunk of the oldest long arrival still prefilling, between two rounds (a
        scalar round's buffered tokens go out first, one a step: they run no forward)."""
        self.kernels.forget(step.waiting)  # the partial prefills of waiters cancelled since
        if self.scalar is not None and self.scalar.buffered:
            return None
        out = self.kernels.prefill_step(within_budget(self.requests(), list(step.waiting), self.config,
                                                      self.kernels.token_bytes))
        take(step.waiting, out.done)  # a failed prefill leaves without joining
        return out

    def scalar_round(self, step: Step) -> RoundOutput:
        requests = [self.scalar.request]
        return self._observe(requests, self.scalar.step(self._decide(requests)))

    def spec_round(self, step: Step) -> RoundOutput:
        requests = [r.request for r in self.batch.rows]
        return self._observe(requests, self.batch.spec_round(self._decide(requests)))

    def plain_round(self, step: Step) -> RoundOutput:
        pipeline = self.kernels.spare_core if self.config.pipeline is None else self.config.pipeline
        pipelined = pipeline and not (step.more_coming or self._ready(step))
        return self.batch.plain_round(successor=pipelined)

    def reap(self, step: Step) -> RoundOutput | None:
        return RoundOutput(done=self.batch.reap()) if self.batch.settled else None

    def _decide(self, requests):
        self.book.keep(requests)  # the policy decides the round from the live rows' acceptance
        rows = self.book.rows(requests)
        decision = self.policy.decide(rows, self.decided or PLAIN)
        if decision != self.decided:  # logged when it changes, with what it weighed
            self.decided = decision
            log.debug("decide", width=len(rows), k=decision.k, tree=str(decision.tree) if decision.tree else None,
                      tok_s=round(self.policy.rate(rows, decision), 2), plain_tok_s=round(self.policy.rate(rows, PLAIN), 2),
                      acceptance=[round(a, 2) for a in rows[0].acceptance[:4]])
        return decision

    def _observe(self, requests, out: RoundOutput) -> RoundOutput:
        if out.verify is not None:  # a verify round updates its rows' acceptance (a lookup round, their lookups')
            self.book.observe(out.verified, out.verify.drafted, out.verify.accepted, lookup=out.verify.lookup)
        else:  # decided plain: the rows drift back toward the prior, to be tried again
            self.book.relax(requests)
        return out

    def _admit(self, step: Step) -> RoundOutput:
        return self.kernels.admit(self.batch, take(step.waiting, self._ready(step)[:self._room(step)]))

    # -- pure helpers (the guards read them too) ------------------------------------
    def _speculates(self, requests) -> bool:
        return self.policy.speculates([r.params.temperature for r in requests])

    def _ready(self, step: Step) -> list:
        """Waiters that may join, in arrival order: while rows decode, short prompts and
        long ones whose chunks are all done; with none, all (nobody waits on a prefill)."""
        return [r for r in step.waiting if self.kernels.ready(r)] if self.requests() else list(step.waiting)

    def _room(self, step: Step) -> int:
        return room(self.requests(), self._ready(step), self.config, self.kernels)
