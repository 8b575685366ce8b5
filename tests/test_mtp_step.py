"""The MTP head's draft step as one op (``fused.mtp_step``): the bits of the separate ops over
every context layout a drafter hands it, the fallback, and clear errors."""

from __future__ import annotations

import mlx.core as mx
import pytest

from specbatch.kernels import cpu
from specbatch.kernels.cpu import fused
from specbatch.kernels.cpu.modules import use_cpu_kernels
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


def chain(head, steps: int, h, emb, positions, keys, values, mask):
    """``steps`` draft steps feeding each output back: every hidden, key and value."""
    out, own_k, own_v = [], [], []
    for j in range(steps):
        h, k, v = head.step(h, emb, positions + j, keys, values, mask, own_k, own_v)
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
            K[..., :T, :], V[..., :T, :], mx.ones((2, T), dtype=mx.bool_))
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
    same_bits(*both(swapped, monkeypatch, 2, h, emb, positions, *broadcast, mask))
    # D strided (a transposed copy read back): the op copies it, the bits stay
    strided = tuple(mx.swapaxes(mx.contiguous(mx.swapaxes(a, 2, 3)), 2, 3) for a in broadcast)
    one, _ = both(swapped, monkeypatch, 2, h, emb, positions, *strided, mask)
    same_bits(one, chain(swapped, 2, h, emb, positions, *broadcast, mask))


def test_falls_back_where_it_does_not_apply(swapped, context, tiny):
    runner, x, K, V = context
    args = (runner.hidden[:, -1], runner.embed(x[:, -1]), mx.array([9, 9]), K[..., :9, :].astype(mx.float16),
            V[..., :9, :].astype(mx.float16), mx.ones((2, 9), dtype=mx.bool_), [], [])
    assert fused.mtp_step(swapped, *args) is None  # a float16 context: the separate ops run
    plain = MTPHead(head_config(tiny.model.args, intermediate_size=64))  # never swapped
    args = (runner.hidden[:, -1], runner.embed(x[:, -1]), mx.array([9, 9]), K[..., :9, :], V[..., :9, :],
            mx.ones((2, 9), dtype=mx.bool_), [], [])
    assert fused.mtp_step(plain, *args) is None
    hidden, k, v = plain.step(*args)
    assert hidden.shape == (2, runner.hidden.shape[-1]) and k.shape == (2, K.shape[1], 1, K.shape[3])


def test_bad_shapes_are_clear_errors(swapped, context):
    runner, x, K, V = context
    wrong_own = [mx.zeros((2, K.shape[1], 2, K.shape[3]))]  # two positions where one belongs
    args = (runner.hidden[:, -1], runner.embed(x[:, -1]), mx.array([9, 9]), K[..., :9, :], V[..., :9, :],
            mx.ones((1, 9), dtype=mx.bool_), wrong_own, wrong_own)
    with pytest.raises(ValueError, match="own keys and values"):
        fused.mtp_step(swapped, *args)
    with pytest.raises(ValueError, match="ctx_mask"):
        fused.mtp_step(swapped, *args[:5], mx.ones((1, 8), dtype=mx.bool_), [], [])
