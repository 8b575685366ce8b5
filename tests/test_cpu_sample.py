"""The CPU kernels' fused sampler (``cpu.sample_tokens``) against MLX's ops over the same noise."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specbatch.kernels import cpu

needs_kernels = pytest.mark.skipif(not cpu.status().active, reason=f"CPU kernels inactive: {cpu.status().why}")


def _mlx_tokens(logits, temps, seeds, positions) -> mx.array:
    """The sampler's steps as MLX ops: scores = logits / max(T, 1e-6) + noise where T > 0."""
    temp = temps[:, None, None]
    noise = cpu.gumbel(seeds, positions, logits.shape[-1])
    scores = mx.where(temp > 0, logits / mx.maximum(temp, 1e-6) + noise, logits)
    return mx.argmax(scores, axis=-1).astype(mx.int32)


@needs_kernels
@settings(max_examples=80, deadline=None)
@given(b=st.integers(1, 4), n=st.integers(1, 5), seed=st.integers(0, 2**16),
       vocab=st.integers(1, 300) | st.sampled_from([8192, 8193, 20_000]),  # one span, two, three
       kind=st.sampled_from(["normal", "ties", "special"]),
       temps=st.lists(st.sampled_from([0.0, 1e-9, 0.3, 0.7, 1.0, 2.5]), min_size=4, max_size=4))
def test_tokens_are_mlx_ops_bit_for_bit(b, n, vocab, seed, kind, temps):
    rng = np.random.default_rng(seed)
    if kind == "ties":  # few distinct values: the first of the tied maxima must win
        host = rng.integers(-2, 3, size=(b, n, vocab)).astype(np.float32)
    else:
        host = (rng.standard_normal((b, n, vocab)) * 4).astype(np.float32)
    if kind == "special":  # -inf (filtered out) and NaN (a broken row): MLX's argmax takes the first NaN
        host[rng.random(host.shape) < 0.3] = -np.inf
        host[rng.random(host.shape) < 0.02] = np.nan
    logits = mx.array(host)
    t = mx.array(temps[:b], dtype=mx.float32)
    seeds = mx.array(rng.integers(0, 2**32, size=b), dtype=mx.uint32)
    positions = mx.array(rng.integers(0, 2**31 - 1, size=(b, n)), dtype=mx.int32)
    ours = cpu.sample_tokens(logits, t, seeds, positions)
    assert ours.dtype == mx.int32 and ours.shape == (b, n)
    assert np.array_equal(np.array(ours), np.array(_mlx_tokens(logits, t, seeds, positions)))


@needs_kernels
def test_a_row_is_the_same_alone_or_in_a_batch_and_strided():
    logits = mx.random.normal((3, 4, 49_152), key=mx.random.key(3)) * 3  # the embedded target's vocabulary
    temps = mx.array([0.7, 0.0, 1.0], dtype=mx.float32)
    seeds = mx.array([5, 6, 7], dtype=mx.uint32)
    positions = mx.array([[10, 11, 12, 13], [0, 1, 2, 3], [99, 100, 101, 102]], dtype=mx.int32)
    together = cpu.sample_tokens(logits, temps, seeds, positions)
    alone = cpu.sample_tokens(logits[2:, 1:3], temps[2:], seeds[2:], positions[2:, 1:3])  # a strided view
    assert np.array_equal(np.array(alone)[0], np.array(together)[2, 1:3])
    assert np.array_equal(np.array(together), np.array(_mlx_tokens(logits, temps, seeds, positions)))
    assert np.array_equal(np.array(together)[1], np.array(mx.argmax(logits[1], axis=-1)))  # T = 0: greedy


@needs_kernels
def test_bad_inputs_raise_and_the_fallback_is_none():
    ext = cpu.extension()
    logits, t = mx.zeros((2, 3, 8)), mx.ones((2,))
    seeds, positions = mx.zeros((2,), dtype=mx.uint32), mx.zeros((2, 3), dtype=mx.int32)
    for bad in [(logits.astype(mx.float16), t, seeds, positions), (logits, t[:1], seeds, positions),
                (logits, t, seeds.astype(mx.int32), positions), (logits, t, seeds, positions[:, :2]),
                (logits[0], t, seeds, positions)]:
        with pytest.raises(ValueError):
            ext.sample_tokens(*bad)
    with cpu.disabled():
        assert cpu.sample_tokens(logits, t, seeds, positions) is None
    assert cpu.sample_tokens(logits.astype(mx.float16), t, seeds, positions) is None
