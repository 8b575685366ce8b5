"""Prompt-lookup drafting: propose what followed the last occurrence of the current suffix.

No weights and no forward: for each row, find the most recent earlier place where the
row's last ``n`` tokens (``n`` from ``max_n`` down to ``min_n``) occurred in its own
sequence, and propose the ``k`` tokens that followed there. Code, quotes of the prompt and
a weak model's greedy loops repeat a lot, so proposals are often right and cost nothing;
where nothing matches, the row proposes its pending token again and one verify forward
finds out. Drafts are deterministic, so their "logits" are one-hot: rejection sampling
then accepts a draft ``d`` with probability ``p(d)``.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np

from ...runtime.tree_shape import TreeLayout
from .base import ANY_WIDTH, Capture, Chooser, DraftTree, fixed_logits
from .lookup import History


@attrs.frozen
class NGramSource:
    """What ``--drafter ngram`` loads: the lookup's settings (there are no weights)."""

    vocab_size: int
    max_n: int = 4
    min_n: int = 1
    name: str = "ngram"


def propose(seq, k: int, max_n: int, min_n: int) -> list[int]:
    """The ``k`` tokens after the latest earlier match of ``seq``'s longest matching suffix
    (the search the MTP head's lookup rounds use, ``History.proposal``), padded with the last."""
    history = History(list(seq))
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        got = history.proposal(n, k)
        if got:
            return got + [int(seq[-1])] * (k - len(got))
    return [int(seq[-1])] * k


def continuations(seq: np.ndarray, k: int, max_n: int, min_n: int) -> list[list[int]]:
    """What followed each earlier match of ``seq``'s longest matching suffix, the latest
    first, each padded to ``k`` with the last token (as ``propose`` pads its one)."""
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # [len-n, n]
        hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        if hits.size:
            got = [seq[h + n:h + n + k].tolist() for h in hits[::-1]]
            return [g + [int(seq[-1])] * (k - len(g)) for g in got]
    return [[int(seq[-1])] * k]


def propose_tree(seq: np.ndarray, branching, max_n: int, min_n: int) -> tuple[list[int], list[int]]:
    """A trie of the distinct continuations (latest first), at most ``branching[d]``
    children per node at depth ``d``: (tokens, parents) breadth first, node 0 =
    ``seq[-1]``. With one continuation (or a chain shape) it is ``propose``'s chain."""
    tokens, parents, kids = [int(seq[-1])], [-1], [{}]
    for cont in continuations(seq, len(branching), max_n, min_n):
        node = 0
        for d, token in enumerate(cont):
            if token not in kids[node]:
                if len(kids[node]) >= branching[d]:
                    break
                kids[node][token] = len(tokens)
                tokens.append(token)
                parents.append(node)
                kids.append({})
            node = kids[node][token]
    order = sorted(range(len(tokens)), key=lambda n: (_depth(parents, n), n))  # breadth first
    where = {old: new for new, old in enumerate(order)}
    return [tokens[n] for n in order], [-1 if parents[n] < 0 else where[parents[n]] for n in order]


def _depth(parents: list[int], n: int) -> int:
    d = 0
    while parents[n] >= 0:
        n, d = parents[n], d + 1
    return d


class NGramDrafter:
    """A Drafter over each row's own tokens; its state is the tokens it was fed."""

    tree_width = ANY_WIDTH

    def __init__(self, source: NGramSource):
        self.source = source
        self._fed: list[list[int]] = []  # per row: the sequence minus its last two tokens
        self._last_trees: list[list[int]] = []  # per row, the latest tree's tokens (host), for commit_trees

    @property
    def width(self) -> int:
        return len(self._fed)

    def draft(self, prev: mx.array, pending: mx.array, k: int, choose: Chooser, context=None):
        rows = []
        for fed, p, y in zip(self._fed, prev.tolist(), pending.tolist()):
            fed += [p, y]
            rows.append(propose(fed, k, self.source.max_n, self.source.min_n))
            fed += rows[-1][:-1]  # the invariant: feeds [prev, pending, d_1 .. d_{k-1}]
        tokens = mx.array(rows, dtype=mx.int32)  # [B, k]
        return tokens, fixed_logits(tokens, self.source.vocab_size)

    def draft_tree(self, prev, pending, shape, choose, context=None) -> DraftTree:
        return self.draft_trees(prev, pending, shape, choose, context)[0]

    def commit_tree(self, path: list[int], hidden=None) -> None:
        self.commit_trees([path])

    def draft_trees(self, prev, pending, shape, choose, context=None) -> list[DraftTree]:
        """Per row, distinct continuations of the suffix's earlier matches, merged into a
        trie within ``shape`` (a chain where the history has one)."""
        self._last_trees, trees = [], []
        for fed, p, y in zip(self._fed, prev.tolist(), pending.tolist()):
            fed += [p, y]
            tokens, parents = propose_tree(np.asarray(fed), shape.branching, self.source.max_n, self.source.min_n)
            self._last_trees.append(tokens)
            trees.append(DraftTree(mx.array(tokens, dtype=mx.int32), TreeLayout.of_parents(parents)))
        return trees

    def commit_trees(self, paths: list[list[int]], hidden=None) -> None:
        for fed, tokens, path in zip(self._fed, self._last_trees, paths):
            if not path:
                fed.pop()  # the pending token: it becomes prev, with the bonus pending
            else:
                fed += [tokens[n] for n in path[:-1]]

    def rollback(self, counts: list[int], hidden=None) -> None:
        for fed, c in zip(self._fed, counts):
            del fed[len(fed) - c:]

    def advance(self, tokens: list[int], hidden=None) -> None:
        for fed, token in zip(self._fed, tokens):
            fed.append(token)

    def add_rows(self, histories: list[list[int]], hidden=None) -> None:
        self._fed += [list(h[:-2]) for h in histories]

    def filter(self, keep: list[int]) -> None:
        self._fed = [self._fed[i] for i in keep]

    def reset(self) -> None:
        self._fed = []

    def cold_start(self, capture: Capture) -> None:
        self.reset()
        self.add_rows(capture.histories)

    def nbytes(self) -> int:
        return 0
