"""The MTP head's draft step as one op (``fused.mtp_step``): the bits of the separate ops over
every context layout a drafter hands it, the fallback, and clear errors."""

from __future__ import annotations

import attrs
import mlx.core as mx
import pytest

from specbatch.kernels import cpu
from specbatch.kernels.cpu import fused
from specbatch.kernels.cpu.modules import use_cpu_kernels
from specbatch.kernels.drafters.head_context import HeadContext, context_of
from specbatch.kernels.drafters.mtp import MTPHead, head_config
from specbatch.kernels.runner import ModelRunner

pytestmark = pytest.mark.skipif(not cpu.status().active, reason="CPU kernels inactive")


@pytest.fixture(scope="module")
def swapped(tiny):
    mx.random.seed(7)
    head = MTPHead(head_config(tiny.model.args, intermediate_size=64))
    assert use_cpu_kernels(head) > 0
    mx.eval(head.parameters())
    return head


@pytest.fixture(scope="module")
def context(tiny):
    """Two rows' hidden states and the target's last-layer KV after 9 tokens."""
    runner = ModelRunner(tiny.model)
    cache = tiny.model.make_cache()
    x = mx.array([[5, 9, 33, 7, 120, 44, 3, 81, 17], [8, 2, 61, 19, 4, 90, 13, 6, 50]])
    runner.forward(x, cache)
    return runner, x, cache[-1].keys, cache[-1].values


def dense(keys, values, mask) -> HeadContext:
    return HeadContext(keys, values, mask, [keys.shape[2]] * mask.shape[0])


def chain(head, steps: int, h, emb, positions, ctx: HeadContext):
    """``steps`` draft steps feeding each output back: every hidden, key and value."""
    out, own_k, own_v = [], [], []
    for j in range(steps):
        h, k, v = head.step(h, emb, positions + j, ctx, own_k, own_v)
        own_k.append(k)
        own_v.append(v)
        out += [h, k, v]
    mx.eval(out)
    return out


def both(head, monkeypatch, *args):
    """The chain as one op a step, then with the one-op path off (the two fused ops)."""
    calls = []
    real = fused.mtp_step
    monkeypatch.setattr(fused, "mtp_step", lambda *a: calls.append(1) or real(*a))
    one = chain(head, *args)
    assert calls, "the one-op step applied"
    monkeypatch.setattr(fused, "mtp_step", lambda *a: None)
    return one, chain(head, *args)


def same_bits(one, other):
    assert len(one) == len(other)
    for a, b in zip(one, other):
        assert a.shape == b.shape and mx.array_equal(a, b).item()


@pytest.mark.parametrize("steps", [1, 3])
def test_one_op_step_has_the_separate_ops_bits(swapped, context, monkeypatch, steps):
    runner, x, K, V = context
    T = 9
    args = (steps, runner.hidden[:, -1], runner.embed(x[:, -1]), mx.array([T, T], dtype=mx.int32),
            dense(K[..., :T, :], V[..., :T, :], mx.ones((2, T), dtype=mx.bool_)))
    same_bits(*both(swapped, monkeypatch, *args))


def test_masked_broadcast_and_strided_contexts(swapped, context, monkeypatch):
    runner, x, K, V = context
    T = 9
    row = (K[:1, :, :T, :], V[:1, :, :T, :])  # one row's context for three draft rows (a tree's frontier)
    mask = mx.array([[True] * T, [False] * 3 + [True] * (T - 3), [True] * (T - 1) + [False]])
    h = mx.random.normal((3, runner.hidden.shape[-1]))
    emb = runner.embed(mx.array([4, 77, 19]))
    positions = mx.array([T, T - 2, T], dtype=mx.int32)
    broadcast = tuple(mx.broadcast_to(a, (3, *a.shape[1:])) for a in row)
    same_bits(*both(swapped, monkeypatch, 2, h, emb, positions, dense(*broadcast, mask)))
    # D strided (a transposed copy read back): the op copies it, the bits stay
    strided = tuple(mx.swapaxes(mx.contiguous(mx.swapaxes(a, 2, 3)), 2, 3) for a in broadcast)
    one, _ = both(swapped, monkeypatch, 2, h, emb, positions, dense(*strided, mask))
    same_bits(one, chain(swapped, 2, h, emb, positions, dense(*broadcast, mask)))


def test_falls_back_where_it_does_not_apply(swapped, context, tiny):
    runner, x, K, V = context
    args = (runner.hidden[:, -1], runner.embed(x[:, -1]), mx.array([9, 9]),
            dense(K[..., :9, :].astype(mx.float16), V[..., :9, :].astype(mx.float16), mx.ones((2, 9), dtype=mx.bool_)),
            [], [])
    assert fused.mtp_step(swapped, *args) is None  # a float16 context: the separate ops run
    plain = MTPHead(head_config(tiny.model.args, intermediate_size=64))  # never swapped
    args = (runner.hidden[:, -1], runner.embed(x[:, -1]), mx.array([9, 9]),
            dense(K[..., :9, :], V[..., :9, :], mx.ones((2, 9), dtype=mx.bool_)), [], [])
    assert fused.mtp_step(plain, *args) is None
    hidden, k, v = plain.step(*args)
    assert hidden.shape == (2, runner.hidden.shape[-1]) and k.shape == (2, K.shape[1], 1, K.shape[3])


def test_bad_shapes_are_clear_errors(swapped, context):
    runner, x, K, V = context
    wrong_own = [mx.zeros((2, K.shape[1], 2, K.shape[3]))]  # two positions where one belongs
    args = (runner.hidden[:, -1], runner.embed(x[:, -1]), mx.array([9, 9]),
            dense(K[..., :9, :], V[..., :9, :], mx.ones((1, 9), dtype=mx.bool_)), wrong_own, wrong_own)
    with pytest.raises(ValueError, match="own keys and values"):
        fused.mtp_step(swapped, *args)
    with pytest.raises(ValueError, match="ctx_mask"):
        fused.mtp_step(swapped, *args[:3], dense(K[..., :9, :], V[..., :9, :], mx.ones((3, 9), dtype=mx.bool_)), [], [])


def paged_layer(K, V, lengths):
    """A paged layer holding rows of K, V's tokens ``[B, Hkv, T, D]`` (row b keeps its first
    lengths[b]), appended in pieces so the rows' blocks interleave in the pools."""
    from specbatch.kernels.paged_kv import PagedKV
    cache = PagedKV.empty(1, K.shape[0])
    layer = cache.layers[0]
    for a, b in ((0, 5), (5, 21), (21, K.shape[2])):
        layer.append(K[..., a:b, :], V[..., a:b, :])
    cache.trim_rows([K.shape[2] - n for n in lengths])
    return layer


@pytest.fixture(scope="module")
def long_context(tiny):
    runner = ModelRunner(tiny.model)
    cache = tiny.model.make_cache()
    x = mx.random.randint(0, 100, (2, 40), key=mx.random.key(3))
    runner.forward(x, cache)
    return runner, cache[-1].keys[..., :40, :], cache[-1].values[..., :40, :]


@pytest.mark.parametrize("lengths", [[40, 40], [37, 18], [16, 33]])
def test_a_paged_context_is_read_through_its_slots_with_the_gathered_contexts_bits(swapped, long_context,
                                                                                monkeypatch, lengths):
    runner, K, V = long_context
    ctx = context_of(paged_layer(K, V, lengths))
    assert ctx.slots is not None and ctx.keys.ndim == 3  # the pools themselves
    h = mx.random.normal((2, runner.hidden.shape[-1]), key=mx.random.key(1))
    emb = runner.embed(mx.array([4, 77]))
    positions = mx.array(lengths, dtype=mx.int32)
    one, separate = both(swapped, monkeypatch, 3, h, emb, positions, ctx)  # the separate ops read it gathered
    same_bits(one, separate)
    gathered = dense(*ctx.dense(2))  # and the one op over that gathered copy
    monkeypatch.undo()
    same_bits(one, chain(swapped, 3, h, emb, positions, gathered))


def test_a_paged_frontier_reads_one_rows_slots_for_all(swapped, long_context, monkeypatch):
    runner, K, V = long_context
    ctx = context_of(paged_layer(K[:1], V[:1], [29]))
    frontier = ctx.select(mx.array([0, 0, 0]))  # a tree's three frontier nodes of batch row 0
    assert frontier.slots.shape == (1, 29)
    h = mx.random.normal((3, runner.hidden.shape[-1]), key=mx.random.key(2))
    emb = runner.embed(mx.array([4, 77, 19]))
    positions = mx.array([29, 29, 29], dtype=mx.int32)
    same_bits(*both(swapped, monkeypatch, 2, h, emb, positions, frontier))


def test_a_slot_outside_the_pools_gives_nan_never_a_stray_read(swapped, long_context):
    runner, K, V = long_context
    ctx = context_of(paged_layer(K, V, [40, 40]))
    bad = attrs.evolve(ctx, slots=ctx.slots + 10_000)
    h, k, v = fused.mtp_step(swapped, runner.hidden[:, -1], runner.embed(mx.array([4, 77])),
                             mx.array([40, 40]), bad, [], [])
    assert mx.isnan(h).all().item()
    with pytest.raises(ValueError, match="ctx_slots"):
        fused.mtp_step(swapped, runner.hidden[:, -1], runner.embed(mx.array([4, 77])), mx.array([40, 40]),
                       attrs.evolve(ctx, slots=ctx.slots[:, :-1]), [], [])
