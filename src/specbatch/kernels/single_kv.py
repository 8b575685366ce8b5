"""The scalar loop's KV: one sequence's mlx-lm ``KVCache`` per layer, with the row edits of
a batch cache (``kv.BatchKV``) for its one row, so a round's rollback and a tree's
compaction are the same code for both loops: the cache, not the round, knows its layout."""

from __future__ import annotations

import mlx.core as mx


class SingleKV:
    """One row: ``layers`` are single-sequence caches (``[1, H, T, D]`` keys and values)."""

    def __init__(self, layers: list):
        self.layers = layers

    @property
    def width(self) -> int:
        return 1

    def lengths(self) -> list[int]:
        return [self.layers[0].offset]

    def trim_rows(self, counts: list[int]) -> None:
        [n] = counts
        for c in self.layers:
            c.trim(n)

    def move_tokens(self, rows: list[int], src: list[int], dst: list[int]) -> None:
        """Copy token ``src[i]`` to position ``dst[i]`` (``rows`` are all 0), every layer."""
        s, d = mx.array(src), mx.array(dst)
        for c in self.layers:
            if c.keys is not None:
                c.keys[:, :, d] = c.keys[:, :, s]  # [1, H, moved, D]
                c.values[:, :, d] = c.values[:, :, s]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers)
