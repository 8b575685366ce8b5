"""Log-probabilities of emitted tokens, read in the round's one host sync.

The values are the TARGET's distribution at each emitted position: ``log_softmax`` of its
raw logits, before temperature, top-p and top-k (vLLM's default "raw" mode), taken from
the forward that sampled the token: the verify forward of a speculative round (never the
drafter's), a plain round's or the prefill's. Coupled sampling makes the emitted stream
the target's own, so these equal the values with speculation off (up to fp rounding).

Rows that did not ask pay nothing: ``gather`` selects the asking rows before any
vocabulary-wide work, and returns None when no row asked.
"""

from __future__ import annotations

import attrs
import mlx.core as mx

from ..runtime.params import TokenLogprob
from .sampling import RowSampling, sample


@attrs.frozen
class LazyLogprobs:
    """Unevaluated logprobs of the asking rows of a ``[B, N]`` token block."""

    rows: list[int]  # batch rows that asked, in order
    wants: list[int]  # per asking row, its N
    chosen: mx.array  # [R, N] logprob of each sampled token
    top_ids: mx.array | None  # [R, N, n] n = max(wants); None when every row wants 0
    top_lps: mx.array | None  # [R, N, n]

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.chosen, self.top_ids, self.top_lps) if a is not None]

    def read(self, tokens: list[list[int]]) -> list[list[TokenLogprob] | None]:
        """Per batch row (None where it did not ask), after the arrays are evaluated."""
        out: list[list[TokenLogprob] | None] = [None] * len(tokens)
        chosen = self.chosen.tolist()
        ids = self.top_ids.tolist() if self.top_ids is not None else None
        lps = self.top_lps.tolist() if self.top_lps is not None else None
        for r, (b, want) in enumerate(zip(self.rows, self.wants)):
            row = []
            for j, token in enumerate(tokens[b]):
                top = () if not want else _ranked(ids[r][j], lps[r][j], want)
                row.append(TokenLogprob(token, chosen[r][j], top))
            out[b] = row
        return out


def _ranked(ids: list[int], lps: list[float], want: int) -> tuple[tuple[int, float], ...]:
    # argpartition leaves the top n unordered: a host sort of n <= 20 pairs
    pairs = sorted(zip(ids, lps), key=lambda p: (-p[1], p[0]))
    return tuple(pairs[:want])


def gather(logits: mx.array, tokens: mx.array, wants: list[int | None]) -> LazyLogprobs | None:
    """Lazy logprobs of ``tokens [B, N]`` under ``logits [B, N, V]`` for rows whose want is
    not None; None when no row asked."""
    rows = [b for b, w in enumerate(wants) if w is not None]
    if not rows:
        return None
    if len(rows) < logits.shape[0]:
        pick = mx.array(rows)
        logits, tokens = logits[pick], tokens[pick]  # [R, N, V], [R, N]
    logits = logits.astype(mx.float32)
    lsm = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # [R, N, V]
    chosen = mx.take_along_axis(lsm, tokens[..., None].astype(mx.int32), -1)[..., 0]  # [R, N]
    row_wants = [wants[b] for b in rows]
    n = min(max(row_wants), lsm.shape[-1])
    if n == 0:
        return LazyLogprobs(rows, row_wants, chosen, None, None)
    top_ids = mx.argpartition(-lsm, n - 1, axis=-1)[..., :n]  # [R, N, n] unordered
    top_lps = mx.take_along_axis(lsm, top_ids, -1)  # [R, N, n]
    return LazyLogprobs(rows, row_wants, chosen, top_ids, top_lps)


def read(tokens: mx.array, lazy: LazyLogprobs | None, *more: mx.array):
    """The one host sync: tokens ``[B, N]`` as lists, with each row's logprobs (or None)."""
    mx.eval(tokens, *(lazy.arrays() if lazy else ()), *more)
    toks = tokens.tolist()
    return toks, (lazy.read(toks) if lazy else [None] * len(toks))


def sample_read(logits: mx.array, rows: RowSampling, positions: mx.array):
    """Sample ``[B, N]`` tokens from ``logits [B, N, V]`` and read them with their logprobs."""
    tokens = sample(logits, rows, positions)
    return read(tokens, gather(logits, tokens, rows.logprobs))
