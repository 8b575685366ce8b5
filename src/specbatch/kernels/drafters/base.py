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
# Picks the b children [M, b] of M tree nodes from their draft logits [M, V]; the children
# sit at depth d (1-based), the j = d - 1 of a chain's draft step (loops/tree.py).
TopChooser = Callable[[mx.array, int, int], mx.array]
ANY_WIDTH = 1 << 30  # a drafter's ``tree_width`` when it drafts a tree per row at any width


def fixed_logits(tokens: mx.array, vocab_size: int) -> mx.array:
    """Draft logits ``[B, k, V]`` of fixed drafts ``tokens`` ``[B, k]`` (n-grams, prompt lookup):
    one-hot, so rejection sampling accepts a draft ``d`` with the target's probability of ``d``."""
    return mx.where(mx.arange(vocab_size) == tokens[..., None], 0.0, -1e9)


@attrs.frozen
class DraftTree:
    """A drafted token tree of one row: ``tokens`` ``[N]`` (lazy; node 0 is the pending
    token) laid out as ``layout`` (``tree_shape.TreeLayout``)."""

    tokens: mx.array  # [N]
    layout: object


@attrs.frozen
class Capture:
    """What a capture round hands a drafter to cold-start from, per row.

    ``histories``: each row's whole sequence (prompt + emitted). ``hidden``: the target's
    last hidden state per row ``[B, D]`` where the runner captured it (head drafters).
    """

    histories: list[list[int]]
    hidden: mx.array | None = None


class Drafter(Protocol):
    tree_width: int  # the widest batch it drafts a tree per row for (0: chains only)

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

    def advance(self, tokens: list[int], hidden: mx.array | None = None) -> None:
        """A plain round went by (one token a row, nothing drafted): ``tokens`` are each row's
        ``prev`` before it, which the next draft's feed (the new ``prev``, ``pending``) has
        moved past; ``hidden`` ``[B, D]``: the target state that predicted each row's new
        pending token (head drafters)."""
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

    def nbytes(self) -> int: ...


class TreeDrafter(Drafter, Protocol):
    """A drafter that proposes a token tree per row, for batches up to ``tree_width`` rows
    (the MTP head and prompt lookup: any width; a draft model: the scalar loop's one row).

    The invariant of ``Drafter`` holds around a tree round too: ``draft_trees`` feeds
    ``[prev, pending]`` and the nodes it needs; ``commit_trees`` keeps ``prev``, ``pending``
    and the accepted path but its last node, in sequence order, and forgets the rest."""

    def draft_trees(self, prev: mx.array, pending: mx.array, shape, choose: TopChooser,
                    context: list | None = None) -> list[DraftTree]:
        """Per row, a tree within ``shape`` (a ``TreeShape``); a dynamic shape's nodes may
        be pruned by drafted probability (the MTP head does) or drafted whole as a static
        bound, so rows' trees may differ."""
        ...

    def commit_trees(self, paths: list[list[int]], hidden: mx.array | None = None) -> None:
        """Per row, keep the accepted path (node ids, depths 1 .. a); ``hidden`` ``[B, D]``:
        the target state that predicted each new pending token (head drafters)."""
        ...

    def draft_tree(self, prev: mx.array, pending: mx.array, shape, choose: TopChooser,
                   context: list | None = None) -> DraftTree:
        """One row's ``draft_trees``."""
        ...

    def commit_tree(self, path: list[int], hidden: mx.array | None = None) -> None:
        """One row's ``commit_trees``."""
        ...
