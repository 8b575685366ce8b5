"""Half-stored weights (kernels.cpu.half): float16 storage of float16-exact matrices gives the
float32 matrices' bits everywhere: the small-M kernel, the fused ops, prefill, and whole streams."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specbatch.kernels import cpu
from specbatch.kernels.cpu import half, wide
from specbatch.kernels.cpu.modules import FastEmbedding, FastLinear

from helpers import assert_passes_on_avx2, run_plain, run_scalar

needs_half = pytest.mark.skipif(not cpu.status().active or not half.supported(cpu.extension()),
                                reason="CPU kernels inactive or no F16C")


def _half_values(shape, key) -> mx.array:
    """float16 weights that include zeros of both signs, subnormals and the largest values."""
    w = mx.random.normal(shape, key=key).astype(mx.float16)
    flat = np.array(w).reshape(-1)
    specials = np.array([0.0, -0.0, 6.0e-8, -6.0e-8, 3.0e-5, 65504.0, -65504.0, 1.0e-3], dtype=np.float16)
    flat[: min(flat.size, specials.size)] = specials[: flat.size]
    return mx.array(flat.reshape(shape))


@needs_half
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 70), k=st.integers(1, 300), n=st.integers(1, 200), seed=st.integers(0, 2**16))
def test_half_weights_give_the_float32_weights_bits(rows, k, n, seed):  # every tile, tail and the blocked path
    w = _half_values((n, k), mx.random.key(seed))
    x = mx.random.normal((rows, k), key=mx.random.key(seed + 1))
    ext = cpu.extension()
    assert mx.array_equal(ext.small_linear(x, w), ext.small_linear(x, w.astype(mx.float32)), equal_nan=True).item()


@needs_half
def test_the_fused_ops_take_half_weights_with_the_same_bits():
    ext = cpu.extension()
    keys = mx.random.split(mx.random.key(3), 6)
    x, r = mx.random.normal((2, 3, 64), key=keys[0]), mx.random.normal((2, 3, 64), key=keys[1])
    wg, wu = _half_values((96, 64), keys[2]), _half_values((96, 64), keys[3])
    wd = _half_values((64, 96), keys[4])
    norm = mx.random.normal((64,), key=keys[5])
    wide_ = [w.astype(mx.float32) for w in (wg, wu, wd)]
    assert mx.array_equal(ext.mlp_block(x, r, norm, 1e-5, wg, wu, wd), ext.mlp_block(x, r, norm, 1e-5, *wide_)).item()
    for a, b in zip(ext.gate_up(x, wg, wu), ext.gate_up(x, *wide_[:2])):
        assert mx.array_equal(a, b).item()
    wq, wk, wv = _half_values((64, 64), keys[0]), _half_values((32, 64), keys[1]), _half_values((32, 64), keys[2])
    inv = mx.exp(-mx.arange(8, dtype=mx.float32))
    pos = mx.array([5], dtype=mx.int32)
    ours = ext.qkv_rope(x, wq, wk, wv, [], pos, inv, 4, 2, 16, False, 1.0)
    ref = ext.qkv_rope(x, *(w.astype(mx.float32) for w in (wq, wk, wv)), [], pos, inv, 4, 2, 16, False, 1.0)
    for a, b in zip(ours, ref):
        assert mx.array_equal(a, b).item()


def test_only_exact_matrices_are_stored_half(monkeypatch):
    exact = mx.random.normal((8, 4)).astype(mx.float16).astype(mx.float32)
    assert half.exact_half(exact).dtype == mx.float16
    assert half.exact_half(exact + 1e-6) is None  # a float32 value float16 cannot hold
    assert half.exact_half(exact.astype(mx.bfloat16)) is None  # not float32: left alone
    modules = [FastLinear(exact, None), FastLinear(exact + 1e-6, None), FastEmbedding(exact)]
    ext = cpu.extension()
    changed = half.store_half(ext, modules)
    if not half.supported(ext):
        assert changed == 0
        return
    assert changed == 2 and [m.weight.dtype for m in modules] == [mx.float16, mx.float32, mx.float16]
    x = mx.random.normal((3, 4))
    assert mx.array_equal(modules[0](x), cpu.linear(x, exact)).item()
    assert modules[2](mx.array([1, 7])).dtype == mx.float32  # an embedding's rows widen as looked up
    assert mx.array_equal(modules[2](mx.array([1, 7])), exact[mx.array([1, 7])]).item()
    monkeypatch.setenv(half.ENV, "0")
    kept = FastLinear(exact, None)
    assert half.store_half(ext, [kept]) == 0 and kept.weight.dtype == mx.float32


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The same half-exact tiny model loaded twice: float32-stored and half-stored."""
    import os

    from specbatch.kernels.models import load
    from specbatch.testing.tiny import build_tiny_model
    folder = build_tiny_model(tmp_path_factory.mktemp("half") / "llama", "llama", seed=4, half_values=True)
    before = os.environ.get(half.ENV)
    os.environ[half.ENV] = "0"
    full = load(folder)
    os.environ.pop(half.ENV)
    stored = load(folder)
    if before is not None:
        os.environ[half.ENV] = before
    return full, stored


@needs_half
def test_a_half_stored_model_gives_the_float32_models_logits(pair):
    full, stored = pair
    dtypes = {m.weight.dtype for _, m in stored.model.named_modules() if isinstance(m, (FastLinear, FastEmbedding))}
    assert dtypes == {mx.float16}
    assert all(m.weight.dtype == mx.float32 for _, m in full.model.named_modules() if isinstance(m, FastLinear))
    for rows, positions in ((1, 1), (1, 3), (4, 1), (2, 20), (1, 45)):  # decode, verify, batch, prefill
        tokens = mx.random.randint(0, 200, (rows, positions))
        assert mx.array_equal(full.model(tokens), stored.model(tokens)).item(), (rows, positions)


@needs_half
@pytest.mark.parametrize("on_kernel", ["0", "1"])
def test_a_wide_prefill_on_either_path_has_the_same_bits(pair, monkeypatch, on_kernel):
    monkeypatch.setenv("SPECBATCH_PREFILL_KERNEL", on_kernel)
    wide.prefill_on_kernel.cache_clear()
    full, stored = pair
    tokens = mx.random.randint(0, 200, (1, cpu.MAX_ROWS + 40))
    assert mx.array_equal(full.model(tokens), stored.model(tokens)).item()
    wide.prefill_on_kernel.cache_clear()


@needs_half
@pytest.mark.parametrize("params", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 11}])
def test_streams_are_the_float32_models_streams(pair, tiny_draft, params):
    full, stored = pair
    prompt = "a half-stored target decodes"
    assert run_plain(stored, prompt, max_tokens=24, **params) == run_plain(full, prompt, max_tokens=24, **params)
    ours, _ = run_scalar(stored, tiny_draft, prompt, k=3, max_tokens=24, **params)
    theirs, _ = run_scalar(full, tiny_draft, prompt, k=3, max_tokens=24, **params)
    assert ours == theirs


@needs_half
def test_the_avx2_path_passes_the_same_checks():
    assert_passes_on_avx2(__file__)
