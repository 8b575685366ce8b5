"""Ragged per-row KV cache: each row keeps its own start and end.

mlx-lm's ``BatchKVCache`` shares one end index across rows, so it trims every row by the
same count; speculative batching rejects a different number of drafts per row, so here
row ``b`` occupies columns ``[start[b], end[b])`` and trims by its own count. One instance
per layer, as mlx-lm expects; ``BatchKV`` applies row edits to all layers at once.

This dense layout pads every row to the longest one (``paged_kv`` is the other, chosen by
``EngineConfig.kv_layout``); prefill batches and single-row conversions are always dense.
mlx-lm protocol: ``update_and_fetch`` (each row at its own end), ``offset`` (``[B]``, for
RoPE), ``make_mask`` (``[B, 1, N, T]``), ``state``, ``nbytes``, ``trim``. Full-attention
layers only (a plain ``KVCache`` in mlx-lm); others are refused by :func:`check_supported`.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

STEP = 64  # grow capacity in blocks: rare copies, little padding (mlx-lm uses 256)


def _round_up(n: int) -> int:
    return max(STEP, (n + STEP - 1) // STEP * STEP)


class RaggedKVCache:
    """One layer's keys/values ``[B, H, C, D]`` with per-row ``[start, end)``."""

    def __init__(self, starts: list[int] | None = None):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self._starts: list[int] = list(starts or [])
        self._ends: list[int] = list(self._starts)
        self._offset: mx.array | None = None  # cached: RoPE reads it twice per layer call

    @classmethod
    def left_padded(cls, pads: list[int]) -> "RaggedKVCache":
        """An empty cache for a left-padded prefill of ``[B, L]``: row b's first ``pads[b]``
        columns are padding. Its offset starts at ``-pads[b]``, so row b's first real token
        gets RoPE position 0; after the prefill the row holds ``[pads[b], L)``."""
        cache = cls(pads)
        cache.ends = [0] * len(pads)
        return cache

    @property
    def starts(self) -> list[int]:
        return self._starts

    @starts.setter
    def starts(self, value: list[int]) -> None:
        self._starts, self._offset = value, None

    @property
    def ends(self) -> list[int]:
        return self._ends

    @ends.setter
    def ends(self, value: list[int]) -> None:
        self._ends, self._offset = value, None

    # -- the mlx-lm cache protocol -------------------------------------------------
    @property
    def offset(self) -> mx.array:
        """Tokens each row holds, ``[B]``: the RoPE position of its next token."""
        if self._offset is None:
            self._offset = mx.array([e - s for s, e in zip(self.starts, self.ends)], dtype=mx.int32)
        return self._offset

    @property
    def width(self) -> int:
        return len(self.ends)

    def lengths(self) -> list[int]:
        return [e - s for s, e in zip(self.starts, self.ends)]

    def _uniform(self) -> bool:
        return len(set(self.ends)) <= 1

    def _reserve(self, n_new: int, like: mx.array, v_like: mx.array) -> None:
        need = max(self.ends, default=0) + n_new
        if self.keys is not None and need <= self.keys.shape[2]:
            return
        B, H, _, D = like.shape
        cap = _round_up(need)
        keys = mx.zeros((B, H, cap, D), like.dtype)
        values = mx.zeros((B, H, cap, v_like.shape[3]), v_like.dtype)
        if self.keys is not None:
            used = max(self.ends)
            keys[..., :used, :] = self.keys[..., :used, :]
            values[..., :used, :] = self.values[..., :used, :]
        self.keys, self.values = keys, values

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Append ``[B, H, N, D]`` at each row's own end; return keys/values to attend."""
        N = keys.shape[2]
        self._reserve(N, keys, values)
        if self._uniform():
            e = self.ends[0]
            self.keys[..., e:e + N, :] = keys
            self.values[..., e:e + N, :] = values
        else:
            rows = mx.arange(self.width)[:, None]  # [B, 1]
            cols = mx.array(self.ends)[:, None] + mx.arange(N)  # [B, N]
            self.keys[rows, :, cols] = keys.transpose(0, 2, 1, 3)  # [B, N, H, D]
            self.values[rows, :, cols] = values.transpose(0, 2, 1, 3)
        self.ends = [e + N for e in self.ends]
        top = max(self.ends)
        return self.keys[..., :top, :], self.values[..., :top, :]

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **_):
        """Mask ``[B, 1, N, T]``: row b's query j sees columns start[b] .. end[b] + j."""
        if window_size is not None:
            raise NotImplementedError("RaggedKVCache does not support sliding windows")
        if self._uniform() and not any(self.starts) and not return_array:
            return None if N == 1 else "causal"
        T = max(self.ends, default=0) + N
        cols = mx.arange(T)[None, None, :]  # [1, 1, T]
        last = mx.array(self.ends)[:, None, None] + mx.arange(N)[None, :, None]  # [B, N, 1]
        first = mx.array(self.starts)[:, None, None]
        # A padding query (left-padded prefill) sees only itself: never an all-masked row,
        # whose softmax would be NaN and poison the next layer's padding KV.
        return (((cols >= first) & (cols <= last)) | (cols == last))[:, None]

    @property
    def state(self):
        top = max(self.ends, default=0)
        if self.keys is None:
            return None, None
        return self.keys[..., :top, :], self.values[..., :top, :]

    @state.setter
    def state(self, value):
        self.keys, self.values = value

    @property
    def meta_state(self):
        return {"starts": list(self.starts), "ends": list(self.ends)}

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def used_bytes(self) -> int:
        """Bytes the held tokens need (what ``nbytes`` would be with no slack)."""
        if self.keys is None:
            return 0
        per_token = (self.keys.nbytes + self.values.nbytes) // (self.keys.shape[0] * self.keys.shape[2])
        return per_token * sum(self.lengths())

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """mlx-lm's trim: every row by ``n`` (clipped to what each holds)."""
        self.trim_rows([n] * self.width)
        return n

    def empty(self) -> bool:
        return self.keys is None

    def size(self) -> int:
        return max(self.lengths(), default=0)

    # -- row edits -------------------------------------------------------------------
    def trim_rows(self, counts: list[int]) -> None:
        """Drop the last ``counts[b]`` tokens of each row b (per-row rollback)."""
        self.ends = [max(s, e - c) for s, e, c in zip(self.starts, self.ends, counts)]

    def filter(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (in that order); shrink the buffer to what they use."""
        self.starts = [self.starts[i] for i in keep]
        self.ends = [self.ends[i] for i in keep]
        if self.keys is None:
            return
        if not keep:
            self.keys = self.values = None
            self.starts, self.ends = [], []
            return
        lo, hi = min(self.starts), max(self.ends)
        idx = mx.array(keep)
        cap = _round_up(hi - lo)
        self.keys = _fit(self.keys[idx, :, lo:hi, :], cap)
        self.values = _fit(self.values[idx, :, lo:hi, :], cap)
        self.starts = [s - lo for s in self.starts]
        self.ends = [e - lo for e in self.ends]

    def extend(self, other: "RaggedKVCache") -> None:
        """Append ``other``'s rows after this cache's rows."""
        if other.keys is None:
            self.starts += other.starts
            self.ends += other.ends
            return
        if self.keys is None:
            pad = mx.zeros((self.width, *other.keys.shape[1:2], 0, other.keys.shape[3]), other.keys.dtype)
            padv = mx.zeros((self.width, *other.values.shape[1:2], 0, other.values.shape[3]), other.values.dtype)
            mine_k, mine_v = pad, padv
        else:
            mine_k, mine_v = self.keys, self.values
        cap = _round_up(max(max(self.ends, default=0), max(other.ends)))
        self.keys = mx.concatenate([_fit(mine_k, cap), _fit(other.keys, cap)], axis=0)
        self.values = mx.concatenate([_fit(mine_v, cap), _fit(other.values, cap)], axis=0)
        self.starts += other.starts
        self.ends += other.ends

    def extract(self, row: int, n: int | None = None) -> KVCache:
        """Row ``row``'s first ``n`` tokens (all by default) as an mlx-lm single-sequence ``KVCache``."""
        single = KVCache()
        s, e = self.starts[row], self.ends[row] if n is None else min(self.ends[row], self.starts[row] + n)
        single.keys = mx.contiguous(self.keys[row:row + 1, :, s:e, :])
        single.values = mx.contiguous(self.values[row:row + 1, :, s:e, :])
        single.offset = e - s
        return single

    @classmethod
    def from_single(cls, single: KVCache) -> "RaggedKVCache":
        """An mlx-lm ``KVCache`` (one sequence) as a one-row ragged cache: views of its tokens, no
        room (every caller extends a batch with it, which copies them: a padded copy cost ~60 ms)."""
        cache = cls([0])
        if single.keys is not None and single.offset > 0:
            n = single.offset
            cache.keys, cache.values = single.keys[..., :n, :], single.values[..., :n, :]
            cache.ends = [n]
        return cache


def _fit(x: mx.array, cap: int) -> mx.array:
    """Pad or cut axis 2 of ``x`` to ``cap`` columns."""
    have = x.shape[2]
    if have >= cap:
        return x[..., :cap, :]
    return mx.pad(x, [(0, 0), (0, 0), (0, cap - have), (0, 0)])


class BatchKV:
    """All layers' ragged caches of one batch; row edits apply to every layer."""

    def __init__(self, layers: list[RaggedKVCache]):
        self.layers = layers

    @classmethod
    def empty(cls, n_layers: int, width: int = 0) -> "BatchKV":
        """An empty dense batch cache (one buffer per layer padded to the longest row);
        ``paged_kv.batch_kv`` chooses between this and the paged layout."""
        return cls([RaggedKVCache([0] * width) for _ in range(n_layers)])

    @classmethod
    def from_singles(cls, singles: list[KVCache]) -> "BatchKV":
        """Single-sequence caches convert to their batch class (one row)."""
        return cls([RaggedKVCache.from_single(c) for c in singles])

    @property
    def width(self) -> int:
        return self.layers[0].width

    def lengths(self) -> list[int]:
        return self.layers[0].lengths()

    def trim_rows(self, counts: list[int]) -> None:
        for layer in self.layers:
            layer.trim_rows(counts)

    def filter(self, keep: list[int]) -> None:
        for layer in self.layers:
            layer.filter(keep)

    def extend(self, other: "BatchKV") -> None:
        for mine, theirs in zip(self.layers, other.layers):
            mine.extend(theirs)

    def extract(self, row: int, n: int | None = None) -> list[KVCache]:  # the prompt cache's n: one copy
        return [layer.extract(row, n) for layer in self.layers]

    def move_tokens(self, rows: list[int], src: list[int], dst: list[int]) -> None:
        """Copy token ``src[i]`` of row ``rows[i]`` to its position ``dst[i]``, every layer."""
        r = mx.array(rows)
        for layer in self.layers:
            cs = mx.array([layer.starts[b] + c for b, c in zip(rows, src)])
            cd = mx.array([layer.starts[b] + c for b, c in zip(rows, dst)])
            layer.keys[r, :, cd] = layer.keys[r, :, cs]  # [moved, H, D]
            layer.values[r, :, cd] = layer.values[r, :, cs]

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def used_bytes(self) -> int:
        return sum(layer.used_bytes() for layer in self.layers)

    def arrays(self) -> list[mx.array]:
        return [a for layer in self.layers for a in (layer.keys, layer.values) if a is not None]


def check_supported(model) -> None:
    """Refuse, clearly, models whose layers need a cache other than a plain KVCache."""
    kinds = {type(c).__name__ for c in model.make_cache()} if hasattr(model, "make_cache") else {"KVCache"}
    if kinds != {"KVCache"}:
        raise ValueError(f"model type {getattr(model, 'model_type', type(model).__name__)!r} uses {sorted(kinds)} "
                         "caches; specbatch's ragged batch cache covers full-attention models (llama, mistral, "
                         "qwen2, qwen3, ...)")
