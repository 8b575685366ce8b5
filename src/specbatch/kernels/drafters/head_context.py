"""The target's last-layer KV as the MTP head reads it: its *context*.

Dense: keys and values ``[B or 1, Hkv, T, D]`` (a cache buffer's first T columns) and a
validity mask ``[B or 1, T]``. Paged: a paged layer's key and value pools ``[Hkv, P, D]``
(keys in 16-slot blocks) and ``slots`` ``[B or 1, T]``: row b's column j is pool slot
``slots[b, j]``; columns past a row's length point at some valid slot and are masked. The
CPU kernels' one-op draft step reads either in place; elsewhere ``dense`` gathers it.
"""

from __future__ import annotations

import attrs
import mlx.core as mx

from ..kv import RaggedKVCache


@attrs.frozen
class HeadContext:
    keys: mx.array  # [B or 1, Hkv, T, D]; paged: the key pool [Hkv, P, D]
    values: mx.array  # as keys
    mask: mx.array  # [B or 1, T] bool: the columns each row attends
    lengths: list[int]  # per batch row: its tokens (the pending token's position)
    slots: mx.array | None = None  # paged: [B or 1, T] int32
    pools: tuple | None = None  # paged: the layer's (key, value) ``kv_pool.Pool``s, for ``dense``

    @property
    def columns(self) -> int:
        return self.mask.shape[1]

    def select(self, owner: mx.array) -> "HeadContext":
        """The context of frontier rows, row i seeing batch row ``owner[i]``'s (``[M]``)."""
        M = owner.shape[0]
        if self.slots is not None:  # [1, T] stays [1, T]: the kernel reads one row for all
            if self.mask.shape[0] == 1:
                return self
            return attrs.evolve(self, mask=self.mask[owner], slots=self.slots[owner])
        if self.keys.shape[0] == 1:  # one row: a broadcast, no copy of its context
            k, v, m = (mx.broadcast_to(a, (M, *a.shape[1:])) for a in (self.keys, self.values, self.mask))
        else:
            k, v, m = self.keys[owner], self.values[owner], self.mask[owner]
        return attrs.evolve(self, keys=k, values=v, mask=m)

    def dense(self, rows: int) -> tuple[mx.array, mx.array, mx.array]:
        """(keys, values ``[rows, Hkv, T, D]``, mask ``[rows, T]``) for the separate ops."""
        keys, values, mask = self.keys, self.values, self.mask
        if self.slots is not None:
            kpool, vpool = self.pools
            keys = kpool.read(self.slots, [self.columns], whole_blocks=True)  # slots from the block table
            values = vpool.read(self.slots, [self.columns], whole_blocks=True)
        if keys.shape[0] != rows:
            keys, values = (mx.broadcast_to(a, (rows, *a.shape[1:])) for a in (keys, values))
        return keys, values, mx.broadcast_to(mask, (rows, mask.shape[1]))


def context_of(cache) -> HeadContext:
    """The head's context in a target cache's last layer: a paged layer's pools read through
    its slots where it has them (float tokens), else its keys and values."""
    view = cache.paged_view() if hasattr(cache, "paged_view") else None
    if view is not None:
        kpool, vpool, slots = view  # [Hkv, P, D] twice, [B, T]
        lengths = list(cache.ends)
        mask = mx.arange(slots.shape[1])[None] < mx.array(lengths)[:, None]  # [B, T]
        return HeadContext(kpool, vpool, mask, lengths, slots, (cache.kpool, cache.vpool))
    if isinstance(cache, RaggedKVCache):
        top = max(cache.ends)
        cols = mx.arange(top)[None]
        mask = (cols >= mx.array(cache.starts)[:, None]) & (cols < mx.array(cache.ends)[:, None])
        return HeadContext(cache.keys[..., :top, :], cache.values[..., :top, :], mask, cache.lengths())
    n = cache.offset
    return HeadContext(cache.keys[..., :n, :], cache.values[..., :n, :], mx.ones((1, n), dtype=mx.bool_), [n])
