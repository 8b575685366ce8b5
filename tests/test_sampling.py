"""SamplingParams validation and the position-keyed sampler."""

from __future__ import annotations

import mlx.core as mx
import pytest

from specbatch.kernels.sampling import RowSampling, positions_from, sample
from specbatch.runtime.params import SamplingParams


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=1.5), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(seed=1.5), "seed"),
    (dict(seed="7"), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_bad_params_fail_at_construction(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SamplingParams(**kwargs)


def test_unseeded_requests_get_a_recorded_seed():
    p = SamplingParams().with_seed()
    assert isinstance(p.seed, int)
    assert SamplingParams(seed=5).with_seed().seed == 5


def test_token_is_a_pure_function_of_logits_seed_and_position():
    logits = mx.random.normal((1, 4, 64), key=mx.random.key(0))
    rows = RowSampling.of([SamplingParams(temperature=0.8, seed=11)])
    whole = sample(logits, rows, positions_from([10], 4))
    # the same positions sampled one at a time, in another batch shape, agree
    parts = [sample(logits[:, i:i + 1], rows, positions_from([10 + i], 1)).item() for i in range(4)]
    assert whole[0].tolist() == parts
    batch = RowSampling.of([SamplingParams(seed=3), SamplingParams(temperature=0.8, seed=11)])
    wide = sample(mx.concatenate([logits, logits]), batch, positions_from([0, 10], 4))
    assert wide[1].tolist() == parts
    assert wide[0].tolist() == mx.argmax(logits[0], -1).tolist()  # the greedy row


@pytest.mark.parametrize("params", [
    [SamplingParams(temperature=0.7, seed=1), SamplingParams(seed=2)],  # a sampled and a greedy row
    [SamplingParams(temperature=1.0, seed=3, top_p=0.9), SamplingParams(temperature=0.5, seed=4, top_k=5)],
    [SamplingParams(temperature=0.8, seed=5, presence_penalty=0.5, frequency_penalty=0.3,
                    logit_bias={7: 5.0}), SamplingParams(seed=6, logit_bias={3: -100.0})],
    [SamplingParams(), SamplingParams()],  # greedy, no seeds
])
def test_the_fused_sampler_is_the_argmax_of_the_scores(params):
    from specbatch.kernels import cpu
    from specbatch.kernels.sampling import perturbed
    logits = mx.random.normal((2, 3, 1_000), key=mx.random.key(9)) * 3
    rows = RowSampling.of(params, [[7, 7, 1], [3]])
    drafted = mx.array([[7, 2], [4, 4]], dtype=mx.int32)
    positions = positions_from([5, 40], 3)
    fused = sample(logits, rows, positions, drafted)  # on the kernels, one op where they run
    with cpu.disabled():  # the ops (with MLX's own noise: its logs may differ in the last bits)
        plain = sample(logits, rows, positions, drafted)
    expected = mx.argmax(perturbed(logits, rows, positions, drafted), axis=-1)  # the kernel's noise, MLX's ops
    assert fused.tolist() == expected.tolist() == plain.tolist()


def test_sampling_follows_the_distribution():
    logits = mx.log(mx.array([[[0.5, 0.3, 0.2]]]))
    rows = RowSampling.of([SamplingParams(temperature=1.0, seed=1)])
    draws = [sample(logits, rows, positions_from([p], 1)).item() for p in range(3000)]
    freq = [draws.count(i) / len(draws) for i in range(3)]
    assert freq == pytest.approx([0.5, 0.3, 0.2], abs=0.03)


@pytest.mark.parametrize("kernels", [True, False])
def test_position_noise_is_gumbel_and_independent_across_tokens_positions_and_seeds(kernels):
    import contextlib

    import numpy as np

    from specbatch.kernels import cpu
    from specbatch.kernels.sampling import position_noise
    with contextlib.nullcontext() if kernels else cpu.disabled():
        g = np.array(position_noise(list(range(32)), positions_from([0] * 32, 16), 2048)).astype(np.float64)
    se = np.sqrt(1.645 / g.size)  # [32 seeds, 16 positions, 2048 tokens]
    assert abs(g.mean() - 0.5772157) < 5 * se and abs(g.var() - np.pi**2 / 6) < 0.02
    for a, b in [(g[..., :-1], g[..., 1:]), (g[:, :-1], g[:, 1:]), (g[:-1], g[1:])]:
        assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < 0.01
    u = np.exp(-np.exp(-g)).ravel()  # the Gumbel CDF: uniform deciles
    assert np.allclose(np.histogram(u, bins=10, range=(0, 1))[0] / u.size, 0.1, atol=0.003)


def test_top_p_and_top_k_cut_the_tail():
    logits = mx.log(mx.array([[[0.5, 0.3, 0.15, 0.05]]]))
    for params, allowed in [(dict(top_p=0.7), {0, 1}), (dict(top_k=1), {0}), (dict(top_p=0.9, top_k=3), {0, 1, 2})]:
        rows = RowSampling.of([SamplingParams(temperature=1.0, seed=2, **params)])
        draws = {sample(logits, rows, positions_from([p], 1)).item() for p in range(400)}
        assert draws == allowed, params
