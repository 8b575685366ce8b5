"""The ragged cache gives each row exactly what running that row alone gives."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache

from specbatch.kernels.kv import BatchKV, RaggedKVCache, check_supported
from specbatch.kernels.paged_kv import batch_kv
from specbatch.kernels.build import new_engine


def alone_logits(model, tokens: list[int], n: int) -> mx.array:
    """Logits of the last ``n`` tokens when the row runs alone from scratch."""
    return model(mx.array(tokens)[None])[0, -n:]


def prefill_row(model, tokens: list[int]) -> BatchKV:
    cache = [KVCache() for _ in model.layers]
    model(mx.array(tokens)[None], cache=cache)
    return BatchKV.from_singles(cache)


ops = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(1, 4)),
    st.tuples(st.just("trim"), st.lists(st.integers(0, 3), min_size=6, max_size=6)),
    st.tuples(st.just("remove"), st.integers(0, 5)),
    st.tuples(st.just("add"), st.integers(1, 12)),
), min_size=1, max_size=8)


@pytest.mark.parametrize("layout", ["dense", "paged"])
@pytest.mark.parametrize("which", ["tiny", "tiny_qwen"])
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4), schedule=ops, seed=st.integers(0, 99))
def test_ragged_cache_matches_rows_alone(request, which, layout, lengths, schedule, seed):
    model = request.getfixturevalue(which).model
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(3, 500) for _ in range(n)]  # noqa: E731
    histories: list[list[int]] = []
    kv = batch_kv(len(model.layers), layout=layout)
    for n in lengths:
        histories.append(draw(n))
        kv.extend(prefill_row(model, histories[-1]))
    for op, arg in schedule:
        if op == "append" and histories:
            new = [draw(arg) for _ in histories]
            logits = model(mx.array(new), cache=kv.layers)  # [B, arg, V]
            for b, toks in enumerate(new):
                histories[b] += toks
                assert mx.allclose(logits[b], alone_logits(model, histories[b], arg), atol=1e-4), (op, b)
        elif op == "trim" and histories:
            counts = [min(arg[b % len(arg)], len(h) - 1) for b, h in enumerate(histories)]
            kv.trim_rows(counts)
            histories = [h[:len(h) - c] for h, c in zip(histories, counts)]
        elif op == "remove" and len(histories) > 1:
            gone = arg % len(histories)
            keep = [i for i in range(len(histories)) if i != gone]
            kv.filter(keep)
            histories = [histories[i] for i in keep]
        elif op == "add":
            histories.append(draw(arg))
            kv.extend(prefill_row(model, histories[-1]))
        assert kv.lengths() == [len(h) for h in histories]
    if histories:  # a final step checks the surviving rows once more
        logits = model(mx.array([[5]] * len(histories)), cache=kv.layers)
        for b, h in enumerate(histories):
            assert mx.allclose(logits[b, 0], alone_logits(model, h + [5], 1)[0], atol=1e-4)


def test_extract_and_convert_round_trip(tiny):
    model = tiny.model
    kv = prefill_row(model, [5, 6, 7, 8])
    kv.extend(prefill_row(model, [9, 10]))
    single = kv.extract(1)
    assert single[0].offset == 2
    back = BatchKV.from_singles(single)
    assert back.lengths() == [2]
    a = model(mx.array([[11]]), cache=single)
    b = model(mx.array([[11]]), cache=back.layers)
    assert mx.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_extract_of_the_first_n_tokens_holds_exactly_them(tiny, layout):
    """``extract(row, n)``: arrays of exactly the row's first n tokens, equal to a whole
    extract's (the prompt cache keeps them with no second copy)."""
    model = tiny.model
    kv = batch_kv(len(model.layers), layout=layout)
    kv.extend(prefill_row(model, list(range(5, 25))))
    kv.extend(prefill_row(model, list(range(30, 41))))
    for row, n in ((0, 13), (1, 11), (1, 50)):
        whole, first = kv.extract(row), kv.extract(row, n)
        held = min(n, kv.lengths()[row])
        for w, f in zip(whole, first):
            assert f.offset == held and f.keys.shape[2] == held and f.values.shape[2] == held
            assert mx.array_equal(f.keys, w.keys[:, :, :held]).item()
            assert mx.array_equal(f.values, w.values[:, :, :held]).item()


def test_protocol_members():
    cache = RaggedKVCache([0, 0])
    k = mx.ones((2, 2, 3, 4))
    cache.update_and_fetch(k, k)
    assert cache.offset.tolist() == [3, 3]
    cache.trim_rows([1, 2])
    assert cache.offset.tolist() == [2, 1]
    mask = cache.make_mask(2)
    assert mask.shape == (2, 1, 2, 4)
    assert mask[1, 0, 0].tolist() == [True, True, False, False]  # 1 held + itself
    assert cache.nbytes > 0 and cache.is_trimmable()
    assert cache.used_bytes() == 2 * 2 * 4 * 4 * 3  # keys+values, 2 heads, dim 4, fp32, 3 tokens
    keys, values = cache.state
    assert keys.shape[2] == 2
    cache.filter([])
    assert cache.width == 0 and cache.nbytes == 0


def test_unsupported_architecture_is_refused():
    class Sliding:
        model_type = "gemma3"

        def make_cache(self):
            from mlx_lm.models.cache import RotatingKVCache
            return [RotatingKVCache(max_size=8)]

    with pytest.raises(ValueError, match="full-attention"):
        check_supported(Sliding())


def _rows(layer, lengths):
    """Each row's held keys and values ``[H, n, D]``, as read back from the cache."""
    keys, values = layer.keys, layer.values
    return [(keys[b, :, :n], values[b, :, :n]) for b, n in enumerate(lengths)]


def _held_bytes(kv) -> int:
    """The bytes of the slots the pools hold (their arrays may reserve more: ``kv_pool.RESERVE``)."""
    return sum(part.nbytes // part.shape[pool.axis] * pool.slots()
               for layer in kv.layers for pool in (layer.kpool, layer.vpool) for part in pool.parts)


@pytest.mark.parametrize("bits", [8, None])
def test_quantized_rollback_is_exact(tiny, bits):
    """Trimming after an append gives exactly the state of never appending, per row."""
    model = tiny.model
    kv, twin = (batch_kv(len(model.layers), layout="paged", kv_bits=bits) for _ in range(2))
    for cache in (kv, twin):
        cache.extend(prefill_row(model, list(range(5, 40))))
        cache.extend(prefill_row(model, [9, 10, 11]))
    held = kv.lengths()
    model(mx.array([[3, 4, 5, 6], [7, 8, 9, 10]]), cache=kv.layers)  # both rows + 4
    appended = [_rows(layer, kv.lengths()) for layer in kv.layers]
    kv.trim_rows([4, 2])  # row 0 rejects all four, row 1 keeps two
    assert kv.lengths() == [held[0], held[1] + 2]
    assert kv.nbytes == _held_bytes(kv)  # quantized parts' bytes too
    for layer, before, row_kv in zip(kv.layers, twin.layers, appended):
        (k0, v0), (k1, v1) = _rows(layer, kv.lengths())
        assert mx.array_equal(k0, _rows(before, held)[0][0]) and mx.array_equal(v0, _rows(before, held)[0][1])
        assert mx.array_equal(k1, row_kv[1][0][:, :held[1] + 2]) and mx.array_equal(v1, row_kv[1][1][:, :held[1] + 2])
    kv.trim_rows([0, 2])
    a = model(mx.array([[12], [13]]), cache=kv.layers)
    b = model(mx.array([[12], [13]]), cache=twin.layers)
    assert mx.array_equal(a, b)  # the next step sees the same cache bit for bit


def test_paged_allocation_close_to_need(tiny):
    """Mixed lengths: paged blocks stay within 10% of the tokens' bytes once rows leaving free
    more than COMPACT_SLACK of them (fewer: the pools stay as they are, arrivals reuse the free
    blocks, and allocation stays within 2x need); dense pads."""
    from specbatch.kernels.block_table import COMPACT_SLACK

    model = tiny.model
    rng = random.Random(0)
    lengths = [rng.randrange(100, 600) for _ in range(8)]
    for layout, bound in (("paged", 1.10), ("dense", None)):
        kv = batch_kv(len(model.layers), layout=layout)
        for n in lengths:
            kv.extend(prefill_row(model, [rng.randrange(3, 500) for _ in range(n)]))
        for _ in range(3):  # a few verify rounds with per-row rollback
            model(mx.array([[5] * 5] * len(lengths)), cache=kv.layers)
            kv.trim_rows([rng.randrange(0, 5) for _ in lengths])
        if layout == "paged":
            arrays = kv.arrays()
            kv.filter([0, 1, 2, 3, 4, 5, 7])  # one row leaves: too few free blocks to repack
            assert len(kv.table.free) <= COMPACT_SLACK * kv.table.capacity
            assert all(a is b for a, b in zip(arrays, kv.arrays())) and kv.nbytes / kv.used_bytes() <= 2
            kv.filter([0, 4])
        else:
            kv.filter([0, 2, 4, 6])
        assert kv.nbytes == (_held_bytes(kv) if layout == "paged" else sum(a.nbytes for a in kv.arrays()))
        ratio = kv.nbytes / kv.used_bytes()
        if bound:
            assert ratio <= bound, (layout, ratio)
        else:
            assert ratio > 1.2  # the longest row pads every other one


def test_engine_with_8bit_kv_serves_a_speculating_batch(tiny, tiny_draft):
    """kv_bits=8 end to end: a speculating batch (per-row rollback every round) completes
    every request; its batch KV is the 8-bit paged cache."""
    from specbatch import SamplingParams
    from specbatch.runtime.config import EngineConfig

    with new_engine(tiny, tiny_draft, EngineConfig(num_draft_tokens=3, speculative_width_cap=0, kv_bits=8)) as engine:
        handles = [engine.submit(list(range(5, 5 + n)), SamplingParams(max_tokens=12, ignore_eos=True, seed=i))
                   for i, n in enumerate([9, 30, 17, 4])]
        results = [h.result(timeout=120) for h in handles]
        stats = engine.stats()
    assert [len(r.token_ids) for r in results] == [12] * 4
    assert stats["spec_rounds"] > 0 and stats["accepted_tokens"] < stats["drafted_tokens"]  # rows rolled back


@pytest.mark.parametrize("blocked", [False, True])
def test_a_float_pool_stores_heads_alike_with_the_kernels_or_without(blocked):
    """Head-major float pools ``[H, P, D]`` (keys blocked): the kernel's in-place write and the
    scatter it falls back to store a forward's heads at the same slots, bit for bit."""
    from specbatch.kernels import cpu
    from specbatch.kernels.kv_pool import Pool

    x = mx.random.normal((2, 3, 4, 8), key=mx.random.key(1))  # [B, H, N, D]
    slots = mx.array([9, 2, 30, 31, 16, 17, 18, 0], dtype=mx.int32)  # [B * N]
    pools = []
    for off in (False, True):
        pool = Pool(3, 8, mx.float32, None, blocked=blocked)
        pool.grow(32)
        if off:
            with cpu.disabled():
                pool.write_heads(slots, x)
        else:
            pool.write_heads(slots, x)
        pools.append(pool.parts[0])
    assert pools[0].shape[1] >= 32 and pools[0].shape == pools[1].shape
    assert mx.array_equal(pools[0], pools[1]).item()
    assert mx.array_equal(pool.read(slots[None, :4], [4])[0], x[0]).item()  # row 0's tokens, [H, N, D]
    if not blocked:
        assert mx.array_equal(pools[0][:, slots[:4]], x[0]).item()


def test_a_blocked_key_pool_holds_what_a_plain_one_holds():
    """A key pool's 16-slot blocks ([D][16] each) behind the same writes, reads, moves, growth
    and compaction as a plain pool: the same tokens at every slot."""
    from specbatch.kernels.kv_pool import Pool

    plain, blocked = Pool(2, 8, mx.float32, None), Pool(2, 8, mx.float32, None, blocked=True)
    x = mx.random.normal((40, 16), key=mx.random.key(2))  # [n, H * D]
    slots = mx.array(np.random.default_rng(0).permutation(48)[:40], dtype=mx.int32)
    steps = [lambda p: p.grow(48), lambda p: p.write(slots, x),
             lambda p: p.move(mx.array([3, 40, 7]), mx.array([5, 41, 47])), lambda p: p.grow(64),
             lambda p: p.write_heads(mx.array([60, 61], dtype=mx.int32), x[:2].reshape(1, 2, 2, 8).transpose(0, 2, 1, 3)),
             lambda p: p.take(mx.concatenate([mx.arange(48, 64), mx.arange(0, 16)]).astype(mx.int32)),
             lambda p: p.take(mx.concatenate([mx.arange(16, 32), mx.arange(0, 16)]).astype(mx.int32), whole_blocks=True),
             lambda p: p.take(mx.array(np.random.default_rng(1).permutation(32), dtype=mx.int32))]
    for step in steps:
        step(plain)
        step(blocked)
        every = mx.arange(plain.slots(), dtype=mx.int32)[None]
        assert mx.array_equal(plain.read(every, [plain.slots()]), blocked.read(every, [plain.slots()])).item()
        assert mx.array_equal(plain.read(0, [16]), blocked.read(0, [16])).item()
    assert not mx.array_equal(plain.parts[0], blocked.parts[0]).item()  # a layout of its own
    with pytest.raises(ValueError, match="whole blocks"):
        blocked.take(mx.arange(0, 8, dtype=mx.int32))


@pytest.mark.parametrize("lengths", [[40], [40, 7], [33, 48, 1]])
def test_a_blocked_pool_read_block_by_block_is_the_element_gathers_tokens(lengths):
    """Rows over a block table's slots (blocks in any order, short rows padded) read from a
    blocked key pool whole block by whole block: each row's tokens as gathered one by one."""
    from specbatch.kernels.block_table import BlockTable
    from specbatch.kernels.kv_pool import Pool

    pool = Pool(3, 8, mx.float32, None, blocked=True)
    pool.grow(128)
    pool.write(mx.arange(128, dtype=mx.int32), mx.random.normal((128, 24), key=mx.random.key(3)))
    order = np.random.default_rng(len(lengths)).permutation(8).tolist()
    table = BlockTable([[order.pop() for _ in range(-(-n // 16))] for n in lengths])
    index = table.gather(lengths)
    fast, slow = pool.read(index, lengths, whole_blocks=True), pool.read(index, lengths)
    for b, n in enumerate(lengths):
        assert mx.array_equal(fast[b, :, :n], slow[b, :, :n]).item()
    consecutive = mx.arange(32, 72, dtype=mx.int32)[None]  # one row over blocks 2-4: a first slot
    assert mx.array_equal(pool.read(32, [40]), pool.read(consecutive, [40])).item()


@pytest.mark.parametrize("bits, blocked", [(None, True), (None, False), (8, False)])
def test_a_pool_grows_into_its_reserve_and_keeps_its_tokens(bits, blocked):
    """Growth within the reserve keeps the arrays (no copy) and counts only the held slots'
    bytes; growth past it keeps every held token. Without the kernels a pool holds exactly
    what it is asked for."""
    from specbatch.kernels import cpu
    from specbatch.kernels.kv_pool import RESERVE, Pool

    x = mx.random.normal((32, 128), key=mx.random.key(3))  # [n, H * D]
    slots = mx.arange(32, dtype=mx.int32)
    pool = Pool(2, 64, mx.float32, bits, blocked=blocked)
    pool.grow(32)
    pool.write(slots, x)
    before = pool.read(slots[None], [32])
    reserved = [p.shape[pool.axis] for p in pool.parts]
    arrays = list(pool.parts)
    per_slot = sum(p.nbytes for p in pool.parts) // reserved[0]
    assert cpu.status().active is False or reserved == [32 * RESERVE] * len(reserved)
    pool.grow(reserved[0])
    assert all(a is b for a, b in zip(arrays, pool.parts)) and pool.nbytes == per_slot * reserved[0]
    last = slots + reserved[0] - 32  # the reserve's last 32 slots, held now
    pool.write(last, x[::-1])
    pool.grow(reserved[0] + 16)
    assert pool.slots() == reserved[0] + 16 and pool.nbytes == per_slot * pool.slots()
    assert mx.array_equal(pool.read(slots[None], [32]), before).item()
    assert mx.array_equal(pool.read(last[None], [32]), before[:, :, ::-1]).item()
    with cpu.disabled():
        exact = Pool(2, 64, mx.float32, bits, blocked=blocked)
        exact.grow(48)
        assert [p.shape[exact.axis] for p in exact.parts] == [48] * len(exact.parts)


@pytest.mark.parametrize("blocked", [False, True])
def test_a_pool_that_keeps_no_slots_holds_nothing_and_grows_again(blocked):
    """Compaction down to no slots (every kept row empty) leaves an empty pool, which grows
    again as from the start."""
    from specbatch.kernels.kv_pool import Pool

    pool = Pool(2, 64, mx.float32, None, blocked=blocked)
    pool.grow(32)
    pool.write(mx.arange(32, dtype=mx.int32), mx.ones((32, 128)))
    pool.take(mx.zeros((0,), dtype=mx.int32), whole_blocks=True)
    assert pool.slots() == 0 and pool.nbytes == 0
    pool.grow(16)
    pool.write(mx.arange(16, dtype=mx.int32), mx.full((16, 128), 2.0))
    assert pool.read(mx.arange(16, dtype=mx.int32)[None], [16]).min().item() == 2.0
