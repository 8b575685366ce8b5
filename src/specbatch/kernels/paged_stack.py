"""One forward's KV writes to every layer of a paged cache, planned at once.

A ``PagedLayer`` appends a forward's tokens layer by layer (``append``: the table's blocks,
its pools grown, the new tokens' slots, the layer's lengths). Every layer of a batch holds the
same lengths over one ``BlockTable``, so the CPU decoder stack, which builds all its layers'
writes and attention in one call (``cpu.stack``), plans them here once: the same table,
pools, slots and lengths the per-layer appends leave.

Vocabulary: *write slots* are the new tokens' pool rows (``[B * N]``, row-major); *read
slots* every token's after the writes (``[B, T]``, what attention reads).
"""

from __future__ import annotations

import attrs
import mlx.core as mx

from .paged_kv import PagedLayer


@attrs.define(eq=False)
class StackWrite:
    """The pools and slots of one forward's appends to ``layers``, until ``commit``."""

    layers: list[PagedLayer]
    pools: list[mx.array]  # each layer's key pool then value pool [P, H * D], before the writes
    write_slots: mx.array  # int32 [B * N]
    read_slots: mx.array  # int32 [B, T]
    lengths: list[int]  # each row's tokens after the writes

    @classmethod
    def plan(cls, layers: list, n: int, heads: int, dim: int) -> StackWrite | None:
        """The appends of ``n`` tokens a row (``heads`` x ``dim`` float32 keys and values a
        token) to ``layers``; None where they are not one float32 paged cache at one length
        (the layers then append themselves)."""
        first = layers[0] if layers else None
        if type(first) is not PagedLayer or first.kv_bits or not first.ends:
            return None
        table, lengths = first.table, first.ends
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
        pools = [p for c in layers for p in (c.kpool.parts[0], c.vpool.parts[0])]
        return cls(list(layers), pools, table.slots(lengths, n), table.slot_matrix(new), new)

    def commit(self, written: list[mx.array]) -> None:
        """Hold the pools the forward wrote (2 a layer, keys first) and the new lengths. The
        old pools are dropped here, so the graph holds them alone and each write donates its
        pool (written in place, no copy)."""
        for c, k, v in zip(self.layers, written[0::2], written[1::2]):
            c.kpool.parts[0], c.vpool.parts[0] = k, v
            c.ends = self.lengths
        self.pools = []
