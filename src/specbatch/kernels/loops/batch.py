"""The batch loop: two or more rows decoding together on one ragged target cache.

Per row it tracks the KV offset (in the ragged cache), the budget and finished flag (on
the request) and the *pending* token: the last emitted token, not yet in the target
cache, which the next round starts from (after a verify round, the bonus token).

Armed, it speculates: greedy drafting for all rows at once (coupled noise does not
extend across rows), one verify forward over ``B x (k+1)``, per-row accepted counts and
per-row rollback on the ragged caches; or, where a tree is calibrated for the width, one
greedy token tree per row verified in one forward (``loops/tree``). Unarmed, it runs plain rounds and leaves the
drafter untouched (no drafter rows). Arming runs a *capture round*: one plain,
one-position forward of each row's pending token that emits one token per row, after
which the drafter cold-starts from the captured rows.

Plain rounds may pipeline (the machine asks where the host has a core of its own): a round
dispatches the next round's forward before reading its own tokens (``mx.async_eval``), so
Python overhead hides behind compute. That successor
has already appended its KV, so any structural change (admit, remove, arm) first
*settles*: one more plain round that dispatches no successor consumes the lookahead.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
import structlog

from ...runtime.output import RoundOutput
from ...runtime.policy import Decision
from ...runtime.request import Request
from ..drafters.base import Capture
from ..kv import BatchKV
from ..logprobs import gather, read, sample_read
from ..paged_kv import KVLayout
from ..runner import TargetRunner, prefill_batch
from ..sampling import RowSampling, positions_from, sample
from .round import advance, first_token, follow_plain, speculate
from .verify import last_hidden

log = structlog.get_logger(__name__)


@attrs.define(eq=False)
class Row:
    request: Request
    pending: int  # last emitted token; the next round feeds it to the target
    prev: int  # the token before ``pending`` (drafters feed [prev, pending])


class BatchLoop:
    """Decode rounds over many rows; rows join and leave only between rounds."""

    def __init__(self, target: TargetRunner, drafter=None, verify: str = "coupled", layout: KVLayout = KVLayout()):
        self.target, self.drafter, self.verify = target, drafter, verify
        self.armed = False  # the drafter holds one row per loop row
        self.retire = None  # callable(tokens, single caches): the prompt cache's intake
        self.rows: list[Row] = []
        self.kv = layout.empty(target.n_layers)
        self._lookahead: tuple | None = None  # lazy (tokens [B, 1], LazyLogprobs | None) of a dispatched forward
        self._sampling: RowSampling | None = None

    @property
    def width(self) -> int:
        return len(self.rows)

    @property
    def settled(self) -> bool:
        return self._lookahead is None

    # -- admission --------------------------------------------------------------------
    def admit(self, request: Request, cache: list | None = None, logits=None, hidden=None) -> RoundOutput:
        """Prefill one request (the rest past ``cache``), emit its first token and add it as a
        row (if it goes on). ``logits`` ``[1, V]`` (and ``hidden``): its prompt is all in
        ``cache`` already (a chunked prefill), so nothing is prefilled here.

        Armed, the row joins the drafter too; the machine admits into an armed loop only
        while the batch stays within the cap."""
        assert self.settled, "admit only between settled rounds"
        single = cache if cache is not None else self.target.make_cache()
        rows = RowSampling.of([request.params], [request.tokens])
        first, logprob, hidden = first_token(self.target, request, single, rows, logits, hidden)
        out = RoundOutput()
        if not out.emit(request, first, logprob):
            self.add_row(Row(request, first, request.prompt[-1]), BatchKV.from_singles(single), hidden)
        return out

    def admit_many(self, requests: list[Request]) -> RoundOutput:
        """Prefill several requests in one left-padded forward; emit each first token and
        add the rows that go on (a burst costs one prefill, not one per request)."""
        assert self.settled, "admit only between settled rounds"
        logits, kv = prefill_batch(self.target, [r.prompt for r in requests])  # [B, V]
        hidden = last_hidden(self.target)  # [B, D] or None
        rows = RowSampling.of([r.params for r in requests], [r.tokens for r in requests])
        toks, lps = sample_read(logits[:, None, :], rows, positions_from([0] * len(requests), 1))
        firsts = [t[0] for t in toks]
        out = RoundOutput()
        keep = [i for i, (r, t, lp) in enumerate(zip(requests, firsts, lps)) if not out.emit(r, t, lp and lp[0])]
        if not keep:
            return out
        if len(keep) < len(requests):
            kv.filter(keep)
            hidden = None if hidden is None else hidden[mx.array(keep)]
        new = [Row(requests[i], firsts[i], requests[i].prompt[-1]) for i in keep]
        self.kv.extend(kv)
        self.rows += new
        self._sampling = None
        if self.armed:
            self.drafter.add_rows([_history(r) for r in new], hidden=hidden)
        return out

    def add_row(self, row: Row, kv: BatchKV, hidden=None) -> None:
        """Append a row whose target KV holds everything before ``row.pending``."""
        assert self.settled
        self.kv.extend(kv)
        self.rows.append(row)
        self._sampling = None
        if self.armed:
            self.drafter.add_rows([_history(row)], hidden=hidden)

    def rebuild(self, handoff) -> RoundOutput:
        """The rebuild entry: a preempted scalar request joins, unarmed, from its handoff.

        Its verified, undelivered tokens go out first (their KV is already cached); it
        restarts from the round's bonus token with its real emitted count."""
        request, out = handoff.request, RoundOutput()
        lps = handoff.logprobs or [None] * len(handoff.undelivered)
        for token, logprob in zip(handoff.undelivered, lps):
            if out.emit(request, token, logprob):
                return out
        self.add_row(Row(request, handoff.pending, handoff.prev), handoff.kv)
        return out

    # -- arming ---------------------------------------------------------------------------
    def capture_round(self) -> RoundOutput:
        """Emit one token per row at plain cost (settled first), cold-start the drafter; arm."""
        out = self.settle().merge(self.plain_round(successor=False))
        self.drafter.cold_start(Capture([_history(r) for r in self.rows], last_hidden(self.target)))
        self.armed = True
        return out

    def disarm(self) -> None:
        """Gate: plain rounds from here on; the drafter drops its rows."""
        if self.armed:
            self.drafter.reset()
        self.armed = False

    def spec_round(self, decision: Decision) -> RoundOutput:
        """One armed round as ``decision`` says: draft, verify, accept, emit per row, roll
        back per row (plain where it drafts nothing)."""
        assert self.settled and self.armed
        decision = decision.within(max(r.request.remaining for r in self.rows) - 1)
        if decision.plain:  # the drafter follows the rows past this round's token
            passed = [r.prev for r in self.rows]
            out = self.plain_round(successor=False)
            follow_plain(self.target, self.drafter, passed)
            return out
        result = speculate(self.target, self.kv, self.drafter, [r.pending for r in self.rows],
                           [r.prev for r in self.rows], self._rows_sampling(), [r.request.emitted for r in self.rows],
                           decision, self.verify, coupled=False)
        out = RoundOutput(verify=result, verified=[r.request for r in self.rows], round=True)
        for i, (row, run) in enumerate(zip(self.rows, result.emitted)):
            for token, logprob in zip(run, result.row_logprobs(i)):
                if out.emit(row.request, token, logprob):
                    break  # finished inside the accepted run: nothing after it
            row.prev, row.pending = advance(row.prev, row.pending, run)
        return out

    def reap(self) -> list[Request]:
        """Remove finished and cancelled rows (between settled rounds); return them."""
        assert self.settled
        gone = [i for i, r in enumerate(self.rows) if r.request.finished or r.request.cancel_requested]
        if not gone:
            return []
        keep = [i for i in range(self.width) if i not in gone]
        out = [self.rows[i].request for i in gone]
        for i in gone:
            if self.retire is not None and retires(self.rows[i].request):
                held = held_tokens(self.rows[i].request)
                self.retire(held, self.kv.extract(i, len(held)))
        self.kv.filter(keep)
        if self.armed:
            self.drafter.filter(keep)
        self.rows = [self.rows[i] for i in keep]
        self._sampling = None
        return out

    def _rows_sampling(self) -> RowSampling:
        if self._sampling is None:
            self._sampling = RowSampling.of([r.request.params for r in self.rows], [r.request.tokens for r in self.rows])
        return self._sampling

    def _dispatch(self, tokens: mx.array, ahead: int) -> tuple:
        """Lazily forward tokens ``[B]``, sample the next ``[B, 1]`` and gather the logprobs of
        rows that asked (``ahead`` = unread)."""
        logits = self.target.forward(tokens[:, None], self.kv.layers)  # [B, 1, V]
        positions = positions_from([r.request.emitted + ahead for r in self.rows], 1)
        rows = self._rows_sampling()
        sampled = sample(logits, rows, positions, tokens[:, None] if ahead else None)  # [B, 1]
        return sampled, gather(logits, sampled, rows.logprobs)

    def plain_round(self, successor: bool = True) -> RoundOutput:
        """One token per live row."""
        if self._lookahead is None:
            pending = mx.array([r.pending for r in self.rows], dtype=mx.int32)
            self._lookahead = self._dispatch(pending, 0)
        current = self._lookahead
        live = not any(r.request.finished or r.request.cancel_requested for r in self.rows)
        if successor and live:
            tokens, lazy = self._lookahead = self._dispatch(current[0][:, 0], 1)
            mx.async_eval(tokens, *(lazy.arrays() if lazy else ()))
        else:
            self._lookahead = None
        out = RoundOutput(round=True)
        toks, lps = read(*current)
        for row, [token], lp in zip(self.rows, toks, lps):
            if row.request.finished:
                continue  # its successor slot is discarded at the next settle
            row.prev, row.pending = row.pending, token
            out.emit(row.request, token, lp and lp[0])
        return out

    def settle(self) -> RoundOutput:
        """Consume an in-flight lookahead (emitting its tokens); a no-op when settled.
        Not a round of its own: the forward ran in the round that dispatched it."""
        if self.settled:
            return RoundOutput()
        out = self.plain_round(successor=False)
        out.round = False
        return out

    def memory(self) -> dict:
        return {"kv_bytes": self.kv.nbytes, "kv_used_bytes": self.kv.used_bytes(),
                "drafter_kv_bytes": self.drafter.nbytes() if self.drafter else 0}



def _history(row: Row) -> list[int]:
    return row.request.prompt + row.request.tokens


def retires(request: Request) -> bool:
    """Finished normally and not preempted: its KV may go to the prompt cache."""
    return request.retire and request.finish_reason in ("stop", "length")


def held_tokens(request: Request) -> list[int]:
    """The tokens whose KV a finished row certainly holds: all but the last emitted."""
    return request.prompt + request.tokens[:-1]
