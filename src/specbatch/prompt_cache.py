"""A bounded LRU prefix cache of target KV: multi-turn chats do not re-prefill history.

Finished requests *retire* their KV (prompt + emitted tokens, less the pending one) as
single-sequence caches; a new request reuses the longest cached prefix of its prompt and
prefills only the rest. Preempted requests do not retire (the specification says so).
"""

from __future__ import annotations

import collections

import attrs
from mlx_lm.models.cache import KVCache


@attrs.define
class Entry:
    tokens: tuple[int, ...]
    caches: list[KVCache]
    nbytes: int


def _common(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _cut(caches: list[KVCache], n: int) -> list[KVCache]:
    """New caches holding the first ``n`` tokens (fresh array objects: no aliasing)."""
    out = []
    for c in caches:
        cut = KVCache()
        cut.keys, cut.values, cut.offset = c.keys[..., :n, :], c.values[..., :n, :], n
        out.append(cut)
    return out


class PromptCache:
    """LRU of retired sequences, bounded by bytes."""

    def __init__(self, max_bytes: int = 256 << 20, min_tokens: int = 8):
        self.max_bytes, self.min_tokens = max_bytes, min_tokens
        self._entries: collections.OrderedDict[tuple[int, ...], Entry] = collections.OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = 0

    def retire(self, tokens: list[int], caches: list[KVCache]) -> None:
        """Store a finished sequence's KV (``caches`` must hold at least ``tokens``)."""
        n = len(tokens)
        if self.max_bytes <= 0 or n < self.min_tokens:
            return
        key = tuple(tokens)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        kept = _cut(caches, n)
        nbytes = sum(c.keys.nbytes + c.values.nbytes for c in kept)
        if nbytes > self.max_bytes:
            return
        self._entries[key] = Entry(key, kept, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes

    def lookup(self, prompt: list[int]) -> tuple[list[KVCache] | None, int]:
        """Caches holding the longest cached prefix of ``prompt`` (at most len - 1 tokens)."""
        best, best_n = None, 0
        for entry in self._entries.values():
            n = min(_common(entry.tokens, prompt), len(prompt) - 1)
            if n > best_n:
                best, best_n = entry, n
        if best is None or best_n < self.min_tokens:
            self.misses += 1
            return None, 0
        self._entries.move_to_end(best.tokens)
        self.hits += 1
        return _cut(best.caches, best_n), best_n

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)
