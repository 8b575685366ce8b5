"""The scalar loop: one request decoding alone, speculating with coupled sampling.

Drafts use the target's own position-keyed noise, so a sampled draft is accepted
against a sampled target whenever both land on the same token: the highest acceptance,
and no batch bookkeeping. Tokens go out one at a time (``step``); the loop can be
closed between any two, and ``close`` returns a ``Handoff`` from which the batch loop
rebuilds the request without losing, repeating or re-sampling a token.

Its KV is the engine's layout for one row: under the paged default the prompt is prefilled
into single-sequence caches and then moved into a one-row paged cache, whose blocked keys
the CPU kernels (the decoder stack, the MTP head's step) read in place; dense or quantized
layouts keep mlx-lm's single-sequence caches (``SingleKV``).
"""

from __future__ import annotations

import collections

import attrs
import mlx.core as mx

from ...runtime.output import RoundOutput
from ...runtime.policy import PLAIN, Decision
from ...runtime.request import Request
from ..drafters.lookup import History, Proposed
from ..kv import BatchKV
from ..logprobs import sample_read
from ..paged_kv import KVLayout, PagedKV
from ..runner import TargetRunner
from ..sampling import RowSampling, positions_from
from ..single_kv import SingleKV
from .round import advance, first_token, follow_plain, speculate
from .verify import RoundResult


@attrs.frozen
class Handoff:
    """A closed scalar generation, ready to rebuild in the batch loop.

    ``undelivered``: the round's verified tokens not yet emitted (they go out first; their
    KV is already in ``kv``, a one-row batch cache). ``pending``: the bonus token the next
    round starts from. ``emitted``: the real emitted count at close time.
    """

    request: Request
    undelivered: list[int]
    pending: int
    prev: int
    emitted: int
    kv: BatchKV
    logprobs: list = attrs.field(factory=list)  # parallel to undelivered (None: not asked)


class ScalarLoop:
    """One request; speculative rounds with coupled drafting (or plain without a drafter)."""

    def __init__(self, target: TargetRunner, drafter, request: Request, verify: str = "coupled",
                 layout: KVLayout = KVLayout(), lookup_match: int = 0):
        self.target, self.drafter, self.request, self.verify = target, drafter, request, verify
        self.layout = layout
        # where the stream's last lookup_match tokens occurred before, a round the policy
        # allows drafts what followed them (a drafter whose state is the target's only)
        usable = lookup_match > 0 and getattr(drafter, "target_state_only", False)
        self.lookup_match, self.history = (lookup_match, History(request.prompt)) if usable else (0, None)
        self.kv: SingleKV | PagedKV = SingleKV(target.make_cache())
        self._buffer: collections.deque[tuple] = collections.deque()  # (token, TokenLogprob | None)
        self._rows = RowSampling.of([request.params], [request.tokens])
        self.pending = self.prev = -1
        self.last_round: RoundResult | None = None  # this step's verify round, if one ran

    def start(self, cache: list | None = None, logits=None, hidden=None) -> RoundOutput:
        """Prefill (the rest past ``cache``), emit the first token, and prefill the drafter's
        copy of the history. ``logits`` ``[1, V]`` (and ``hidden``): the prompt is all in
        ``cache`` already (a chunked prefill), so nothing is prefilled here."""
        single = cache if cache is not None else self.kv.layers
        first, logprob, hidden = first_token(self.target, self.request, single, self._rows, logits, hidden)
        self.kv = self._rows_of(single)
        self.prev, self.pending = self.request.prompt[-1], first
        out = RoundOutput()
        if not out.emit(self.request, first, logprob) and self.drafter is not None:
            self.drafter.add_rows([self.request.prompt + [first]], hidden=hidden)
        return out

    def _rows_of(self, single: list) -> SingleKV | PagedKV:
        """The KV the rounds run over, holding the prefilled ``single`` caches' tokens."""
        if self.layout.kind != "paged" or self.layout.bits:
            return SingleKV(single)
        kv = self.layout.empty(len(single))
        kv.extend(BatchKV.from_singles(single))
        return kv

    @property
    def cache(self) -> list:
        """The target's caches the rounds run over, one per layer (a one-row paged cache's
        layers, or single-sequence caches)."""
        return self.kv.layers

    def singles(self, n: int | None = None) -> list:
        """The row's KV (its first ``n`` tokens where it is a batch's) as mlx-lm single-sequence
        caches, one per layer (the prompt cache's)."""
        return self.kv.layers if isinstance(self.kv, SingleKV) else self.kv.extract(0, n)

    @property
    def finished(self) -> bool:
        return self.request.finished

    @property
    def buffered(self) -> int:
        """Tokens of the last round still to go out (one a step, no forward)."""
        return len(self._buffer)

    def step(self, decision: Decision = PLAIN) -> RoundOutput:
        """Deliver one token (running a round as ``decision`` says when none is buffered)."""
        self.last_round = None
        if not self._buffer:
            self._round(decision.within(self.request.remaining - 1))
        out = RoundOutput(round=True)
        if self.last_round is not None:
            out.verify, out.verified = self.last_round, [self.request]
        if out.emit(self.request, *self._buffer.popleft()):
            self._buffer.clear()  # nothing after a finish goes out
        return out

    def memory(self) -> dict:
        kv = self.kv.nbytes
        used = kv if isinstance(self.kv, SingleKV) else self.kv.used_bytes()
        return {"kv_bytes": kv, "kv_used_bytes": used,
                "drafter_kv_bytes": self.drafter.nbytes() if self.drafter else 0}

    def _round(self, decision: Decision) -> None:
        drafter, proposal = self.drafter, self._proposal(decision.lookup)
        if proposal:
            drafter, decision = Proposed(self.drafter, proposal, self.target.vocab_size), Decision(len(proposal))
        elif self.drafter is None or decision.plain:
            self._plain()
            return
        result = speculate(self.target, self.kv, drafter, [self.pending], [self.prev], self._rows,
                           [self.request.emitted], decision, self.verify, coupled=True)
        if proposal:
            result = attrs.evolve(result, lookup=True)
        run = result.emitted[0]
        self.prev, self.pending = advance(self.prev, self.pending, run)
        self._buffer.extend(zip(run, result.row_logprobs(0)))
        self.last_round = result

    def _proposal(self, most: int) -> list[int]:
        """Up to ``most`` lookup drafts for this round (the stream so far ends with the pending
        token, every earlier round's tokens having gone out); empty where it has none."""
        if self.history is None or most < 1:
            return []
        self.history.sync(self.request.tokens, len(self.request.prompt))
        return self.history.proposal(self.lookup_match, most)

    def _plain(self) -> None:
        logits = self.target.forward(mx.array([[self.pending]], dtype=mx.int32), self.cache)
        [[token]], [lps] = sample_read(logits, self._rows, positions_from([self.request.emitted], 1))
        passed, self.prev, self.pending = self.prev, self.pending, token
        self._buffer.append((token, lps and lps[0]))
        if self.drafter is not None:  # the drafter follows (a head one from the state that predicted the pending token)
            follow_plain(self.target, self.drafter, [passed])

    def close(self) -> Handoff:
        """Stop here (usually mid-round) and hand everything to the batch loop."""
        kv = BatchKV.from_singles(self.cache) if isinstance(self.kv, SingleKV) else self.kv
        handoff = Handoff(self.request, [t for t, _ in self._buffer], self.pending, self.prev,
                          self.request.emitted, kv, [lp for _, lp in self._buffer])
        self._buffer.clear()
        return handoff

