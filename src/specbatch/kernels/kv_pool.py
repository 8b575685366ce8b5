"""One layer's keys or values in a paged cache: token slots that a block table hands out.

Float pools are head-major, ``[H, P, D]``: each KV head's slots in one row, so one head's keys
over a row's consecutive blocks lie side by side, as a dense cache's do. Token-major ``[P, H * D]``
pools had the attention kernel read one head's keys 768 bytes apart (the embedded target's 3 heads
of 64): 30 layers of width-1 attention over 1,000 tokens took 8.2 ms against 5.9 ms over dense
buffers, and a token-major view of a dense buffer took the same 8.4 ms, so the layout was the cost.
Quantized pools (``kv_bits``) stay token-major, ``[P, F * bits / 32]`` uint32 with scales and biases
``[P, F / group]`` (F = H * D): each token is quantized on its own, along its features.

Float key pools are blocked: each head's 16-slot block (a block table's block) stored as ``[D][16]``,
slot ``s``'s element ``d`` at ``(s // 16) * 16 * D + d * 16 + s % 16`` of the head's row, so the
attention kernel reads a block's keys with each score in a vector lane and transposes nothing (it
had transposed every key block it read). The array keeps its ``[H, P, D]`` shape; here every
read and write goes through those flat places.
"""

from __future__ import annotations

import mlx.core as mx

from .cpu import paged
from .block_table import BLOCK, group_size

# A pool reserves this many times the slots it must hold, so it grows ~log2(final / first) times
# rather than by every 1/16 (``block_table.GROW``); the headroom is zero pages, resident once written.
RESERVE = 2


def _with_slots(shape: tuple, axis: int, n: int) -> tuple:
    return shape[:axis] + (n,) + shape[axis + 1:]


class Pool:
    """One layer's keys or values over ``slots()`` token slots, float or quantized."""

    def __init__(self, heads: int, dim: int, dtype, bits: int | None, blocked: bool = False):
        self.heads, self.dim, self.dtype, self.bits = heads, dim, dtype, bits
        self.blocked = blocked and not bits  # keys: 16-slot blocks of [D][16] (module docstring)
        self.group = group_size(heads * dim) if bits else 0
        self.axis = 0 if bits else 1  # the slot axis of every part
        self.parts: list[mx.array] = []
        # the parts' slot count and bytes, kept here: every forward and every step's gauges ask (an
        # array's shape or size is a call into MLX; 120 of them a width-1 step)
        self._slots = self._bytes = 0
        self._reserved = 0  # slots the parts' arrays hold: ``_slots`` and the headroom past them

    def slots(self) -> int:
        return self._slots

    def grow(self, n_slots: int) -> None:
        """Hold at least ``n_slots``: within the reserve, no copy; past it, a copy into a new
        reserve of ``RESERVE`` times as many slots, whose slots past the held ones take no
        memory until written (``paged.pool_reserve``; MLX's zeros and no reserve without it)."""
        have = self.slots()
        if n_slots <= have:
            return
        if n_slots > self._reserved:
            self._reserve(n_slots)
        self._slots = n_slots
        self._bytes = sum(p.nbytes for p in self.parts) * n_slots // self._reserved

    def _reserve(self, n_slots: int) -> None:
        F = self.heads * self.dim
        if self.bits:
            shapes = [((0, F * self.bits // 32), mx.uint32), ((0, F // self.group), self.dtype),
                      ((0, F // self.group), self.dtype)]
        else:
            shapes = [((self.heads, 0, self.dim), self.dtype)]
        held = self.parts or [mx.zeros(shape, dtype) for shape, dtype in shapes]
        if not self._reserve_from(held, self._slots, n_slots):  # no kernel: exactly what is asked
            self.parts = [mx.concatenate([p, mx.zeros(_with_slots(p.shape, self.axis, n_slots - p.shape[self.axis]),
                                                      p.dtype)], axis=self.axis) for p in held]
            self._reserved = n_slots

    def _reserve_from(self, parts: list[mx.array], keep: int, n_slots: int) -> bool:
        """Hold ``parts``' first ``keep`` slots in a reserve of ``RESERVE * n_slots`` (the op's own
        arrays: the next in-place write may take their buffers); False without the kernel."""
        grown = [paged.pool_reserve(p, self.axis, n_slots * RESERVE, keep) for p in parts]
        if grown[0] is None:
            return False
        self.parts, self._reserved = grown, n_slots * RESERVE
        return True

    def _places(self, slots: mx.array) -> mx.array:
        """A blocked pool's flat places of ``slots`` ``[...]`` in a head's row: ``[..., D]``."""
        slots = slots.astype(mx.int32)[..., None]
        d = mx.arange(self.dim, dtype=mx.int32)
        return (slots // BLOCK) * (BLOCK * self.dim) + d * BLOCK + slots % BLOCK

    def _put(self, slots: mx.array, x: mx.array) -> None:
        """Store heads ``x`` ``[H, n, D]`` at ``slots`` ``[n]`` of a float pool."""
        p = self.parts[0]
        if not self.blocked:
            p[:, slots] = x
            return
        flat = p.reshape(self.heads, -1)  # [H, P * D]
        flat[:, self._places(slots).reshape(-1)] = x.reshape(self.heads, -1)
        self.parts[0] = flat.reshape(p.shape)

    def _get(self, slots: mx.array) -> mx.array:
        """A float pool's heads at ``slots`` ``[...]``: ``[H, ..., D]``."""
        p = self.parts[0]
        if not self.blocked:
            return p[:, slots]
        return p.reshape(self.heads, -1)[:, self._places(slots)]

    def write(self, slots: mx.array, x: mx.array) -> None:
        """Store tokens ``x`` ``[n, F]`` at ``slots`` ``[n]``."""
        if not self.bits:
            self._put(slots, x.reshape(-1, self.heads, self.dim).transpose(1, 0, 2))  # [H, n, D]
            return
        for p, v in zip(self.parts, mx.quantize(x, group_size=self.group, bits=self.bits)):
            p[slots] = v

    def write_heads(self, slots: mx.array, x: mx.array) -> None:
        """Store a forward's tokens ``x`` ``[B, H, N, D]`` at ``slots`` ``[B * N]``: one
        in-place kernel op where it applies (this pool's reference is the old array's last,
        so its buffer is donated), else scattered: a float pool takes the heads as they are, a
        quantized one token rows ``[B * N, H * D]``."""
        B, H, N, D = x.shape
        if self.bits:
            self.write(slots, x.transpose(0, 2, 1, 3).reshape(B * N, H * D))
            return
        written = paged.paged_write(self.parts[0], slots, x, self.blocked)
        if written is not None:
            self.parts[0] = written
        else:
            self._put(slots, x.transpose(1, 0, 2, 3).reshape(H, B * N, D))  # [H, B * N, D]

    def read(self, index: mx.array | int, lengths: list[int], whole_blocks: bool = False) -> mx.array:
        """The rows' tokens as ``[B, H, T, D]`` (index: slots ``[B, T]`` or a first slot).
        ``whole_blocks``: each run of 16 of index's columns from a multiple of 16 lies in one
        block, in order, as a block table's slots do (past a row's length: masked)."""
        T = max(lengths)
        # contiguous: MLX's CPU attention on a transposed view ran ~12x slower than on a copy
        # (measured [16, 3, 1504, 64]: 70 ms vs 15 ms with the copy)
        if not self.bits:
            if self.blocked and (whole_blocks or isinstance(index, int) and index % BLOCK == 0):
                return self._read_blocks(index, T)
            if isinstance(index, int):
                if not self.blocked:
                    return mx.contiguous(self.parts[0][None, :, index:index + T])  # [1, H, T, D]
                index = mx.arange(index, index + T, dtype=mx.int32)[None]  # [1, T]
            return mx.contiguous(self._get(index).transpose(1, 0, 2, 3))  # [H, B, T, D] -> [B, H, T, D]
        got = [p[index:index + T][None] if isinstance(index, int) else p[index] for p in self.parts]  # [B, T, w]
        x = mx.dequantize(*got, group_size=self.group, bits=self.bits)
        return mx.contiguous(x.reshape(*x.shape[:2], self.heads, self.dim).transpose(0, 2, 1, 3))

    def _blocks(self, ids: mx.array | slice) -> mx.array:
        """A blocked pool's 16-slot blocks ``ids`` ``[...]`` (or a slice: a view) as they lie,
        ``[H, ..., D * 16]``: reads and compaction take whole blocks, never element by element."""
        return self.parts[0].reshape(self.heads, -1, self.dim * BLOCK)[:, ids]

    def _read_blocks(self, index: mx.array | int, T: int) -> mx.array:
        """``read`` of a blocked key pool over whole blocks (a first slot is a block's): each
        16-slot block taken as it lies (a contiguous ``[D][16]``) and turned back to token rows,
        not gathered element by element (a 1,740-token row's 30 layers: 240-320 -> ~70 ms, on
        every finished row the prompt cache keeps)."""
        H, D, nb = self.heads, self.dim, -(-T // BLOCK)
        if isinstance(index, int):
            taken = self._blocks(slice(index // BLOCK, index // BLOCK + nb))[:, None]  # a view: [H, 1, nb, D * 16]
        else:
            taken = self._blocks(index[:, ::BLOCK] // BLOCK)  # [H, B, nb, D * 16]
        rows = taken.reshape(H, -1, nb, D, BLOCK).transpose(1, 0, 2, 4, 3)  # [B, H, nb, 16, D]
        return mx.contiguous(rows.reshape(rows.shape[0], H, nb * BLOCK, D)[:, :, :T])

    def move(self, src: mx.array, dst: mx.array) -> None:
        """Copy the tokens at slots ``src`` to ``dst`` (a tree's accepted path, compacted)."""
        if not self.bits:
            self._put(dst, self._get(src))
            return
        for p in self.parts:
            p[dst] = p[src]

    def take(self, slots: mx.array, whole_blocks: bool = False) -> None:
        """Keep only ``slots`` (in that order; whole blocks' worth where blocked), into a new
        reserve (``grow``): compaction after rows leave. ``whole_blocks``: slots run 16 to a
        block from a multiple of 16 (a block table's), so a blocked pool takes each block as it lies."""
        n, H, D = slots.size, self.heads, self.dim
        if self.blocked and whole_blocks:
            kept = [self._blocks(slots[::BLOCK] // BLOCK).reshape(H, n, D)]
        elif self.blocked:
            if n % BLOCK:
                raise ValueError(f"a blocked pool keeps whole blocks of {BLOCK} slots, not {n}")
            kept = self._get(slots).reshape(H, -1, BLOCK, D).transpose(0, 1, 3, 2)  # [H, n / 16, D, 16]
            kept = [mx.contiguous(kept).reshape(H, -1, D)]
        else:
            kept = [mx.take(p, slots, axis=self.axis) for p in self.parts]
        if not self._reserve_from(kept, n, n):
            self.parts, self._reserved = kept, n
        self._slots = n
        self._bytes = sum(p.nbytes for p in self.parts) * n // max(self._reserved, 1)  # none kept: 0

    @property
    def nbytes(self) -> int:
        return self._bytes
