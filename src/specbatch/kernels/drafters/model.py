"""A separate draft model (any mlx-lm model with the target's vocabulary) as a Drafter.

It keeps its own cache: one mlx-lm ``KVCache`` per layer while it serves the scalar
loop, a ragged ``BatchKV`` once converted for the batch loop. Its cold start prefills
each row's history.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from ..kv import BatchKV
from ..paged_kv import batch_kv
from ...runtime.config import DEFAULT_PREFILL_CHUNK
from ..tree_attention import compact, tree_call
from .base import Capture, Chooser, DraftTree


class ModelDrafter:
    """Drafts with a small mlx-lm model; ``batch=False`` keeps a single-sequence cache."""

    def __init__(self, model: nn.Module, batch: bool = True):
        self.model = model
        self.n_layers = len(model.layers)
        self.batch = batch
        self._single: list[KVCache] | None = None
        self.kv = batch_kv(self.n_layers)
        self._behind: list[list[int]] = []  # per plain round (``advance``): each row's token not yet fed

    @property
    def width(self) -> int:
        return self.kv.width if self.batch else int(self._single is not None)

    @property
    def tree_width(self) -> int:
        return 0 if self.batch else 1  # trees on the single-sequence cache only

    @property
    def cache(self) -> list:
        return self.kv.layers if self.batch else self._single

    def _prefill(self, tokens: list[int]) -> list[KVCache]:
        cache = [KVCache() for _ in range(self.n_layers)]
        for i in range(0, len(tokens), DEFAULT_PREFILL_CHUNK):
            self.model(mx.array(tokens[i:i + DEFAULT_PREFILL_CHUNK])[None], cache=cache)
            mx.eval([c.keys for c in cache])
        return cache

    def draft(self, prev: mx.array, pending: mx.array, k: int, choose: Chooser, context=None):
        feed = self._feed(prev, pending)  # [B, n + 2]
        tokens, logits = [], []
        for j in range(k):
            step = self.model(feed, cache=self.cache)[:, -1, :]  # [B, V]
            token = choose(step, j)  # [B]
            tokens.append(token)
            logits.append(step)
            if j + 1 < k:
                feed = token[:, None]
        return mx.stack(tokens, axis=1), mx.stack(logits, axis=1)  # [B, k], [B, k, V]

    def draft_tree(self, prev, pending, shape, choose, context=None) -> DraftTree:
        """Level by level: the nodes of depth ``d - 1`` go through the model in one tree
        forward (each sees the history and its own ancestors) and each takes its top
        ``b_d`` tokens as children. Single-sequence cache only (the scalar loop's)."""
        cache, layout = self._single, shape.layout()
        self._root = cache[0].offset + len(self._behind) + 1  # pending's column (and RoPE position)
        logits = self.model(self._feed(prev, pending), cache=cache)[:, -1, :]  # [1, V]
        seen = mx.array(layout.ancestry())[1:, 1:]  # [N-1, N-1] among non-root nodes
        levels, first = [choose(logits, 1, shape.branching[0]).reshape(-1)], 1
        for d, b in enumerate(shape.branching[1:], 2):
            frontier = levels[-1]  # [M] nodes of depth d - 1, ids first .. first + M - 1
            M = frontier.shape[0]
            visible = seen[first - 1:first - 1 + M, :first - 1 + M]  # [M, fed + M]
            positions = mx.full((1, M), self._root + d - 1, dtype=mx.int32)
            logits = tree_call(self.model, self.model, frontier[None], cache, positions, visible)[0]  # [M, V]
            levels.append(choose(logits, d, b).reshape(-1))
            first += M
        return DraftTree(mx.concatenate([pending, *levels]).astype(mx.int32), layout)

    def draft_trees(self, prev, pending, shape, choose, context=None) -> list[DraftTree]:
        return [self.draft_tree(prev, pending, shape, choose, context)]

    def commit_trees(self, paths: list[list[int]], hidden=None) -> None:
        [path] = paths
        self.commit_tree(path)

    def commit_tree(self, path: list[int], hidden=None) -> None:
        if not path:
            for c in self._single:
                c.offset = self._root  # drop pending: it becomes prev
            return
        compact(self._single, self._root, path[:-1])

    def _feed(self, prev: mx.array, pending: mx.array) -> mx.array:
        """``[B, n + 2]``: the tokens plain rounds went past, then ``prev`` and ``pending``."""
        behind, self._behind = [mx.array(t, dtype=mx.int32) for t in self._behind], []
        return mx.stack([*behind, prev, pending], axis=1)

    def _catch_up(self) -> None:
        """Feed what plain rounds went past (lazily) before the rows change."""
        if self._behind:
            feed, self._behind = mx.array(self._behind, dtype=mx.int32).T, []  # [B, n]
            self.model(feed, cache=self.cache)

    def advance(self, tokens: list[int], hidden=None) -> None:
        """Fed with the next draft (one forward reads the weights once for all of them)."""
        self._behind.append(list(tokens))

    def rollback(self, counts: list[int], hidden=None) -> None:
        self._catch_up()
        if self.batch:
            self.kv.trim_rows(counts)
        else:
            for c in self._single:
                c.trim(counts[0])

    def add_rows(self, histories: list[list[int]], hidden=None) -> None:
        self._catch_up()
        for history in histories:
            single = self._prefill(history[:-2])
            if self.batch:
                self.kv.extend(BatchKV.from_singles(single))
            else:
                assert self._single is None, "a single-sequence drafter holds one row"
                self._single = single

    def filter(self, keep: list[int]) -> None:
        self._catch_up()
        if self.batch:
            self.kv.filter(keep)
        elif not keep:
            self._single = None

    def reset(self) -> None:
        self._single, self._behind = None, []
        self.kv = batch_kv(self.n_layers)

    def cold_start(self, capture: Capture) -> None:
        self.reset()
        self.add_rows(capture.histories)

    def nbytes(self) -> int:
        if self.batch:
            return self.kv.nbytes
        return sum(c.nbytes for c in self._single) if self._single else 0
