"""The prefix cache: a shared system prompt is prefilled once, and its byte bound holds."""

from __future__ import annotations

import attrs
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from specbatch.kernels.kv import BatchKV
from specbatch.kernels.paged_kv import batch_kv
from specbatch.kernels.prompt_cache import PromptCache
from specbatch.kernels.runner import ModelRunner, prefill

SYSTEM = list(range(10, 60))  # a 50-token shared system prompt


class CountingRunner(ModelRunner):
    """Counts the tokens it forwards (prefill work)."""

    def __init__(self, model):
        super().__init__(model)
        self.tokens = 0

    def forward(self, tokens, cache):
        self.tokens += tokens.size
        return super().forward(tokens, cache)

    def forward_last(self, tokens, cache):  # prefill's path (the head at the last position only)
        self.tokens += tokens.size
        return super().forward_last(tokens, cache)


def single(runner, tokens):
    cache = runner.make_cache()
    prefill(runner, tokens, cache)
    return cache


def test_burst_sharing_a_system_prompt_prefills_it_once(tiny):
    runner = CountingRunner(tiny.model)
    cache = PromptCache(max_bytes=64 << 20)
    prompts = [SYSTEM + [100 + i, 200 + i, 300 + i] for i in range(4)]
    cache.warm(runner, prompts)
    assert runner.tokens == len(SYSTEM)  # the shared 50 tokens, once
    for p in prompts:
        got, n = cache.lookup(p)
        assert n >= len(SYSTEM) and got[0].offset == n
    assert cache.hits == 4 and cache.misses == 0


def test_reused_prefix_gives_the_same_logits(tiny):
    runner = ModelRunner(tiny.model)
    cache = PromptCache(max_bytes=64 << 20)
    a, b = SYSTEM + [1, 2, 3], SYSTEM + [7, 8]
    cache.retire(a, single(runner, a))
    got, n = cache.lookup(b)
    assert n == len(SYSTEM)
    logits = prefill(runner, b[n:], got)
    assert mx.allclose(logits, prefill(runner, b, runner.make_cache()), atol=1e-4)


@attrs.define
class _Req:
    id: str
    prompt: list[int]


@attrs.define
class _Row:
    request: _Req


@attrs.define
class _Loop:
    rows: list
    kv: BatchKV


def test_offer_rows_serves_an_arrival_while_the_first_still_runs(tiny):
    runner = ModelRunner(tiny.model)
    first = SYSTEM + [1, 2, 3]
    kv = batch_kv(runner.n_layers)
    kv.extend(BatchKV.from_singles(single(runner, first)))
    cache = PromptCache(max_bytes=64 << 20)
    cache.offer_rows(_Loop([_Row(_Req("a", first))], kv))
    cache.offer_rows(_Loop([_Row(_Req("a", first))], kv))  # offered once
    assert len(cache) == 1
    got, n = cache.lookup(SYSTEM + [9, 9])
    assert n == len(SYSTEM)


def test_memory_bound_holds_and_entries_are_copies(tiny):
    runner = ModelRunner(tiny.model)
    one = single(runner, SYSTEM)
    per_token = sum(c.keys[..., :1, :].nbytes + c.values[..., :1, :].nbytes for c in one)
    cache = PromptCache(max_bytes=per_token * 120)
    for i in range(6):
        p = [i] + SYSTEM
        cache.retire(p, single(runner, p))
        assert cache.nbytes <= cache.max_bytes
    assert len(cache) == 2  # 51-token entries: two fit in 120 tokens' bytes
    held = sum(a.nbytes for e in cache._entries.values() for c in e.caches for a in (c.keys, c.values))
    assert held == cache.nbytes
    for e in cache._entries.values():
        assert e.caches[0].keys.shape[2] == len(e.tokens)  # no slack kept
    assert isinstance(e.caches[0], KVCache)


def test_a_bound_too_small_for_the_prefix_skips_the_work(tiny):
    runner = CountingRunner(tiny.model)
    cache = PromptCache(max_bytes=1024)  # less than one 50-token entry
    prompts = [SYSTEM + [100 + i, 200 + i] for i in range(4)]
    cache.warm(runner, prompts)  # the first prefill learns that nothing of this size fits
    cache.warm(runner, prompts)
    assert runner.tokens == len(SYSTEM) and len(cache) == 0


def test_a_hits_caches_grow_without_touching_the_entry(tiny):
    """A hit's caches are views of the entry's arrays: the forwards that extend them, and a
    batch that takes them in, leave the entry's keys and values as they were."""
    runner = ModelRunner(tiny.model)
    cache = PromptCache()
    cache.retire(SYSTEM, single(runner, SYSTEM))
    before = [mx.array(a) for c in cache._entries[tuple(SYSTEM)].caches for a in (c.keys, c.values)]
    mx.eval(before)
    hit, n = cache.lookup(SYSTEM + [7, 8, 9])
    assert n == len(SYSTEM)
    prefill(runner, [7, 8, 9], hit)  # appends after the cached tokens
    batch = batch_kv(len(hit), 0, "paged")
    batch.extend(BatchKV.from_singles(hit))
    mx.eval(batch.arrays())
    after = [a for c in cache._entries[tuple(SYSTEM)].caches for a in (c.keys, c.values)]
    assert all(mx.array_equal(x, y).item() for x, y in zip(before, after))
    assert batch.lengths() == [len(SYSTEM) + 3]
    again, _ = cache.lookup(SYSTEM + [7, 8, 9])
    assert mx.array_equal(again[0].keys, before[0]).item()
