"""A bounded LRU prefix cache of target KV: multi-turn chats do not re-prefill history,
and requests sharing a system prompt prefill it once.

Finished requests *retire* their KV (prompt + emitted tokens, less the pending one) as
single-sequence caches; a new request reuses the longest cached prefix of its prompt and
prefills only the rest. Preempted requests do not retire (the specification says so).
Retiring only at the end missed the common chat case, concurrent requests with one
system prompt, so admission also *offers* each admitted prompt (``offer_rows``), and a
burst whose prompts share a prefix gets that prefix prefilled once first (``warm``).
Entries are copies (``_cut``), so ``nbytes`` is what the cache really pins.
"""

from __future__ import annotations

import collections

import attrs
import mlx.core as mx
import structlog
from mlx_lm.models.cache import KVCache

log = structlog.get_logger(__name__)


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
        # a copy: a slice would pin the whole (larger) source buffer behind a small nbytes
        cut.keys, cut.values, cut.offset = mx.contiguous(c.keys[..., :n, :]), mx.contiguous(c.values[..., :n, :]), n
        out.append(cut)
    return out


def _view(caches: list[KVCache], n: int) -> list[KVCache]:
    """New caches over the first ``n`` tokens of ``caches``' arrays (views, no copy: the first
    append copies them into a buffer of its own, and an entry's buffers are never donated
    while it holds them; a copy here cost ~70 ms a 1,440-token hit)."""
    out = []
    for c in caches:
        view = KVCache()
        view.keys, view.values, view.offset = c.keys[..., :n, :], c.values[..., :n, :], n
        out.append(view)
    return out


class PromptCache:
    """LRU of retired sequences, bounded by bytes."""

    def __init__(self, max_bytes: int = 256 << 20, min_tokens: int = 8):
        self.max_bytes, self.min_tokens = max_bytes, min_tokens
        self._entries: collections.OrderedDict[tuple[int, ...], Entry] = collections.OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = 0
        self.reused_tokens = self.warmed_tokens = 0  # prompt tokens served from entries; prefilled by warm
        self.token_bytes = 0  # learnt at the first retire: skip work whose entry could not fit
        self._offered: set[str] = set()  # request ids whose prompt went in at admission

    def retire(self, tokens: list[int], caches: list[KVCache]) -> None:
        """Store a finished sequence's KV (``caches`` must hold at least ``tokens``)."""
        n = len(tokens)
        if self.max_bytes <= 0 or n < self.min_tokens:
            return
        key = tuple(tokens)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        nbytes = sum(c.keys[..., :n, :].nbytes + c.values[..., :n, :].nbytes for c in caches)
        self.token_bytes = nbytes // n
        if nbytes > self.max_bytes:
            return
        for old in [k for k in self._entries if k == key[:len(k)]]:  # covered by the new entry
            self.nbytes -= self._entries.pop(old).nbytes
        kept = _cut(caches, n)
        mx.eval([a for c in kept for a in (c.keys, c.values)])  # copy now, before the source moves on
        self._entries[key] = Entry(key, kept, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes

    def _best(self, prompt: list[int]) -> tuple[Entry | None, int]:
        best, best_n = None, 0
        for entry in self._entries.values():
            n = min(_common(entry.tokens, prompt), len(prompt) - 1)
            if n > best_n:
                best, best_n = entry, n
        return best, best_n

    def lookup(self, prompt: list[int]) -> tuple[list[KVCache] | None, int]:
        """Caches holding the longest cached prefix of ``prompt`` (at most len - 1 tokens)."""
        best, best_n = self._best(prompt)
        if best is None or best_n < self.min_tokens:
            self.misses += 1
            return None, 0
        self._entries.move_to_end(best.tokens)
        self.hits += 1
        self.reused_tokens += best_n
        return _view(best.caches, best_n), best_n

    def warm(self, runner, prompts: list[list[int]]) -> None:
        """Prefill, once, each prefix that arriving ``prompts`` share with one another and
        the cache lacks (a burst of requests with one system prompt), so their lookups hit."""
        if self.max_bytes <= 0:
            return
        from .runner import prefill
        for i, prompt in enumerate(prompts):
            shared = max((min(_common(tuple(prompt), other), len(prompt) - 1, len(other) - 1)
                          for j, other in enumerate(prompts) if j != i), default=0)
            if shared < self.min_tokens or self._best(prompt)[1] >= shared or not self._fits(shared):
                continue
            cache = runner.make_cache()
            prefill(runner, prompt[:shared], cache)
            self.retire(prompt[:shared], cache)
            self.warmed_tokens += shared
            log.info("prefix_warm", tokens=shared)

    def offer(self, request, caches) -> None:
        """Offer an admitted request's prompt; ``caches`` hold it, or are a callable giving the
        caches of its first n tokens for n (only the tokens kept are read)."""
        if self.max_bytes <= 0 or request.id in self._offered or len(request.prompt) <= self.min_tokens:
            return
        self._offered.add(request.id)
        n = len(request.prompt) - 1
        if self._best(request.prompt)[1] < n and self._fits(n):  # not already covered, and room
            self.retire(request.prompt[:-1], caches(n) if callable(caches) else caches)

    def _fits(self, n: int) -> bool:
        """Whether an entry of ``n`` tokens could be kept (unknown before the first retire)."""
        return n * self.token_bytes <= self.max_bytes

    def offer_rows(self, loop) -> None:
        """Offer the prompts of rows admitted since the last call (their KV holds them), so
        requests arriving while these still run reuse the shared part."""
        for i, row in enumerate(loop.rows):
            self.offer(row.request, lambda n, i=i: loop.kv.extract(i, n))
        if len(self._offered) > 4 * len(loop.rows) + 1024:  # forget requests long gone
            self._offered = {r.request.id for r in loop.rows}

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)
