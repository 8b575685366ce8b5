"""The host-side block table of the paged KV cache: rows -> pool blocks, free blocks.

Shared by all layers of one ``PagedKV`` (they hold the same lengths), so each forward
builds its index arrays once and every layer reuses them.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np

BLOCK = 16  # tokens per block: a row wastes < BLOCK tokens; smaller means longer gather tables
GROW = 16  # the capacity grows by at least 1/GROW of itself, <= 6.25% slack (pools reserve more: kv_pool.RESERVE)
ROW_SPARE = 2  # and by at least this many blocks a row: a growth per ~2 boundaries each row crosses, not per row
# after rows leave, repack the pools once free blocks pass this share: allocation stays within 2x
# need, and arrivals reuse the free blocks meanwhile (each repack copies the whole KV: at 0.10, 16
# rows finishing one by one decoded 245 tok/s against 286-289 at 0.5 and 287-293 never)
COMPACT_SLACK = 0.5


SMALL = 256  # slots computed in plain Python up to this many (a decode or verify step's)


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def group_size(features: int) -> int:
    """The quantization group along a token's ``H * D`` features (MLX takes 32/64/128)."""
    for g in (64, 128, 32):
        if features % g == 0:
            return g
    raise ValueError(f"kv_bits needs H * head_dim divisible by 32, got {features}")


@attrs.define(eq=False)
class BlockTable:
    """Which pool blocks each row holds, in token order; free blocks; the pool capacity."""

    rows: list[list[int]] = attrs.Factory(list)
    free: list[int] = attrs.Factory(list)
    capacity: int = 0  # blocks every layer's pool holds (pools grow lazily to it)
    _memo: dict = attrs.Factory(dict)  # index arrays, shared by the layers of one forward

    def used(self) -> int:
        return sum(len(r) for r in self.rows)

    def ensure(self, lengths: list[int]) -> None:
        """Give each row blocks for ``lengths[b]`` tokens, growing the capacity once."""
        short = sum(max(0, _blocks(n) - len(r)) for n, r in zip(lengths, self.rows))
        if short == 0:
            return
        if short > len(self.free):
            grow = max(short - len(self.free), self.capacity // GROW, len(self.rows) * ROW_SPARE)
            self.free += range(self.capacity, self.capacity + grow)
            self.capacity += grow
        self.free.sort(reverse=True)  # pop() hands out low ids first: rows stay contiguous
        for n, row in zip(lengths, self.rows):
            while len(row) < _blocks(n):
                row.append(self.free.pop())
        self._memo.clear()

    def release_tail(self, lengths: list[int]) -> None:
        """Free the blocks past each row's length (after a rollback)."""
        for b, n in enumerate(lengths):
            keep = _blocks(n)
            if len(self.rows[b]) > keep:
                self.free += self.rows[b][keep:]
                self.rows[b] = self.rows[b][:keep]
                self._memo.clear()

    def slots(self, lengths: list[int], n: int) -> mx.array:
        """Pool slots ``[B * n]`` of each row's next ``n`` tokens (row-major)."""
        key = ("w", tuple(lengths), n)
        if key not in self._memo:
            self._memo[key] = mx.array(self._next_slots(lengths, n), dtype=mx.int32)
        return self._memo[key]

    def _next_slots(self, lengths: list[int], n: int):
        # a decode step's few slots in plain Python: numpy's fixed cost ran ~0.18 ms a step
        # cold (after each step's weight stream) against a few microseconds here
        if len(lengths) * n <= SMALL:
            try:
                return [row[p // BLOCK] * BLOCK + p % BLOCK
                        for row, length in zip(self.rows, lengths) for p in range(length, length + n)]
            except IndexError:  # a position past its row's blocks: _slots_at's clamped slot
                pass
        return self._slots_at(np.asarray(lengths)[:, None] + np.arange(n)).reshape(-1)  # [B * n]

    def gather(self, lengths: list[int]) -> mx.array | int:
        """Slots ``[B, T]`` that read each row's tokens in order (T = the longest row; columns
        past a row's length point anywhere and are masked), or, for one row whose blocks
        are consecutive, the first slot: the view is then a slice, no copy."""
        key = ("r", tuple(lengths))
        if key not in self._memo:
            T = max(lengths)
            first = self.rows[0][0] if lengths and self.rows[0] else 0
            if len(lengths) == 1 and self.rows[0] == list(range(first, first + _blocks(T))):
                self._memo[key] = first * BLOCK
            else:
                pos = np.broadcast_to(np.arange(T), (len(lengths), T))  # [B, T]
                self._memo[key] = mx.array(self._slots_at(pos))
        return self._memo[key]

    def slot_matrix(self, lengths: list[int]) -> mx.array:
        """``gather``'s slots as an int32 ``[B, T]`` array always (what attention reads)."""
        key = ("m", tuple(lengths))
        if key not in self._memo:
            index = self.gather(lengths)
            T = max(lengths)
            self._memo[key] = (mx.arange(index, index + T, dtype=mx.int32)[None] if isinstance(index, int)
                               else index.astype(mx.int32))
        return self._memo[key]

    def _slots_at(self, pos: np.ndarray) -> np.ndarray:
        """Pool slot of token ``pos[b, t]`` of row b (positions past a row's blocks: 0)."""
        width = max((len(r) for r in self.rows), default=0)
        table = np.zeros((len(self.rows), max(width, 1)), dtype=np.int32)  # [B, blocks]
        for b, row in enumerate(self.rows):
            table[b, :len(row)] = row
        blk = np.minimum(pos // BLOCK, table.shape[1] - 1)
        return (np.take_along_axis(table, blk, 1) * BLOCK + pos % BLOCK).astype(np.int32)

    def slots_of(self, rows: list[int], positions: list[int]) -> np.ndarray:
        """Pool slot of token ``positions[i]`` of row ``rows[i]``, for each i."""
        return np.asarray([self.rows[r][p // BLOCK] * BLOCK + p % BLOCK for r, p in zip(rows, positions)],
                          dtype=np.int32)

    def row_slots(self, rows: list[int], lengths: list[int]) -> np.ndarray:
        """Pool slots of tokens ``0 .. lengths[i]`` of each row ``rows[i]``, concatenated."""
        parts = [(np.asarray(self.rows[r], dtype=np.int32)[:, None] * BLOCK + np.arange(BLOCK)).reshape(-1)[:n]
                 for r, n in zip(rows, lengths)]
        return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)

    def compact(self) -> np.ndarray:
        """Renumber the held blocks ``0 .. used - 1`` in row order; drop the free ones.
        Returns the old slots ``[used * BLOCK]`` each pool keeps, in their new order."""
        order = np.asarray([b for row in self.rows for b in row], dtype=np.int32)
        at = 0
        for b, row in enumerate(self.rows):
            self.rows[b] = list(range(at, at + len(row)))
            at += len(row)
        self.free, self.capacity = [], at
        self._memo.clear()
        return (order[:, None] * BLOCK + np.arange(BLOCK)).reshape(-1).astype(np.int32)
