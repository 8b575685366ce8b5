"""Verification: exact-match acceptance, and rejection sampling that keeps p exactly."""

from __future__ import annotations

import mlx.core as mx
import pytest

from specbatch.kernels.loops.verify import rejection_chooser, verify_coupled, verify_rejection
from specbatch.kernels.sampling import RowSampling
from specbatch.runtime.params import SamplingParams


def test_exact_match_counts_the_leading_run():
    target_logits = mx.zeros((3, 4, 8))
    # target argmax per position is set through one-hot logits
    want = mx.array([[1, 2, 3, 4], [1, 5, 3, 4], [7, 2, 3, 4]])
    logits = target_logits + 10 * (mx.arange(8)[None, None] == want[..., None])
    drafts = mx.array([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    rows = RowSampling.of([SamplingParams()] * 3)
    tokens, accepted = verify_coupled(logits, drafts, rows, [0, 0, 0])
    assert tokens.tolist() == want.tolist() and accepted.tolist() == [3, 1, 0]


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_rejection_sampling_reproduces_the_target_distribution(temperature, top_p):
    B, k, V = 10000, 3, 5
    p_logits = mx.log(mx.array([0.40, 0.25, 0.15, 0.12, 0.08]))
    q_logits = mx.log(mx.array([0.10, 0.30, 0.30, 0.10, 0.20]))
    rows = RowSampling.of([SamplingParams(temperature=temperature, top_p=top_p, seed=s) for s in range(B)])
    starts = [0] * B
    draft_logits = mx.broadcast_to(q_logits, (B, k, V))
    choose = rejection_chooser(rows, starts)
    drafts = mx.stack([choose(draft_logits[:, j], j) for j in range(k)], axis=1)  # [B, k]
    target_logits = mx.broadcast_to(p_logits, (B, k + 1, V))
    tokens, accepted = verify_rejection(target_logits, draft_logits, drafts, rows, starts)
    tokens, accepted = tokens.tolist(), accepted.tolist()
    # the target's own sampling distribution (filters and temperature applied)
    from specbatch.kernels.loops.verify import _probs
    want = _probs(target_logits[:1, :1], RowSampling.of([rows_one(temperature, top_p)]))[0, 0].tolist()
    for i in range(k + 1):
        emitted = [t[i] for t, a in zip(tokens, accepted) if a >= i]
        assert len(emitted) > 800
        freq = [emitted.count(v) / len(emitted) for v in range(V)]
        assert freq == pytest.approx(want, abs=0.035), (i, freq, want)
    assert 0.15 < sum(accepted) / (B * k) < 0.9  # neither trivial nor total


def rows_one(temperature, top_p):
    return SamplingParams(temperature=temperature, top_p=top_p, seed=0)


def test_greedy_rows_fall_back_to_exact_match():
    logits = mx.random.normal((2, 3, 16), key=mx.random.key(1))
    greedy = logits.argmax(-1)
    drafts = mx.stack([greedy[0, :2], mx.array([0, 0])])
    rows = RowSampling.of([SamplingParams(seed=1), SamplingParams(seed=2)])
    tokens, accepted = verify_rejection(logits, logits[:, :2], drafts.astype(mx.int32), rows, [0, 0])
    assert tokens.tolist() == greedy.tolist()
    assert accepted.tolist()[0] == 2
