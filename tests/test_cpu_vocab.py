"""The CPU kernels' spread of a reduced vocabulary's logits (``cpu.vocab.spread``) against MLX's scatter."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specbatch.kernels import cpu
from specbatch.kernels.cpu.vocab import spread

needs_kernels = pytest.mark.skipif(not cpu.status().active, reason=f"CPU kernels inactive: {cpu.status().why}")


def _scattered(values: mx.array, ids: mx.array, vocab: int) -> mx.array:
    with cpu.disabled():  # the wrapper's fallback: MLX's scatter
        out = spread(values, ids, vocab)
        mx.eval(out)
    return out


@needs_kernels
@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 4), vocab=st.integers(1, 400) | st.sampled_from([49_152]), share=st.floats(0.0, 1.0),
       seed=st.integers(0, 2**16), special=st.booleans())
def test_spread_is_mlxs_scatter_bit_for_bit(b, vocab, share, seed, special):
    rng = np.random.default_rng(seed)
    n = max(1, int(share * vocab))
    ids = mx.array(rng.permutation(vocab)[:n].astype(np.int32))  # distinct, in no order
    host = (rng.standard_normal((b, n)) * 4).astype(np.float32)
    if special:  # the kept logits may hold -inf and NaN of their own
        host[rng.random(host.shape) < 0.2] = -np.inf
        host[rng.random(host.shape) < 0.05] = np.nan
    values = mx.array(host)
    got = cpu.extension().spread(values, ids, vocab)
    want = _scattered(values, ids, vocab)
    assert got.shape == (b, vocab) and got.dtype == mx.float32
    assert np.array_equal(np.array(got), np.array(want), equal_nan=True)


@needs_kernels
def test_the_rest_of_the_vocabulary_is_minus_infinity():
    out = np.array(spread(mx.array([[1.5, -2.0]]), mx.array([7, 2], dtype=mx.int32), 10))
    assert out[0, 7] == 1.5 and out[0, 2] == -2.0
    assert np.all(np.delete(out[0], [2, 7]) == -np.inf)


@needs_kernels
@pytest.mark.parametrize("bad", [-1, 10, 2**31 - 1])
def test_an_id_outside_the_vocabulary_gives_nan_never_a_stray_write(bad):
    out = np.array(cpu.extension().spread(mx.ones((2, 3)), mx.array([0, bad, 4], dtype=mx.int32), 10))
    assert np.isnan(out).all()


@needs_kernels
@pytest.mark.parametrize("values, ids, vocab", [
    (mx.ones((2, 3), dtype=mx.float16), mx.array([0, 1, 2], dtype=mx.int32), 10),  # not float32
    (mx.ones((3,)), mx.array([0, 1, 2], dtype=mx.int32), 10),  # not [B, n]
    (mx.ones((2, 3)), mx.array([0, 1], dtype=mx.int32), 10),  # an id short
    (mx.ones((2, 3)), mx.array([0, 1, 2], dtype=mx.int64), 10),  # not int32
    (mx.ones((2, 3)), mx.array([0, 1, 2], dtype=mx.int32), 0),  # no vocabulary
])
def test_bad_inputs_are_refused_with_a_clear_error(values, ids, vocab):
    with pytest.raises(ValueError, match="spread"):
        cpu.extension().spread(values, ids, vocab)


def test_off_the_kernels_the_fallback_gives_the_same_values():
    values, ids = mx.array([[0.25, 3.0, -1.0]]), mx.array([5, 0, 3], dtype=mx.int32)
    out = np.array(_scattered(values, ids, 6))
    assert np.array_equal(out, np.array([[3.0, -np.inf, -np.inf, -1.0, -np.inf, 0.25]]))
