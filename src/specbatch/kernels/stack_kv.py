"""One forward's KV writes to every layer of a cache, planned at once.

A cache appends a forward's tokens layer by layer (a ``PagedLayer``'s ``append``: the table's
blocks, its pools grown, the new tokens' slots, its lengths; an mlx-lm ``KVCache``'s buffer
slice and offset). Every layer of one forward holds the same lengths, so the CPU decoder stack,
which runs all its layers as one op (``cpu.stack``), plans them here once: the same table,
buffers, slots and lengths the per-layer appends leave.

Vocabulary: *buffers* are each layer's keys then values (paged pools ``[P, H * D]``, or dense
``[B, H, C, D]``); *write slots* are the new tokens' pool rows (``[B * N]``, row-major), *read
slots* every token's after the writes (``[B, T]``, what attention reads); a dense forward
writes from column *start* on.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .paged_kv import PagedLayer


@attrs.define(eq=False)
class StackWrite:
    """The buffers and slots of one forward's appends to ``layers``, until ``commit``."""

    layers: list
    buffers: list[mx.array]  # each layer's keys then values, before the writes
    end: int  # keys attended after the writes (T)
    write_slots: mx.array | None = None  # paged: int32 [B * N]
    read_slots: mx.array | None = None  # paged: int32 [B, T]
    lengths: list[int] | None = None  # paged: each row's tokens after the writes
    start: int = 0  # dense: the first new column

    @classmethod
    def of(cls, layers: list, n: int, heads: int, dim: int) -> StackWrite | None:
        """The appends of ``n`` tokens a row (``heads`` x ``dim`` float32 keys and values a
        token) to ``layers``: one float32 paged cache at one length, or mlx-lm ``KVCache``
        buffers at one offset with room for them; else None (the layers then append
        themselves: a first forward or a dense buffer's growth)."""
        first = layers[0] if layers else None
        if type(first) is PagedLayer:
            return cls._paged(layers, n, heads, dim)
        if type(first) is KVCache:
            return cls._dense(layers, n, heads, dim)
        return None

    @classmethod
    def _paged(cls, layers: list, n: int, heads: int, dim: int) -> StackWrite | None:
        first = layers[0]
        table, lengths = first.table, first.ends
        if first.kv_bits or not lengths:
            return None
        for c in layers:
            if type(c) is not PagedLayer or c.table is not table or c.kv_bits or c.ends != lengths:
                return None
            if c.kpool is not None and (c.kpool.dtype != mx.float32 or (c.kpool.heads, c.kpool.dim) != (heads, dim)):
                return None
        new = [length + n for length in lengths]
        table.ensure(new)
        shape = (1, heads, n, dim)
        for c in layers:
            c.pools(shape, shape, mx.float32)
        buffers = [p for c in layers for p in (c.kpool.parts[0], c.vpool.parts[0])]
        read = table.slot_matrix(new)
        return cls(list(layers), buffers, read.shape[1], table.slots(lengths, n), read, new)

    @classmethod
    def _dense(cls, layers: list, n: int, heads: int, dim: int) -> StackWrite | None:
        start = layers[0].offset
        for c in layers:
            keys, values = c.keys, c.values
            if (type(c) is not KVCache or c.offset != start or keys is None or keys.dtype != mx.float32
                    or values.dtype != mx.float32 or keys.ndim != 4 or keys.shape[1] != heads or keys.shape[3] != dim
                    or values.shape != keys.shape or start + n > keys.shape[2]):
                return None
        buffers = [b for c in layers for b in (c.keys, c.values)]
        return cls(list(layers), buffers, start + n, start=start)

    def commit(self, written: list[mx.array]) -> None:
        """Hold the buffers the forward wrote (2 a layer, keys first) and the new lengths. The
        old buffers are dropped here, so the graph holds them alone and the op writes each in
        place (donated, no copy)."""
        paged = self.lengths is not None
        for c, k, v in zip(self.layers, written[0::2], written[1::2]):
            if paged:
                c.kpool.parts[0], c.vpool.parts[0] = k, v
                c.ends = self.lengths
            else:
                c.keys, c.values, c.offset = k, v, self.end
        self.buffers = []
