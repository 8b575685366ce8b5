"""The scalar loop: one request decoding alone, speculating with coupled sampling.

Drafts use the target's own position-keyed noise, so a sampled draft is accepted
against a sampled target whenever both land on the same token: the highest acceptance,
and no batch bookkeeping. Tokens go out one at a time (``step``); the loop can be
closed between any two, and ``close`` returns a ``Handoff`` from which the batch loop
rebuilds the request without losing, repeating or re-sampling a token.
"""

from __future__ import annotations

import collections

import attrs
import mlx.core as mx

from ...runtime.output import RoundOutput
from ...runtime.request import Request
from ..logprobs import sample_read
from ..runner import TargetRunner, prefill
from ..sampling import RowSampling, positions_from
from .tree import tree_capable, tree_round
from .verify import RoundResult, bonus_hidden, last_hidden, next_k, spec_round


@attrs.frozen
class Handoff:
    """A closed scalar generation, ready to rebuild in the batch loop.

    ``undelivered``: the round's verified tokens not yet emitted (they go out first; their
    KV is already in ``target_cache``). ``pending``: the bonus token the next round starts
    from. ``emitted``: the real emitted count at close time.
    """

    request: Request
    undelivered: list[int]
    pending: int
    prev: int
    emitted: int
    target_cache: list
    drafter: object | None
    logprobs: list = attrs.field(factory=list)  # parallel to undelivered (None: not asked)


class ScalarLoop:
    """One request; speculative rounds with coupled drafting (or plain without a drafter)."""

    def __init__(self, target: TargetRunner, drafter, request: Request, k: int, verify: str = "coupled",
                 adaptive: bool = False, tree=None):
        self.target, self.drafter, self.request = target, drafter, request
        self.k, self.verify = k, verify
        self.tree = tree  # a TreeShape with branching (None or a chain: chain rounds)
        self.adaptive, self.k_now = adaptive, k  # k_now: this round's draft length
        self.cache = target.make_cache()
        self._buffer: collections.deque[tuple] = collections.deque()  # (token, TokenLogprob | None)
        self._rows = RowSampling.of([request.params], [request.tokens])
        self.pending = self.prev = -1
        self.last_round: RoundResult | None = None  # this step's verify round, if one ran

    def limit_draft(self, k: int) -> None:
        """Draft at most ``k`` per round from now on (the schedule's k at this width; 0:
        plain rounds). Adaptive rounds keep their current length where it is smaller."""
        self.k, self.k_now = k, (min(self.k_now, k) if self.adaptive else k)

    def start(self, cache: list | None = None, logits=None, hidden=None) -> RoundOutput:
        """Prefill (the rest past ``cache``), emit the first token, and prefill the drafter's
        copy of the history. ``logits`` ``[1, V]`` (and ``hidden``): the prompt is all in
        ``cache`` already (a chunked prefill), so nothing is prefilled here."""
        if cache is not None:
            self.cache = cache
        if logits is None:
            have = self.cache[0].offset if self.cache[0].keys is not None else 0
            logits = prefill(self.target, self.request.prompt[have:], self.cache)
            hidden = last_hidden(self.target)
        [[first]], [lps] = sample_read(logits[:, None, :], self._rows, positions_from([0], 1))
        self.prev, self.pending = self.request.prompt[-1], first
        out = RoundOutput()
        if not out.emit(self.request, first, lps and lps[0]) and self.drafter is not None:
            self.drafter.add_rows([self.request.prompt + [first]], hidden=hidden)
        return out

    @property
    def finished(self) -> bool:
        return self.request.finished

    @property
    def buffered(self) -> int:
        """Tokens of the last round still to go out (one a step, no forward)."""
        return len(self._buffer)

    def step(self) -> RoundOutput:
        """Deliver one token (running a round when none is buffered)."""
        self.last_round = None
        if not self._buffer:
            self._round()
        out = RoundOutput(round=True)
        if self.last_round is not None:
            out.verify, out.verified = self.last_round, [self.request]
        if out.emit(self.request, *self._buffer.popleft()):
            self._buffer.clear()  # nothing after a finish goes out
        return out

    def memory(self) -> dict:
        kv = sum(c.nbytes for c in self.cache)
        return {"kv_bytes": kv, "kv_used_bytes": kv,
                "drafter_kv_bytes": self.drafter.nbytes() if self.drafter else 0}

    def _round(self) -> None:
        k = min(self.k_now, self.request.remaining - 1)
        if self.drafter is None or k < 1:
            self._plain()
            return
        # a tree adapts by its shape (pruned by drafted probability), as calibrated: the
        # adaptive chain length does not cut it
        tree_k = min(self.k, self.request.remaining - 1)
        tree = self._tree_at(tree_k)
        if tree:
            result = tree_round(self.target, self.cache, self.drafter, [self.pending], [self.prev], self._rows,
                                [self.request.emitted], self.tree.cut(tree_k))
        else:
            result = spec_round(self.target, self.cache, self.drafter, [self.pending], [self.prev], self._rows,
                                [self.request.emitted], k, self.verify, coupled=True)
            a = result.accepted[0]
            for c in self.cache:
                c.trim(k - a)
            self.drafter.rollback([k - a], hidden=bonus_hidden(self.target, result.accepted))
        if self.adaptive and not tree:
            self.k_now = next_k(self.k_now, self.k, result)
        run = result.emitted[0]
        self.prev, self.pending = (run[-2] if len(run) > 1 else self.pending), run[-1]
        self._buffer.extend(zip(run, result.row_logprobs(0)))
        self.last_round = result

    def _tree_at(self, k: int) -> bool:
        """This round drafts a tree: a branching shape (cut to ``k`` levels), a drafter and
        target that can, and coupled verification (rejection sampling stays on chains)."""
        if self.tree is None or self.tree.cut(k).is_chain or self._rows.penalized:  # trees: no penalties
            return False
        coupled = self.verify == "coupled" or self._rows.all_greedy
        return coupled and tree_capable(self.target, self.drafter)

    def _plain(self) -> None:
        logits = self.target.forward(mx.array([[self.pending]], dtype=mx.int32), self.cache)
        [[token]], [lps] = sample_read(logits, self._rows, positions_from([self.request.emitted], 1))
        self.prev, self.pending = self.pending, token
        self._buffer.append((token, lps and lps[0]))

    def close(self) -> Handoff:
        """Stop here (usually mid-round) and hand everything to the batch loop."""
        handoff = Handoff(self.request, [t for t, _ in self._buffer], self.pending, self.prev,
                          self.request.emitted, self.cache, self.drafter, [lp for _, lp in self._buffer])
        self._buffer.clear()
        return handoff

