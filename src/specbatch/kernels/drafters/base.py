"""The Drafter protocol: what both decode loops ask of a drafter.

A drafter's rows mirror the loop's rows. Between rounds, each row's drafter state covers
the row's sequence except its last two tokens, ``[prev, pending]``; a round feeds those
two and then chains ``k - 1`` single steps, proposing ``k`` tokens. After verification
accepted ``a`` of them, the row rolls back by ``k - a``, which restores the invariant.
"""

from __future__ import annotations

from typing import Callable, Protocol

import attrs
import mlx.core as mx

# Picks draft tokens [B] from draft logits [B, V] at draft step j (0-based).
Chooser = Callable[[mx.array, int], mx.array]


@attrs.frozen
class Capture:
    """What a capture round hands a drafter to cold-start from, per row.

    ``histories``: each row's whole sequence (prompt + emitted). ``hidden``: the target's
    last hidden state per row ``[B, D]`` where the runner captured it (head drafters).
    """

    histories: list[list[int]]
    hidden: mx.array | None = None


class Drafter(Protocol):
    @property
    def width(self) -> int: ...

    def draft(self, prev: mx.array, pending: mx.array, k: int, choose: Chooser,
              context: list | None = None) -> tuple[mx.array, mx.array]:
        """Propose ``k`` tokens per row, lazily: (tokens ``[B, k]``, logits ``[B, k, V]``).

        ``context``: the target's per-layer caches (shared-KV drafters read them)."""
        ...

    def rollback(self, counts: list[int], hidden: mx.array | None = None) -> None:
        """Forget the last ``counts[b]`` fed tokens of each row b; ``hidden`` ``[B, D]`` is
        the target state that predicted each row's new pending token (head drafters)."""
        ...

    def add_rows(self, histories: list[list[int]], hidden: mx.array | None = None) -> None:
        """Append rows, prefilled with each history except its last two tokens."""
        ...

    def filter(self, keep: list[int]) -> None:
        """Keep only rows ``keep``, in that order."""
        ...

    def reset(self) -> None:
        """Drop every row."""
        ...

    def cold_start(self, capture: Capture) -> None:
        """Reset, then rebuild one row per captured history."""
        ...

    def to_batch(self) -> None:
        """Convert single-sequence state to the batch form (after a preempt)."""
        ...

    def nbytes(self) -> int: ...
