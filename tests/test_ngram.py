"""Prompt-lookup drafting: proposals, and streams equal to plain decoding in both loops."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import run_batch, run_plain, run_scalar
from hypothesis import given
from hypothesis import strategies as st

from specbatch import SamplingParams
from specbatch.kernels.drafters.base import Capture
from specbatch.kernels.drafters.ngram import NGramDrafter, NGramSource, propose
from specbatch.runtime.config import EngineConfig
from specbatch.kernels.build import new_engine

PROMPTS = ["def f(x):\n    return x\ndef f(x):\n", "import os\nimport os\nimport", "x = 1", "a b a b a b"]


def test_propose_continues_the_latest_match():
    seq = np.array([5, 1, 2, 3, 9, 1, 2, 3, 7, 1, 2])
    assert propose(seq, 3, 4, 1) == [3, 7, 1]  # "1 2" last seen before "3 7"
    assert propose(np.array([4, 5, 6]), 2, 4, 1) == [6, 6]  # no earlier match: repeat the last
    assert propose(np.array([8, 8]), 3, 4, 1) == [8, 8, 8]


def _latest_match_reference(seq: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        starts = [i + n for i in range(len(seq) - n) if seq[i:i + n] == seq[-n:]]
        if starts:
            got = seq[starts[-1]:starts[-1] + k]
            return got + [seq[-1]] * (k - len(got))
    return [seq[-1]] * k


@given(st.lists(st.integers(0, 300), min_size=1, max_size=60), st.integers(1, 6), st.integers(1, 4))
def test_propose_is_the_plain_search_over_whole_tokens(seq, k, max_n):
    """The byte search (History.proposal) against a list search: ids above 255 put equal bytes
    across token boundaries, which must never match."""
    seq = [t if t < 256 else t * 257 for t in seq]
    assert propose(seq, k, max_n, 1) == _latest_match_reference(seq, k, max_n, 1)


@given(st.lists(st.integers(0, 5), min_size=1, max_size=60), st.integers(1, 6))
def test_proposals_are_k_tokens_seen_in_the_row(seq, k):
    got = propose(np.array(seq), k, 4, 1)
    assert len(got) == k and set(got) <= set(seq)


def test_rollback_restores_what_was_fed():
    d = NGramDrafter(NGramSource(16))
    d.cold_start(Capture([[1, 2, 3, 1, 2], [4, 5, 6, 7]]))
    import mlx.core as mx
    before = [list(f) for f in d._fed]
    tokens, logits = d.draft(mx.array([1, 6]), mx.array([2, 7]), 3, choose=None)
    assert tokens.shape == (2, 3) and logits.shape == (2, 3, 16)
    d.rollback([3, 3])  # nothing accepted: the old pending becomes the next prev
    assert d._fed == [before[0] + [1], before[1] + [6]]


@pytest.mark.parametrize("k", [1, 3])
def test_ngram_streams_equal_plain(tiny, k):
    source = NGramSource(tiny.vocab_size)
    params = [dict(max_tokens=20, temperature=0.0 if i % 2 == 0 else 0.8, seed=i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    plain = [run_plain(tiny, p, **kw) for p, kw in zip(PROMPTS, params)]
    assert [run_scalar(tiny, source, p, k=k, **kw)[0] for p, kw in zip(PROMPTS, params)] == plain
    assert run_batch(tiny, source, PROMPTS, k=k, params=params)[0] == plain
    greedy = [kw for kw in params if kw["temperature"] == 0.0]
    prompts = [p for p, kw in zip(PROMPTS, params) if kw["temperature"] == 0.0]
    out, _ = run_batch(tiny, source, prompts, k=k, params=greedy, verify="rejection")
    assert out == [ref for ref, kw in zip(plain, params) if kw["temperature"] == 0.0]


def test_engine_with_ngram_drafter(tiny):
    config = EngineConfig(num_draft_tokens=3, speculative_width_cap=4)
    with new_engine(tiny, NGramSource(tiny.vocab_size), config) as engine:
        handles = [engine.submit(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in PROMPTS]
        out = [h.result(timeout=120).token_ids for h in handles]
        assert engine.stats()["drafted_tokens"] > 0
    assert out == [run_plain(tiny, p, max_tokens=24, ignore_eos=True, seed=0) for p in PROMPTS]


def test_a_plain_round_feeds_each_row_the_token_the_next_draft_moved_past():
    import mlx.core as mx
    drafter = NGramDrafter(NGramSource(64))
    drafter.add_rows([[1, 2, 3, 4], [7, 8, 9]])
    drafter.advance([3, 8])  # plain round: prev 3 -> 4 (pending 5), prev 8 -> 9 (pending 6)
    assert drafter._fed == [[1, 2, 3], [7, 8]]
    drafter.draft(mx.array([4, 9]), mx.array([5, 6]), 1, None)
    assert drafter._fed == [[1, 2, 3, 4, 5], [7, 8, 9, 6]]  # the invariant: the sequence but its last two
