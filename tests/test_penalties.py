"""logit_bias and presence / frequency penalties: applied to the target's logits the same
way at every position, so every loop and drafter still emits plain decoding's stream."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import drive_scalar, run_batch, run_plain, run_scalar

from specbatch.kernels.drafters.ngram import NGramSource
from specbatch.kernels.sampling import RowSampling, adjusted
from specbatch.runtime.params import SamplingParams

PROMPTS = ["def f(x):", "import os\n", "class A:\n    pass\n", "x = 1", "while 1:"]
ADJUST = [dict(frequency_penalty=2.0), dict(presence_penalty=1.5, logit_bias={"7": 5.0}),
          dict(frequency_penalty=-0.5, presence_penalty=0.7), dict(logit_bias={3: -100, 11: 4.0}),
          dict(frequency_penalty=1.0, logit_bias={"9": 2.5})]


def test_adjusted_adds_bias_and_subtracts_the_counts_before_each_position():
    params = SamplingParams(logit_bias={"1": 3.0}, frequency_penalty=0.5, presence_penalty=0.25)
    rows = RowSampling.of([params], [[2, 2, 4]])
    drafts = mx.array([[4, 2]])  # positions 0, 1, 2 follow 0, 1 and 2 of these drafts
    out = adjusted(mx.zeros((1, 3, 6)), rows, drafts).tolist()[0]
    assert out[0] == [0, 3.0, -1.25, 0, -0.75, 0]  # history: two 2s, one 4
    assert out[1] == [0, 3.0, -1.25, 0, -1.25, 0]  # + the first draft, a 4
    assert out[2] == [0, 3.0, -1.75, 0, -1.25, 0]  # + the second, a 2


def test_no_bias_and_no_penalty_leave_the_logits_untouched():
    logits = mx.ones((2, 1, 5))
    assert adjusted(logits, RowSampling.of([SamplingParams()] * 2)) is logits


@pytest.mark.parametrize("bad", [dict(logit_bias={"abc": 1}), dict(logit_bias={"1": 101}),
                                 dict(logit_bias={str(i): 1 for i in range(301)}), dict(frequency_penalty=2.5),
                                 dict(presence_penalty=-3), dict(logit_bias={"1": True})])
def test_out_of_range_values_are_refused(bad):
    with pytest.raises((TypeError, ValueError)):
        SamplingParams(**bad)


def test_they_change_what_is_decoded(tiny):
    base = run_plain(tiny, "def f(x):", max_tokens=16, ignore_eos=True)
    assert run_plain(tiny, "def f(x):", max_tokens=16, ignore_eos=True, logit_bias={"42": 100}) == [42] * 16
    penalized = run_plain(tiny, "def f(x):", max_tokens=16, ignore_eos=True, frequency_penalty=2.0)
    assert penalized != base
    assert max(penalized.count(t) for t in penalized) < max(base.count(t) for t in base)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_speculative_streams_equal_plain(tiny, tiny_draft, temperature):
    params = [dict(max_tokens=18, temperature=temperature, seed=60 + i, ignore_eos=True, **a)
              for i, a in enumerate(ADJUST)]
    plain = [run_plain(tiny, p, **kw) for p, kw in zip(PROMPTS, params)]
    for drafter in (tiny, tiny_draft, NGramSource(512)):  # an oracle, a random model, prompt lookup
        assert [run_scalar(tiny, drafter, p, k=3, **kw)[0] for p, kw in zip(PROMPTS, params)] == plain
        assert run_batch(tiny, drafter, PROMPTS, k=3, params=params)[0] == plain
        assert run_batch(tiny, drafter, PROMPTS, k=3, params=params, together=True)[0] == plain
        mixed = [params[0], dict(max_tokens=18, temperature=temperature, seed=1, ignore_eos=True)]
        assert run_batch(tiny, drafter, PROMPTS[:2], k=3, params=mixed)[0] == \
            [plain[0], run_plain(tiny, PROMPTS[1], **mixed[1])]  # an unpenalized neighbour is unaffected


def test_rejection_verification_keeps_greedy_rows_exact(tiny, tiny_draft):
    kw = dict(max_tokens=18, ignore_eos=True, frequency_penalty=1.5, logit_bias={"5": 3.0})
    ref = run_plain(tiny, PROMPTS[0], **kw)
    assert run_scalar(tiny, tiny_draft, PROMPTS[0], k=3, verify="rejection", **kw)[0] == ref


def test_self_drafted_rounds_accept_drafts_under_penalties(tiny):
    kw = dict(max_tokens=24, ignore_eos=True, frequency_penalty=0.8)
    tokens, rounds, _ = drive_scalar(tiny, tiny, PROMPTS[0], k=4, **kw)
    assert tokens == run_plain(tiny, PROMPTS[0], **kw)
    assert sum(r.accepted[0] for r in rounds) > 0  # the verify block's counts did not reject everything


def test_fake_kernel_drafters_equal_plain(fakes):
    target, drafters = fakes
    params = [dict(max_tokens=16, temperature=t, seed=3 + i, ignore_eos=True, **ADJUST[i])
              for i, t in enumerate([0.0, 0.8, 0.0, 1.0])]
    prompts = [[5, 6, 7], [9, 9], [1, 2, 3, 4], [8]]
    plain = [run_plain(target, p, **kw) for p, kw in zip(prompts, params)]
    for drafter in drafters:
        assert [run_scalar(target, drafter, p, k=3, **kw)[0] for p, kw in zip(prompts, params)] == plain
        assert run_batch(target, drafter, prompts, k=3, params=params)[0] == plain
