"""The batch loop: two or more rows decoding together on one ragged target cache.

Per row it tracks the KV offset (in the ragged cache), the budget and finished flag (on
the request) and the *pending* token: the last emitted token, not yet in the target
cache, which the next round starts from (after a verify round, the bonus token).

Plain rounds pipeline: a round dispatches the next round's forward before reading its
own tokens (``mx.async_eval``), so Python overhead hides behind compute. That successor
has already appended its KV, so any structural change (admit, remove, arm) first
*settles*: one more plain round that dispatches no successor consumes the lookahead.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
import structlog

from ..kv import BatchKV
from ..request import Request
from ..runner import TargetRunner, prefill
from ..sampling import RowSampling, positions_from, sample

log = structlog.get_logger(__name__)


@attrs.define(eq=False)
class Row:
    request: Request
    pending: int  # last emitted token; the next round feeds it to the target
    prev: int  # the token before ``pending`` (drafters feed [prev, pending])


class BatchLoop:
    """Decode rounds over many rows; rows join and leave only between rounds."""

    def __init__(self, target: TargetRunner):
        self.target = target
        self.rows: list[Row] = []
        self.kv = BatchKV.empty(target.n_layers)
        self._lookahead: mx.array | None = None  # [B] lazy tokens of a dispatched forward
        self._sampling: RowSampling | None = None
        self.rounds = 0

    @property
    def width(self) -> int:
        return len(self.rows)

    @property
    def settled(self) -> bool:
        return self._lookahead is None

    # -- admission --------------------------------------------------------------------
    def admit(self, request: Request, cache: list | None = None) -> None:
        """Prefill one request, emit its first token and add it as a row (if it goes on)."""
        assert self.settled, "admit only between settled rounds"
        single = cache if cache is not None else self.target.make_cache()
        have = single[0].offset if single and single[0].keys is not None else 0
        logits = prefill(self.target, request.prompt[have:], single)  # [1, V]
        rows = RowSampling.of([request.params])
        first = sample(logits[:, None, :], rows, positions_from([0], 1)).item()
        if request.emit(first):
            return
        self.add_row(Row(request, first, request.prompt[-1]), BatchKV.from_singles(single))

    def add_row(self, row: Row, kv: BatchKV) -> None:
        """Append a row whose target KV holds everything before ``row.pending``."""
        assert self.settled
        self.kv.extend(kv)
        self.rows.append(row)
        self._sampling = None

    def reap(self) -> list[Request]:
        """Remove finished and cancelled rows (between settled rounds); return them."""
        assert self.settled
        gone = [i for i, r in enumerate(self.rows) if r.request.finished or r.request.cancel_requested]
        if not gone:
            return []
        keep = [i for i in range(self.width) if i not in gone]
        out = [self.rows[i].request for i in gone]
        self.kv.filter(keep)
        self.rows = [self.rows[i] for i in keep]
        self._sampling = None
        return out

    def fail_all(self) -> list[Request]:
        """Drop every row and all KV (after a failed round); return their requests."""
        out = [r.request for r in self.rows]
        self.rows, self._lookahead, self._sampling = [], None, None
        self.kv = BatchKV.empty(self.target.n_layers)
        return out

    # -- plain rounds -----------------------------------------------------------------
    def _rows_sampling(self) -> RowSampling:
        if self._sampling is None:
            self._sampling = RowSampling.of([r.request.params for r in self.rows])
        return self._sampling

    def _dispatch(self, tokens: mx.array, ahead: int) -> mx.array:
        """Lazily forward tokens ``[B]`` and sample the next ``[B]`` (``ahead`` = unread)."""
        logits = self.target.forward(tokens[:, None], self.kv.layers)  # [B, 1, V]
        positions = positions_from([r.request.emitted + ahead for r in self.rows], 1)
        return sample(logits, self._rows_sampling(), positions)[:, 0]

    def plain_round(self, successor: bool = True) -> int:
        """One token per live row; returns how many tokens went out."""
        if self._lookahead is None:
            pending = mx.array([r.pending for r in self.rows], dtype=mx.int32)
            self._lookahead = self._dispatch(pending, 0)
        current = self._lookahead
        live = not any(r.request.finished or r.request.cancel_requested for r in self.rows)
        if successor and live:
            self._lookahead = self._dispatch(current, 1)
            mx.async_eval(self._lookahead)
        else:
            self._lookahead = None
        emitted = 0
        for row, token in zip(self.rows, current.tolist()):
            if row.request.finished:
                continue  # its successor slot is discarded at the next settle
            row.prev, row.pending = row.pending, token
            row.request.emit(token)
            emitted += 1
        self.rounds += 1
        return emitted

    def settle(self) -> int:
        """Consume an in-flight lookahead (emitting its tokens); a no-op when settled."""
        return 0 if self.settled else self.plain_round(successor=False)

