"""The CPU kernels' RMSNorm (with the residual add before it) and RoPE against MLX's own ops, and the layers swapped for them."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specbatch.kernels import cpu
from specbatch.kernels.cpu.modules import use_cpu_kernels

needs_kernels = pytest.mark.skipif(not cpu.status().active, reason=f"CPU kernels inactive: {cpu.status().why}")


def _near(ours: mx.array, theirs: mx.array, tol: float = 1e-5) -> None:
    a, b = np.array(ours), np.array(theirs)
    assert a.shape == b.shape
    err = np.abs(a - b).max(initial=0.0)
    assert err <= tol * max(1.0, np.abs(b).max(initial=0.0)), err


@needs_kernels
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 300), d=st.integers(1, 700), eps=st.sampled_from([1e-5, 1e-6]),
       seed=st.integers(0, 2**16))
def test_rms_norm_matches_mlx(rows, d, eps, seed):
    x = mx.random.normal((rows, d), key=mx.random.key(seed)) * 3
    w = mx.random.normal((d,), key=mx.random.key(seed + 1))
    _near(cpu.rms_norm(x, w, eps), mx.fast.rms_norm(x, w, eps))


@needs_kernels
def test_rms_norm_rows_are_independent_strided_and_differentiable():
    x = mx.random.normal((3, 5, 64))  # [batch, positions, D]
    w = mx.random.normal((64,))
    together = cpu.rms_norm(x, w, 1e-5)
    assert mx.array_equal(cpu.rms_norm(x[1:2, 3:4], w, 1e-5)[0, 0], together[1, 3]).item()
    xt = mx.random.normal((64, 7)).T  # a transposed view
    _near(cpu.rms_norm(xt, w, 1e-5), mx.fast.rms_norm(xt, w, 1e-5))
    ours = mx.grad(lambda x, w: (cpu.rms_norm(x, w, 1e-5) ** 3).sum(), argnums=(0, 1))(x, w)
    theirs = mx.grad(lambda x, w: (mx.fast.rms_norm(x, w, 1e-5) ** 3).sum(), argnums=(0, 1))(x, w)
    for a, b in zip(ours, theirs):
        _near(a, b, 1e-4)


@needs_kernels
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), d=st.integers(1, 600), seed=st.integers(0, 2**16))
def test_add_rms_norm_is_the_add_then_the_norm_bit_for_bit(rows, d, seed):
    x = mx.random.normal((rows, d), key=mx.random.key(seed))
    r = mx.random.normal((rows, d), key=mx.random.key(seed + 1))
    w = mx.random.normal((d,), key=mx.random.key(seed + 2))
    h, normed = cpu.add_rms_norm(x, r, w, 1e-5)
    assert mx.array_equal(h, x + r).item()
    assert mx.array_equal(normed, cpu.rms_norm(x + r, w, 1e-5)).item()


@needs_kernels
def test_add_rms_norm_is_differentiable_and_declines_what_it_does_not_take():
    x, r = mx.random.normal((3, 64)), mx.random.normal((3, 64))
    w = mx.random.normal((64,))

    def loss(f):
        def of(x, r, w):
            h, n = f(x, r, w)
            return (h * n).sum() + (n ** 3).sum()
        return of
    ours = mx.grad(loss(lambda x, r, w: cpu.add_rms_norm(x, r, w, 1e-5)), argnums=(0, 1, 2))(x, r, w)
    theirs = mx.grad(loss(lambda x, r, w: (x + r, mx.fast.rms_norm(x + r, w, 1e-5))), argnums=(0, 1, 2))(x, r, w)
    for a, b in zip(ours, theirs):
        _near(a, b, 1e-4)
    assert cpu.add_rms_norm(x, r[:2], w, 1e-5) is None  # shapes differ: the caller adds itself
    assert cpu.add_rms_norm(x.astype(mx.float16), r, w, 1e-5) is None


@needs_kernels
@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 70), min_size=1, max_size=3), spread=st.sampled_from([1.0, 10.0, 60.0]),
       seed=st.integers(0, 2**16))
def test_swiglu_matches_mlx(shape, spread, seed):
    from mlx_lm.models.activations import swiglu
    gate = mx.random.normal(shape, key=mx.random.key(seed)) * spread
    up = mx.random.normal(shape, key=mx.random.key(seed + 1))
    _near(cpu.swiglu(gate, up), swiglu(gate, up), 1e-6)


@needs_kernels
def test_swiglu_elements_are_independent_strided_wide_and_differentiable():
    from mlx_lm.models.activations import swiglu
    gate, up = mx.random.normal((3, 300, 97)) * 5, mx.random.normal((3, 300, 97))  # wide: the pool splits it
    together = cpu.swiglu(gate, up)
    assert mx.array_equal(cpu.swiglu(gate[2, 7:8, 5:6], up[2, 7:8, 5:6])[0, 0], together[2, 7, 5]).item()
    _near(together, swiglu(gate, up), 1e-6)
    gt, ut = mx.random.normal((40, 9)).T, mx.random.normal((40, 9)).T  # transposed views
    _near(cpu.swiglu(gt, ut), swiglu(gt, ut), 1e-6)
    ours = mx.grad(lambda g, u: (cpu.swiglu(g, u) ** 2).sum(), argnums=(0, 1))(gate, up)
    theirs = mx.grad(lambda g, u: (swiglu(g, u) ** 2).sum(), argnums=(0, 1))(gate, up)
    for a, b in zip(ours, theirs):
        _near(a, b, 1e-5)
    with cpu.disabled():  # MLX's own op where the kernels are off
        assert mx.array_equal(cpu.swiglu(gate, up), swiglu(gate, up)).item()
    with pytest.raises(ValueError, match="one shape"):
        cpu.extension().swiglu(gate, up[:, :2])


@needs_kernels
def test_gumbel_kernel_is_its_mlx_fallback_and_shape_free():
    seeds = mx.array([0, 1, 2**32 - 1], dtype=mx.uint32)
    positions = mx.array([[0, 5, 9], [2**31 - 1, 3, 3], [7, 8, 1000]], dtype=mx.int32)
    ours = cpu.gumbel(seeds, positions, 1037)  # odd vocabulary: a masked tail
    with cpu.disabled():
        theirs = cpu.gumbel(seeds, positions, 1037)
    _near(ours, theirs, 1e-6)  # the same hash; the two logs agree to their last bits
    assert mx.array_equal(ours[1, 1], ours[1, 2]).item()  # (seed, position) alike: the same noise
    alone = cpu.gumbel(seeds[2:], positions[2:, 1:2], 1037)  # another call shape, the same elements
    assert mx.array_equal(alone[0, 0], ours[2, 1]).item()
    assert mx.array_equal(cpu.gumbel(seeds[:1], positions[:1, :1], 5)[0, 0], ours[0, 0, :5]).item()
    ext = cpu.extension()
    for bad in [(seeds.astype(mx.int32), positions, 5), (seeds, positions[:2], 5), (seeds, positions, 0)]:
        with pytest.raises(ValueError):
            ext.gumbel(*bad)


def _inv_freq(dims: int, base: float) -> mx.array:
    half = dims // 2
    return mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * float(np.float32(np.log(np.float32(base))) / half))


@needs_kernels
@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 4), length=st.integers(1, 40), d=st.sampled_from([8, 32, 64, 80]),
       partial=st.booleans(), traditional=st.booleans(), base=st.sampled_from([10000.0, 100000.0]),
       scale=st.sampled_from([1.0, 0.25]), per_row=st.booleans(), seed=st.integers(0, 2**16))
def test_rope_matches_mlx_on_a_strided_input(b, h, length, d, partial, traditional, base, scale, per_row, seed):
    dims = d // 2 if partial else d
    x = mx.random.normal((b, length, h, d), key=mx.random.key(seed)).transpose(0, 2, 1, 3)  # as attention makes it
    rng = np.random.default_rng(seed)
    offset = mx.array(rng.integers(-8, 3000, size=b), dtype=mx.int32) if per_row else int(rng.integers(0, 3000))
    theirs = mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)
    ours = cpu.rope(x, cpu.rope_positions(offset), _inv_freq(dims, base), dims, traditional, scale)
    _near(ours, theirs)


@needs_kernels
def test_rope_at_explicit_positions_and_its_gradient():
    x = mx.random.normal((2, 3, 5, 16))  # [B, H, L, D]
    positions = mx.array([[7, 9, 8, 8, 10], [0, 1, 1, 2, 2]], dtype=mx.int32)  # tree nodes' depths
    inv = _inv_freq(16, 10000.0)
    ours = cpu.rope(x, positions, inv, 16, False, 1.0)
    flat = x.transpose(0, 2, 1, 3).reshape(10, 3, 1, 16)  # each token alone at its own offset
    theirs = mx.fast.rope(flat, 16, traditional=False, base=10000.0, scale=1.0, offset=positions.reshape(-1))
    _near(ours, theirs.reshape(2, 5, 3, 16).transpose(0, 2, 1, 3))
    off = mx.array([4], dtype=mx.int32)
    g_ours = mx.grad(lambda x: (cpu.rope(x, off, inv, 16, True, 1.0) * x[..., ::-1]).sum())(x)
    g_theirs = mx.grad(lambda x: (mx.fast.rope(x, 16, traditional=True, base=10000.0, scale=1.0, offset=4)
                                  * x[..., ::-1]).sum())(x)
    _near(g_ours, g_theirs, 1e-4)


@needs_kernels
def test_rope_rejects_bad_positions():
    x = mx.random.normal((2, 1, 3, 8))
    with pytest.raises(ValueError, match="positions"):
        cpu.rope(x, mx.array([1, 2, 3], dtype=mx.int32), _inv_freq(8, 10000.0), 8, False, 1.0)
    with pytest.raises(ValueError, match="dims"):
        cpu.rope(x, mx.array([1], dtype=mx.int32), _inv_freq(6, 10000.0), 7, False, 1.0)


@needs_kernels
def test_swapped_norms_and_ropes_give_mlx_outputs_and_keep_parameters():
    holder = nn.Module()
    holder.norm, holder.rope = nn.RMSNorm(16), nn.RoPE(8, base=500000.0, scale=0.5)
    holder.trad = nn.RoPE(16, traditional=True)
    x = mx.random.normal((2, 3, 4, 16))
    offsets = mx.array([5, -2], dtype=mx.int32)
    before = holder.norm(x), holder.rope(x, offset=3), holder.trad(x, offset=offsets)
    keys = set(dict(holder.parameters()).keys()), len(holder.parameters()["norm"])
    assert use_cpu_kernels(holder) == 3
    assert isinstance(holder.norm, nn.RMSNorm) and type(holder.norm) is not nn.RMSNorm
    assert (set(dict(holder.parameters()).keys()), len(holder.parameters()["norm"])) == keys
    for a, b in zip(before, (holder.norm(x), holder.rope(x, offset=3), holder.trad(x, offset=offsets))):
        _near(b, a)
    with cpu.disabled():  # MLX's own ops again, bit for bit
        assert mx.array_equal(holder.rope(x, offset=3), before[1]).item()


def test_a_model_swapped_on_one_thread_runs_first_on_another(model_dir):
    # the engine loads on the caller's thread and decodes on its own: nothing the swap
    # made may be a lazy array of the loading thread's stream
    import threading

    from specbatch.kernels.models import load
    model = load(model_dir["llama"]).model
    errors = []

    def decode():
        try:
            mx.eval(model(mx.array([[1, 2, 3]], dtype=mx.int32)))
        except Exception as exc:  # noqa: BLE001 - the test reports whatever it was
            errors.append(exc)
    worker = threading.Thread(target=decode)
    worker.start()
    worker.join()
    assert errors == []
