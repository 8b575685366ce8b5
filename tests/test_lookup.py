"""Prompt lookup beside the MTP head (kernels/drafters/lookup.py): the suffix search, the
one-round stand-in drafter, the scalar loop's lookup rounds, and the policy's price."""

from __future__ import annotations

import types

import mlx.core as mx
import pytest
from helpers import make_request, run_plain

from specbatch import SamplingParams
from specbatch.kernels.build import new_core
from specbatch.kernels.drafters.lookup import History, Proposed
from specbatch.kernels.drafters.model import ModelDrafter
from specbatch.kernels.drafters.mtp import MTPDrafter
from specbatch.kernels.loops.scalar import ScalarLoop
from specbatch.kernels.runner import ModelRunner
from specbatch.runtime.config import EngineConfig
from specbatch.runtime.cost import CostModel
from specbatch.serving.http.metrics import render_metrics
from specbatch.runtime.book import LOOKUP_EWMA, AcceptanceBook
from specbatch.runtime.policy import Decision, Prior, RowState, SpecPolicy


def test_history_proposes_what_followed_the_latest_earlier_match():
    h = History([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3])
    assert h.proposal(3, 4) == [7, 8, 5, 1]  # the latest earlier "1 2 3", not the first
    assert h.proposal(3, 2) == [7, 8]
    assert h.proposal(4, 4) == []  # "5 1 2 3" never occurred before
    assert h.proposal(3, 0) == []
    h.extend([6])
    assert h.proposal(1, 4) == []  # 6 is new


def test_history_matches_whole_tokens_only():
    # 0x00000100 then 0x00000001: their bytes hold "01 00 00 00" straddling the two tokens
    h = History([256, 1, 5, 1])
    assert h.proposal(1, 3) == [5, 1]
    h = History([7, 7, 7])
    assert h.proposal(2, 4) == [7]  # an overlapping run: what follows is the last token


def test_history_sync_appends_only_the_new_tokens():
    prompt, tokens = [4, 5, 6], [7]
    h = History(prompt)
    h.sync(tokens, len(prompt))
    tokens += [4, 5]
    h.sync(tokens, len(prompt))
    h.sync(tokens, len(prompt))
    assert len(h) == 6 and h.proposal(2, 3) == [6, 7, 4]


def test_a_lookup_round_stands_in_only_for_a_drafter_without_drafted_state(tiny, mtp_head):
    runner = ModelRunner(tiny.model)
    with pytest.raises(TypeError, match="keeps drafted state"):
        Proposed(ModelDrafter(tiny.model, batch=False), [1, 2], runner.vocab_size)
    proposed = Proposed(MTPDrafter(mtp_head, runner), [3, 4], runner.vocab_size)
    tokens, logits = proposed.draft(mx.array([1]), mx.array([2]), 2, None)
    assert tokens.tolist() == [[3, 4]] and logits.shape == (1, 2, runner.vocab_size)
    assert mx.argmax(logits, axis=-1).tolist() == [[3, 4]]
    with pytest.raises(ValueError, match="proposes its 2 tokens"):
        proposed.draft(mx.array([1]), mx.array([2]), 3, None)


PROMPT = "a b c a b c a b c a b c"


@pytest.mark.parametrize("decision", [Decision(1, lookup=4), Decision(0, lookup=3), Decision(2, lookup=1)])
@pytest.mark.parametrize("temperature", [0.0, 0.3])  # (the tiny random model repeats little hotter)
def test_lookup_rounds_keep_the_stream_plain_decoding_gives(tiny, mtp_head, decision, temperature):
    kw = dict(max_tokens=40, temperature=temperature, seed=5, ignore_eos=True)
    reference = run_plain(tiny, PROMPT, **kw)
    request = make_request(tiny, PROMPT, **kw)
    runner = ModelRunner(tiny.model)
    loop = ScalarLoop(runner, MTPDrafter(mtp_head, runner), request, lookup_match=2)
    loop.start()
    lookups = 0
    while not loop.finished:
        out = loop.step(decision)
        if out.verify is not None:
            lookups += out.verify.lookup
            assert out.verify.drafted <= max(decision.lookup if out.verify.lookup else decision.k, 0)
    assert request.tokens == reference
    assert lookups > 0  # the repeating prompt matches from the first round


def test_without_lookup_match_or_with_a_stateful_drafter_no_lookup_round_runs(tiny, tiny_draft, mtp_head):
    runner = ModelRunner(tiny.model)
    for drafter, match in ((MTPDrafter(mtp_head, runner), 0), (ModelDrafter(tiny_draft.model, batch=False), 2)):
        request = make_request(tiny, PROMPT, max_tokens=12, ignore_eos=True)
        loop = ScalarLoop(runner, drafter, request, lookup_match=match)
        loop.start()
        while not loop.finished:
            out = loop.step(Decision(1, lookup=4))
            assert out.verify is None or not out.verify.lookup


def _policy(lookup_k: int, acceptance: float) -> SpecPolicy:
    # a step 10 ms, each extra position 3 ms, a head step 2 ms
    cost = CostModel(forward_table=((1, 0.010), (2, 0.013), (5, 0.022)), draft_fixed_s=0.002, draft_row_s=0.0)
    return SpecPolicy(prior=Prior(acceptance=(acceptance,) * 4, cost=cost), lookup_k=lookup_k)


def test_the_policy_allows_lookup_rounds_where_they_pay_a_lone_row():
    lone, pair = [RowState([0.2] * 4)], [RowState([0.2] * 4)] * 2
    # at the prior's 0.75 a position: 1.75 / 13 ms, 2.31 / 16, 2.73 / 19, 3.05 / 22 tokens a ms
    assert _policy(4, 0.2).decide(lone) == Decision(0, lookup=2)  # the head does not pay, lookup does
    assert _policy(4, 0.2).decide([RowState([0.2] * 4, lookup=[0.95])]) == Decision(0, lookup=4)
    assert _policy(4, 0.2).decide([RowState([0.2] * 4, lookup=[0.1])]) == Decision(0)  # its lookups miss
    assert _policy(0, 0.2).decide(lone) == Decision(0)
    assert _policy(4, 0.2).decide(pair).lookup == 0  # a batch drafts by its drafter only
    assert _policy(4, 0.99).decide([RowState([0.99] * 4)]).lookup == 0  # the head beats it
    assert Decision(2, lookup=4).within(3) == Decision(2, lookup=3)
    assert Decision(2, lookup=4).within(1) == Decision(1, lookup=1)
    assert Decision(2, lookup=4).within(0) == Decision(0)


def test_the_book_learns_each_rows_lookup_acceptance_apart_and_forgets_it_slowly():
    book = AcceptanceBook(Prior(acceptance=(0.5,)))
    a, b = make_request_stub("a"), make_request_stub("b")
    book.observe([a, b], 4, [0, 4], lookup=True)
    assert book.row(a).acceptance == book.row(b).acceptance == (0.5,) * 8  # the drafter's untouched
    assert book.row(a).lookup[0] == pytest.approx(0.75 + LOOKUP_EWMA * (0.0 - 0.75))
    assert book.row(a).lookup[1] == pytest.approx(0.75)  # past the first reject: nothing seen
    assert book.row(b).lookup == pytest.approx((0.75 + LOOKUP_EWMA * 0.25,) * 4)
    low = book.row(a).lookup[0]
    book.relax([a])  # a plain round: back toward the prior, a little
    assert low < book.row(a).lookup[0] < 0.75
    book.observe([a], 1, [1])  # a head round moves the head's rates, and lookup's back a little
    assert book.row(a).acceptance[0] > 0.5 and book.row(a).lookup[0] < 0.75
    book.keep([b])
    assert book.row(a).lookup == (0.75,)


def make_request_stub(rid: str):
    return types.SimpleNamespace(id=rid, params=types.SimpleNamespace(temperature=0.0))


def test_the_engine_drafts_a_repeating_lone_stream_by_lookup_and_counts_it(tiny, mtp_head):
    kw = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
    reference = run_plain(tiny, PROMPT, **kw)
    for match, rounds in ((2, lambda n: n > 0), (0, lambda n: n == 0)):
        with new_core(tiny, mtp_head, EngineConfig(prompt_lookup=match, speculative_width_cap=1)) as core:
            core.add(PROMPT, SamplingParams(**kw))
            tokens, done = [], False
            while not done:
                for event in core.step():
                    tokens += event.token_ids
                    done = done or event.finish_reason is not None
            stats = core.stats()
        assert tokens == reference and rounds(stats["lookup_rounds"])
        assert 0.0 <= stats["lookup_acceptance_rate"] <= 1.0
        assert ("specbatch_lookup_rounds_total " + str(stats["lookup_rounds"])) in render_metrics(stats)
