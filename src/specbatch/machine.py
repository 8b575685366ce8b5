"""The speculative-batching state machine: Scalar, Batched, Gated.

    [*] --> Scalar: first request          Scalar --> [*]: request finishes, no waiters
    Scalar --> Batched: waiters (preempt)  Batched --> Gated: over the cap
    Gated --> Batched: back within the cap (re-arm)
    Batched --> [*], Gated --> [*]: last row finishes

``Idle`` is the diagram's ``[*]``. The machine decides; the loops run rounds. Guards are
pure (``may_<trigger>()`` evaluates them too); hooks only call loop methods.
Vocabulary: *width* = rows in the batch; *cap* = ``speculative_width_cap``, the widest
batch that still speculates (inclusive; 0 = uncapped).
"""

from __future__ import annotations

import structlog
from transitions import Machine

from .drafters.model import ModelDrafter
from .drafters.mtp import MTPDrafter, MTPHead
from .drafters.ngram import NGramDrafter, NGramSource
from .loops.batch import BatchLoop, held_tokens, retires
from .loops.scalar import ScalarLoop
from .prompt_cache import PromptCache
from .models import kv_bytes_per_token
from .runner import ModelRunner
from .scheduler import admit_each, take

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
    ("preempt", "Scalar", "Batched", "waiters_behind_scalar", "do_preempt", "waiters arrive"),
    ("gate", "Batched", "Gated", "over_cap", "do_gate", "over the cap"),
    ("rearm", "Gated", "Batched", "rearm_pays", "do_rearm", "back within the cap"),
    ("drain", ["Batched", "Gated"], "Idle", "no_rows", "end_batch", "last row finishes"),
]


GUARDS = {t: g for t, _, _, g, _, _ in TRANSITIONS}


def build_machine(model, cls=Machine, **kw) -> Machine:
    """The transitions machine over ``model`` (a SpecMachine, or a stub for charts)."""
    table = [dict(trigger=t, source=s, dest=d, conditions=g, after=h) for t, s, d, g, h, _ in TRANSITIONS]
    return cls(model=model, states=STATES, transitions=table, initial="Idle",
               auto_transitions=False, queued=True, **kw)


def make_drafter(source, runner, batch: bool):
    """A Drafter from its source: an MTP head on ``runner``, prompt lookup, or a draft model."""
    if isinstance(source, MTPHead):
        return MTPDrafter(source, runner)
    if isinstance(source, NGramSource):
        return NGramDrafter(source)
    return ModelDrafter(source.model, batch=batch)


class SpecMachine:
    """The engine's scheduler: one state, one loop object at a time."""

    def __init__(self, target, drafter, config, stats, drafter_factory=make_drafter):
        self.runner = ModelRunner(target.model)
        self.runner.kv_bits = config.kv_bits  # the batch loop's KV storage
        self.drafter_factory = drafter_factory  # (source, runner, batch) -> Drafter
        self.drafter_source = drafter if config.speculation else None  # a draft model or an MTP head
        self.config, self.stats = config, stats
        self.scalar: ScalarLoop | None = None
        self.batch: BatchLoop | None = None
        self.waiting, self.more_coming, self.done = None, False, []
        self.prompt_cache = PromptCache(config.prompt_cache_bytes)
        self.token_bytes = kv_bytes_per_token(target.model)
        self.calm_rounds = 0  # gated rounds in a row spent within the cap (re-arm hysteresis)
        self.machine = build_machine(self)

    # -- guards (pure) ------------------------------------------------------------------
    @property
    def speculative(self) -> bool:
        return self.drafter_source is not None and self.config.speculation

    def lone_arrival(self) -> bool:
        return self.speculative and len(self.waiting) == 1 and self.config.speculates_for(self.waiting)

    def burst_within_cap(self) -> bool:
        n = self._room()
        return self.speculative and n >= 2 and self.config.speculates_for(list(self.waiting)[:n])

    def plain_arrivals(self) -> bool:
        return bool(self.waiting) and not self.lone_arrival() and not self.burst_within_cap()

    def scalar_done(self) -> bool:
        return self.scalar.request.finished or self.scalar.request.cancel_requested

    def waiters_behind_scalar(self) -> bool:
        first_token_out = self.scalar.request.emitted >= 1
        return bool(self.waiting) and self.config.preempt and first_token_out and not self.scalar_done()

    def over_cap(self) -> bool:
        """Over the cap, or a row (or an arrival) too hot for speculation to pay."""
        joining = [r.request for r in self.batch.rows] + list(self.waiting)[:self._room()]
        return not self.config.speculates_for(joining)

    def rearm_pays(self) -> bool:
        rows = self.batch.rows
        live = [r.request.remaining for r in rows if not r.request.finished]
        return (self.speculative and self.config.resume and not self.waiting and bool(live)
                and self.config.speculates_for([r.request for r in rows])
                and max(live) >= self.config.rearm_min_remaining
                and self.calm_rounds >= self.config.rearm_patience)

    def no_rows(self) -> bool:
        return self.batch.width == 0

    # -- hooks ------------------------------------------------------------------------
    def begin_scalar(self) -> None:
        request = self.waiting.popleft()
        self.scalar = ScalarLoop(self.runner, self._drafter(batch=False), request,
                                 self.config.num_draft_tokens, self.config.verify, self.config.adaptive_k)
        self.scalar.limit_draft(self.config.draft_length([request]))
        cache, reused = self.prompt_cache.lookup(request.prompt)
        self.scalar.start(cache)
        log.info("admit", reused=reused, request=request.id, loop="scalar", prompt_tokens=len(request.prompt))

    def begin_batch(self) -> None:
        self.batch = self._new_batch()
        self.done += admit_each(self.batch, take(self.waiting, self._room()), self.prompt_cache)

    def end_scalar(self) -> None:
        request = self.scalar.request
        if retires(request):
            self.prompt_cache.retire(held_tokens(request), self.scalar.cache)
        self.done.append(request)
        self.scalar = None

    def do_preempt(self) -> None:
        handoff = self.scalar.close()
        handoff.request.retire = False  # its prefix is not offered back to the prompt cache
        self.batch, self.scalar = self._new_batch(), None
        self.batch.rebuild(handoff)
        log.info("preempt", request=handoff.request.id, undelivered=len(handoff.undelivered),
                 emitted=handoff.emitted, waiters=len(self.waiting))
        if handoff.request.finished:  # it ended inside its undelivered tail: it never joined
            self.done.append(handoff.request)

    def do_gate(self) -> None:
        self.batch.disarm()
        self.calm_rounds = 0
        log.info("gate", width=self.batch.width, waiting=len(self.waiting), cap=self.config.speculative_width_cap)

    def do_rearm(self) -> None:
        self._capture()

    def end_batch(self) -> None:
        self.batch = None

    # -- rounds, by state ------------------------------------------------------------------
    def step(self, waiting, more_coming: bool):
        self.waiting, self.more_coming, self.done = waiting, more_coming, []
        getattr(self, f"_round_{self.state.lower()}")()
        return self.done

    def _round_idle(self) -> None:
        for trigger in ("start_scalar", "start_batch", "start_plain"):
            if self._fire(trigger):
                return

    def _round_scalar(self) -> None:
        if self._fire("finish") or self._fire("preempt"):
            return
        self.stats.rounds += self.scalar.step()
        if self.scalar.last_round is not None:
            self.stats.record_round([self.scalar.request], self.scalar.last_round)

    def _round_batched(self) -> None:
        if self.waiting and self._fire("gate"):
            return  # the drain runs first: over the cap, admission happens gated
        self.done += self.batch.reap()
        if self.waiting:
            self.done += admit_each(self.batch, take(self.waiting, self._room()),
                                    self.prompt_cache)
        if self._fire("drain"):
            return
        if not self.batch.armed:
            self._capture()
            return
        requests = [r.request for r in self.batch.rows]
        self.batch.limit_draft(self.config.draft_length(requests))  # the schedule's k at this width
        result = self.batch.spec_round()
        self.stats.rounds += 1
        if result is not None:
            self.stats.record_round(requests, result)
            log.debug("verify", width=len(requests), k=result.drafted, accepted=result.accepted)
        self.done += self.batch.reap()
        self._fire("drain")

    def _round_gated(self) -> None:
        loop = self.batch
        if self.waiting or any(r.request.finished or r.request.cancel_requested for r in loop.rows):
            loop.settle()
            self.done += loop.reap()
            self.done += admit_each(loop, take(self.waiting, self._room()), self.prompt_cache)
        self.calm_rounds = self.calm_rounds + 1 if self.config.speculates_at(loop.width) else 0
        if self._fire("drain") or self._fire("rearm"):
            return
        loop.plain_round(successor=self.config.pipeline and not (self.more_coming or self.waiting))
        self.stats.rounds += 1
        if loop.settled:
            self.done += loop.reap()

    def _capture(self) -> None:
        emitted = self.batch.capture_round()
        self.stats.rounds += 1
        log.info("capture", width=self.batch.width, emitted=emitted)

    def _room(self) -> int:
        """Waiters the next drain may admit: within max_batch rows and the KV budget
        (each row reserves its prompt, its budget and a verify's lookahead)."""
        live = self.requests()
        n = min(len(self.waiting), self.config.max_batch - len(live))
        budget, k = self.config.kv_budget_bytes, self.config.num_draft_tokens
        if not budget or not self.token_bytes:
            return n
        need = sum(len(r.prompt) + r.params.max_tokens + k + 1 for r in live) * self.token_bytes
        for i in range(n):
            r = self.waiting[i]
            need += (len(r.prompt) + r.params.max_tokens + k + 1) * self.token_bytes
            if need > budget:
                return max(i, int(not live))  # an idle engine still takes one, or nothing runs
        return n

    def _new_batch(self) -> BatchLoop:
        drafter = self._drafter(batch=True) if self.speculative else None
        loop = BatchLoop(self.runner, drafter, self.config.num_draft_tokens, self.config.verify,
                         self.config.adaptive_k)
        loop.retire = self.prompt_cache.retire
        return loop

    def _drafter(self, batch: bool):
        return self.drafter_factory(self.drafter_source, self.runner, batch)

    def _fire(self, trigger: str) -> bool:
        """Fire ``trigger`` if its guard holds; True when the state changed."""
        if not getattr(self, GUARDS[trigger])():  # cheap pre-check: most rounds fire nothing
            return False
        before = self.state
        getattr(self, trigger)()
        if self.state == before:
            return False
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
        kv, scalar = (self.batch.kv if self.batch else None), self.scalar
        drafter = scalar.drafter if scalar else (self.batch.drafter if self.batch else None)
        scalar_kv = sum(c.nbytes for c in scalar.cache) if scalar else 0
        return {"state": self.state, "width": self.width,
                "kv_bytes": (kv.nbytes if kv else 0) + scalar_kv,
                "kv_used_bytes": kv.used_bytes() if kv else scalar_kv,
                "drafter_kv_bytes": drafter.nbytes() if drafter else 0,
                "prompt_cache_hits": self.prompt_cache.hits, "prompt_cache_misses": self.prompt_cache.misses,
                "prompt_cache_bytes": self.prompt_cache.nbytes, "prompt_cache_entries": len(self.prompt_cache)}

    def shutdown(self) -> None:
        self.scalar, self.batch = None, None

