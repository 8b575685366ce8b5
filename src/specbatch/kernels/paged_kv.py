"""Paged KV: each layer keeps its tokens in a pool of fixed-size blocks; rows own block lists.

Dense ragged buffers pad every row to the longest one (``make bench`` measured 1.48-1.80x
of what the tokens need at mixed lengths). Here row b holds ``ceil(len_b / BLOCK)`` blocks;
one host-side ``BlockTable`` (shared by all layers, which hold the same lengths) maps rows
to blocks. The CPU kernels write and attend over the pools in place through the table's
slots; elsewhere a forward gathers the rows' blocks into a dense ``[B, H, T, D]`` view for
one layer's attention, so what stays allocated is the pools alone.

Rollback trims a row's length and frees its whole trailing blocks. Under ``kv_bits`` each
token is quantized on its own (groups along its ``H * D`` features, never across tokens),
so trimming after a quantized append leaves exactly the state of never appending.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np
import structlog
from mlx_lm.models.cache import KVCache

from ..runtime.config import DEFAULT_KV_LAYOUT
from .block_table import BLOCK, COMPACT_SLACK, BlockTable
from .kv import BatchKV, RaggedKVCache
from .kv_pool import Pool

log = structlog.get_logger(__name__)


class PagedLayer(RaggedKVCache):
    """One layer over a shared ``BlockTable``; the mlx-lm cache protocol. Rows start at 0
    (``starts`` all zero, ``ends`` = lengths), so code reading a ragged cache's
    ``keys``/``starts``/``ends`` (the MTP head's context) reads the gathered view."""

    def __init__(self, table: BlockTable, width: int = 0, kv_bits: int | None = None):
        # no ``bits`` attribute: mlx-lm would route attention to its quantized kernel
        self.table, self.kv_bits = table, kv_bits
        self._lengths, self._offset = [0] * width, None
        self.kpool: Pool | None = None
        self.vpool: Pool | None = None

    @property
    def starts(self) -> list[int]:
        return [0] * len(self._lengths)

    @property
    def ends(self) -> list[int]:
        return self._lengths

    @ends.setter
    def ends(self, value: list[int]) -> None:
        self._lengths, self._offset = list(value), None

    def pools(self, keys_shape: tuple, values_shape: tuple, dtype) -> None:
        """Create this layer's pools (for tokens shaped ``[., H, ., D]``) and grow them to the table."""
        if self.kpool is None:
            self.kpool = Pool(keys_shape[1], keys_shape[3], dtype, self.kv_bits, blocked=True)
            self.vpool = Pool(values_shape[1], values_shape[3], dtype, self.kv_bits)
        self.kpool.grow(self.table.capacity * BLOCK)
        self.vpool.grow(self.table.capacity * BLOCK)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Append ``[B, H, N, D]`` after each row's tokens; return the gathered view."""
        self.append(keys, values)
        return self.fetch()

    def append(self, keys: mx.array, values: mx.array) -> None:
        """Store ``[B, H, N, D]`` after each row's tokens (an attention that reads the pools
        in place then never builds the gathered view)."""
        N = keys.shape[2]
        new = [n + N for n in self._lengths]
        self.table.ensure(new)
        self.pools(keys.shape, values.shape, keys.dtype)
        slots = self.table.slots(self._lengths, N)  # [B * N]
        self.kpool.write_heads(slots, keys)
        self.vpool.write_heads(slots, values)
        self.ends = new

    def fetch(self):
        """The rows' keys and values gathered as ``[B, H, T, D]`` each."""
        return self._view()

    def _view(self):
        index = self.table.gather(self._lengths)
        return (self.kpool.read(index, self._lengths, whole_blocks=True),
                self.vpool.read(index, self._lengths, whole_blocks=True))

    def paged_view(self):
        """(key pool, value pool ``[H, P, D]``, slots ``[B, T]``) for an attention kernel that
        reads the pools in place; None under ``kv_bits`` (tokens stored quantized)."""
        if self.kv_bits or self.kpool is None or not any(self._lengths):
            return None
        return self.kpool.parts[0], self.vpool.parts[0], self.table.slot_matrix(self._lengths)

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **_):
        """Mask ``[B, 1, N, T]``: row b's query j sees its columns 0 .. len_b + j."""
        if window_size is not None:
            raise NotImplementedError("PagedLayer does not support sliding windows")
        if len(set(self._lengths)) <= 1 and not return_array:
            return None if N == 1 else "causal"
        T = max(self._lengths, default=0) + N
        cols = mx.arange(T)[None, None, :]  # [1, 1, T]
        last = mx.array(self._lengths)[:, None, None] + mx.arange(N)[None, :, None]  # [B, N, 1]
        return (cols <= last)[:, None]

    @property
    def keys(self) -> mx.array | None:
        return None if self.kpool is None or not any(self._lengths) else self._view()[0]

    @property
    def values(self) -> mx.array | None:
        return None if self.vpool is None or not any(self._lengths) else self._view()[1]

    @property
    def state(self):
        return (self.keys, self.values)

    @property
    def nbytes(self) -> int:
        return 0 if self.kpool is None else self.kpool.nbytes + self.vpool.nbytes

    def used_bytes(self) -> int:
        slots = self.kpool.slots() if self.kpool else 0
        return 0 if not slots else self.nbytes * sum(self._lengths) // slots

    def empty(self) -> bool:
        return not any(self._lengths)

    def trim_rows(self, counts: list[int]) -> None:
        self.ends = [max(0, n - c) for n, c in zip(self._lengths, counts)]

    def extract(self, row: int, n: int | None = None) -> KVCache:
        """Row ``row``'s first ``n`` tokens (all by default) as an mlx-lm single-sequence
        ``KVCache`` (dequantized under kv_bits)."""
        n = self._lengths[row] if n is None else min(n, self._lengths[row])
        sub = BlockTable([self.table.rows[row]])
        index = sub.gather([n])
        single = KVCache()
        single.keys = mx.contiguous(self.kpool.read(index, [n], whole_blocks=True))
        single.values = mx.contiguous(self.vpool.read(index, [n], whole_blocks=True))
        single.offset = n
        return single


class PagedKV(BatchKV):
    """All layers of one batch over one ``BlockTable``; row edits apply to every layer."""

    def __init__(self, layers: list[PagedLayer], table: BlockTable):
        super().__init__(layers)
        self.table = table

    @classmethod
    def empty(cls, n_layers: int, width: int = 0, kv_bits: int | None = None) -> "PagedKV":
        table = BlockTable([[] for _ in range(width)])
        return cls([PagedLayer(table, width, kv_bits) for _ in range(n_layers)], table)

    def trim_rows(self, counts: list[int]) -> None:
        super().trim_rows(counts)
        self.table.release_tail(self.lengths())

    def filter(self, keep: list[int]) -> None:
        """Keep rows ``keep`` (in that order); free the others' blocks and repack the pools
        once free blocks pass COMPACT_SLACK of them (allocation stays close to need)."""
        table = self.table
        for layer in self.layers:
            layer.ends = [layer.ends[i] for i in keep]
        kept = set(keep)
        table.free += [blk for i, row in enumerate(table.rows) if i not in kept for blk in row]
        table.rows = [table.rows[i] for i in keep]
        table._memo.clear()
        if not keep:
            table.free, table.capacity = [], 0
            for layer in self.layers:
                layer.kpool = layer.vpool = None
        elif len(table.free) > COMPACT_SLACK * table.capacity:
            freed = len(table.free)
            slots = mx.array(table.compact())
            for layer in self.layers:
                if layer.kpool is not None:
                    layer.kpool.take(slots, whole_blocks=True)
                    layer.vpool.take(slots, whole_blocks=True)
            log.debug("kv_compact", blocks=table.capacity, freed=freed)

    def extend(self, other: BatchKV) -> None:
        """Append ``other``'s rows (dense ragged or paged) after this batch's rows."""
        lengths, starts = other.lengths(), other.layers[0].starts
        first = self.width
        self.table.rows += [[] for _ in lengths]
        self.table.ensure(self.lengths() + lengths)
        dst = mx.array(self.table.row_slots(list(range(first, first + len(lengths))), lengths))
        tokens = _token_rows(other.layers[0].keys, starts, lengths)  # how each array's tokens are taken
        for mine, theirs in zip(self.layers, other.layers):
            keys, values = theirs.keys, theirs.values  # [B', H, C, D]
            if keys is not None and sum(lengths):
                mine.pools(keys.shape, values.shape, keys.dtype)
                # written as a forward's tokens are (the kernels' in-place write): a prompt-cache
                # hit's 1,440 tokens scattered element by element cost ~0.4 s a hit
                mine.kpool.write_heads(dst, tokens(keys))
                mine.vpool.write_heads(dst, tokens(values))
            mine.ends = mine.ends + lengths

    def move_tokens(self, rows: list[int], src: list[int], dst: list[int]) -> None:
        """Copy token ``src[i]`` of row ``rows[i]`` to its position ``dst[i]``: slot moves,
        once per layer's pools (the table is shared)."""
        s, d = mx.array(self.table.slots_of(rows, src)), mx.array(self.table.slots_of(rows, dst))
        for layer in self.layers:
            if layer.kpool is not None:
                layer.kpool.move(s, d)
                layer.vpool.move(s, d)

    def arrays(self) -> list[mx.array]:
        return [p for layer in self.layers if layer.kpool is not None
                for p in layer.kpool.parts + layer.vpool.parts]


@attrs.frozen
class KVLayout:
    """How a batch cache stores its rows (``EngineConfig.kv_layout`` and ``kv_bits``)."""

    kind: str = DEFAULT_KV_LAYOUT
    bits: int | None = None

    def empty(self, n_layers: int, width: int = 0) -> BatchKV:
        return batch_kv(n_layers, width, self.kind, self.bits)


def batch_kv(n_layers: int, width: int = 0, layout: str = DEFAULT_KV_LAYOUT, kv_bits: int | None = None) -> BatchKV:
    """An empty batch cache: ``paged`` (blocks, allocation close to need) or ``dense`` (one
    buffer padded to the longest row). ``kv_bits`` (8, 4) stores keys/values quantized,
    which only the paged layout does."""
    if layout == "paged" or kv_bits:
        return PagedKV.empty(n_layers, width, kv_bits)
    return BatchKV.empty(n_layers, width)


def _token_rows(x: mx.array | None, starts: list[int], lengths: list[int]):
    """How a ragged cache's arrays (``x``'s shape ``[B, H, C, D]``) give their tokens as
    ``[1, H, n, D]``, rows one after another: one row a slice (no copy), else a gather whose
    index is built once for every layer."""
    if len(lengths) == 1 or x is None:
        return lambda a: a[:, :, starts[0]:starts[0] + lengths[0]]
    C = x.shape[2]
    src = mx.array(np.concatenate([i * C + s + np.arange(n) for i, (s, n) in enumerate(zip(starts, lengths))])
                   .astype(np.int32))
    return lambda a: mx.take(a.transpose(1, 0, 2, 3).reshape(a.shape[1], -1, a.shape[3]), src, axis=1)[None]
