"""The speculation policy, pure: decisions monotone in acceptance and cost, plain where
drafting cannot pay, the gate's cap and overrides; the online acceptance book; the prior
derived from a calibration without a cost table."""

from __future__ import annotations

import json

import attrs

import pytest

from hypothesis import given
from hypothesis import strategies as st

from specbatch.kernels.calibration import SHIPPED, acceptance_by_position, derive_prior
from specbatch.runtime.params import SamplingParams
from specbatch.runtime.book import EWMA, RELAX, AcceptanceBook
from specbatch.runtime.policy import (PLAIN, CostModel, Decision, Prior, RowState, SpecPolicy,
                                      to_prior)
from specbatch.runtime.tree_shape import BatchTree, TreeShape

rates = st.floats(0.0, 1.0)
widths = st.integers(1, 32)
costs = st.builds(CostModel, st.floats(0.01, 1.0), st.floats(0.0, 0.1), st.floats(0.0, 0.5), st.floats(0.0, 0.05))


def policy(cost=CostModel(), **kw) -> SpecPolicy:
    return SpecPolicy(prior=Prior(cost), max_k=6, **kw)


@given(costs, widths, rates, rates)
def test_decisions_are_monotone_in_acceptance(cost, width, a, b):
    low, high = sorted((a, b))
    p = policy(cost)
    assert p.decide([RowState((low,) * 6)] * width).k <= p.decide([RowState((high,) * 6)] * width).k


@given(costs, widths, rates, st.floats(0.0, 0.5), st.floats(0.0, 0.05))
def test_decisions_never_draft_more_when_drafting_or_verifying_costs_more(cost, width, a, more_draft, more_token):
    rows = [RowState((a,) * 6)] * width
    dearer = CostModel(cost.target_fixed_s, cost.target_token_s + more_token, cost.draft_fixed_s + more_draft,
                       cost.draft_row_s)
    assert policy(dearer).decide(rows).k <= policy(cost).decide(rows).k


@given(costs, widths)
def test_plain_when_drafting_cannot_pay(cost, width):
    assert policy(cost).decide([RowState((0.0,) * 6)] * width) == PLAIN  # nothing is ever accepted
    free = CostModel(cost.target_fixed_s, 0.0, 0.0, 0.0)
    assert policy(free).decide([RowState((1.0,) * 6)] * width).k == 6  # everything is, drafts are free


@given(costs, st.lists(st.lists(rates, min_size=1, max_size=8), min_size=1, max_size=12))
def test_the_decision_is_the_best_candidate_it_scores(cost, acceptances):
    """Scored in one pass over the rows (chain_totals), bit for bit what rate() gives each."""
    p, rows = policy(cost), [RowState(a) for a in acceptances]
    decision = p.decide(rows)
    best = max(p.rate(rows, Decision(k)) for k in range(1, 7))
    assert (decision.plain and best <= 1.02 * p.rate(rows, PLAIN)) or p.rate(rows, decision) == best


tables = st.lists(st.floats(0.0, 0.02), min_size=3, max_size=7).map(lambda steps: CostModel(
    forward_table=[(2**i, 0.03 + sum(steps[:i + 1])) for i in range(len(steps))], row_s=0.0005,
    draft_fixed_s=0.001, draft_row_s=0.0001, verify_s=0.001, round_s=0.0005))


@given(tables, widths, rates, rates)
def test_table_priced_decisions_are_monotone_in_acceptance(cost, width, a, b):
    low, high = sorted((a, b))
    p = policy(cost)
    assert p.decide([RowState((low,) * 6)] * width).k <= p.decide([RowState((high,) * 6)] * width).k


def test_a_measured_table_speculates_where_a_forward_reads_its_weights_once():
    # flat to 4 tokens, then compute-bound: the line through both regimes prices verify too dear
    table = CostModel(forward_table=[(1, 0.035), (2, 0.036), (4, 0.038), (8, 0.050), (16, 0.080), (32, 0.150)],
                      row_s=0.001, draft_fixed_s=0.001, draft_row_s=0.0001, verify_s=0.001)
    line = CostModel(0.0343, 0.0053, 0.001, 0.0001)
    one = [RowState((0.15,) * 6)]
    assert policy(line).decide(one) == PLAIN and policy(table).decide(one).k >= 1
    assert policy(table).decide(one * 16) == PLAIN  # 16 rows x 2 positions: past the flat part


def test_the_gate_the_overrides_and_the_cap():
    rows = [RowState((0.9,) * 6)] * 3
    assert policy(cap=2).decide(rows) == PLAIN and policy(cap=3).decide(rows).k >= 1  # the cap is inclusive
    assert policy(cap=0).within_cap(1000) and not policy(speculation=False).within_cap(1)
    assert policy(max_temperature=0.5).decide([RowState((0.9,), 0.7)]) == PLAIN
    assert not policy(max_temperature=0.5).speculates([0.0, 0.7]) and policy().speculates([0.0, 0.7])
    assert policy(fixed=True).decide([RowState((0.0,))]) == Decision(6)  # the A/B override drafts regardless
    tree = TreeShape([2, 1, 1])
    assert policy(fixed=True, tree=tree).decide([RowState((0.5,))]) == Decision(3, tree)
    assert policy(fixed=True, tree=tree, trees=False).decide([RowState((0.5,))]) == Decision(6)
    batch = BatchTree("2,1", max_width=2, max_temperature=0.0)
    assert policy(fixed=True, batch_tree=batch).decide([RowState((0.5,))] * 2).tree == TreeShape([2, 1])
    assert policy(fixed=True, batch_tree=batch).decide([RowState((0.5,))] * 3).tree is None  # past its width
    assert policy(fixed=True, batch_tree=batch).decide([RowState((0.5,), 0.7)] * 2).tree is None  # too hot


def test_a_tree_is_chosen_only_where_it_scores_more_than_every_chain():
    cheap = CostModel(1.0, 0.0, 0.0, 0.0)  # extra positions free: the widest tree wins
    tree = TreeShape([3, 2])
    assert policy(cheap, tree=tree).decide([RowState((0.5,))]) == Decision(2, tree)
    dear = CostModel(1.0, 1.0, 0.0, 0.0)  # each position costs a forward: neither pays
    assert policy(dear, tree=tree).decide([RowState((0.5,))]) == PLAIN


def test_decision_within_the_room_left():
    tree = TreeShape([2, 2, 1])
    assert Decision(3, tree).within(2) == Decision(2, TreeShape([2, 2]))
    assert Decision(3, TreeShape([1, 1, 2])).within(2) == Decision(2)  # a chain left: a chain
    assert Decision(4).within(0) == PLAIN and Decision(2).within(5) == Decision(2)


class Req:
    def __init__(self, rid, temperature=0.0):
        self.id, self.params = rid, SamplingParams(temperature=temperature)


def test_the_book_tracks_each_rows_acceptance_by_position_from_the_prior():
    book = AcceptanceBook(Prior(acceptance=(0.5, 0.4)), depth=3)
    a, b = Req("a"), Req("b", 0.7)
    assert book.row(a) == RowState((0.5, 0.4, 0.4), 0.0)
    book.observe([a, b], drafted=3, accepted=[3, 0])
    ra, rb = book.row(a).acceptance, book.row(b).acceptance
    assert all(x > y for x, y in zip(ra, (0.5, 0.4, 0.4)))  # every position accepted: all rise
    assert rb[0] < 0.5 and rb[1:] == (0.4, 0.4)  # rejected at 1: later positions saw nothing
    book.keep([b])
    assert book.row(a) == RowState((0.5, 0.4, 0.4), 0.0) and book.row(b).temperature == 0.7


def test_plain_rounds_bring_a_rejected_row_back_to_speculating():
    from specbatch.runtime.policy import CostModel
    cost = CostModel(target_fixed_s=0.034, target_token_s=0.005, draft_fixed_s=0.001, draft_row_s=0.0)
    policy = SpecPolicy(prior=Prior(cost, (0.3,)), max_k=2)
    book, row = AcceptanceBook(policy.prior, depth=2), Req("a")
    decision = policy.decide(book.rows([row]))
    assert decision != PLAIN  # the prior pays
    rejections = 0
    while decision != PLAIN:  # a run of rejections: plain (each round decided as the core does)
        book.observe([row], drafted=1, accepted=[0])
        rejections += 1
        decision = policy.decide(book.rows([row]), decision)
        assert rejections < 50
    assert rejections >= 3  # at acceptance 0.3 most rounds reject: a few in a row do not flip it
    rounds = 0
    while decision == PLAIN:  # plain rounds observe nothing but drift back
        book.relax([row])
        rounds += 1
        decision = policy.decide(book.rows([row]), decision)
        assert rounds < 50
    assert book.row(row).acceptance[0] < 0.3 and 1 < rounds  # tried again, not at once


def test_acceptance_by_position_from_a_histogram():
    assert acceptance_by_position({0: 2, 1: 2, 2: 4}, 2) == [0.75, round(4 / 6, 4)]
    assert acceptance_by_position({}, 3) == []


@pytest.mark.parametrize("machine", sorted(json.loads(SHIPPED.read_text())))
def test_the_shipped_calibration_decides_as_its_schedule_measured(machine):
    """Each machine's (ISA's) measured forward table and fitted costs for the mtp pair decide as
    the schedule timed beside them did: a short chain alone where a k = 1-2 chain beat plain at
    width 1, plain at 16 rows everywhere; plain at every width where plain won every cell (the Zen
    4 of December 6 once plain rounds stopped pipelining: a k = 1 round took 1.44x a plain one,
    the head accepting 0.34). The separate drafter, where measured (no cost table: the derived,
    conservative prior), never pays."""
    from specbatch.runtime.policy import CostModel, Prior
    pairs = json.loads(SHIPPED.read_text())[machine]
    base = pairs["SmolLM2-135M-Instruct.Q4_1.gguf+none"]
    entry = pairs["SmolLM2-135M-Instruct.Q4_1.gguf+mtp"]
    mtp = SpecPolicy(prior=Prior(CostModel.from_json(entry["cost"]), entry["acceptance"]), max_k=4)
    row = RowState(mtp.prior.acceptance)
    if entry["schedule"]["bands"][0]["k"][0]:  # greedy requests alone drafted
        assert 1 <= mtp.decide([row]).k <= 2 and 1 <= mtp.paying_width() < 8
    else:
        assert mtp.decide([row]) == PLAIN and mtp.paying_width() == 0
    assert mtp.decide([row] * 16) == PLAIN
    if "SmolLM2-135M-Instruct.Q4_1.gguf+drafter" in pairs:
        model = SpecPolicy(prior=derive_prior(pairs["SmolLM2-135M-Instruct.Q4_1.gguf+drafter"], base), max_k=4)
        assert model.paying_width() == 0


def test_a_calibration_is_kept_per_kernel_isa():
    # a verify's cost by ISA differs enough to change the schedule (AVX-512 k = 2, AVX2 k = 1)
    from specbatch.kernels import cpu
    from specbatch.kernels.calibration import machine_key
    state = cpu.status()
    assert f"-{state.isa if state.active else 'mlxops'}-" in machine_key()


# one width-1 plain round 10 ms, a k = 1 round 11.5 ms (as calibrate timed them): k = 1 pays
# above acceptance 0.15, by the 2% margin above 0.173, and plain beats it by it below 0.1275
TIMED = CostModel(rounds=[(1, 0, 0.010), (1, 1, 0.0115), (4, 0, 0.012), (4, 1, 0.016)])


@pytest.mark.parametrize("a, after_plain, after_draft", [(0.10, PLAIN, PLAIN), (0.15, PLAIN, Decision(1)),
                                                         (0.20, Decision(1), Decision(1))])
def test_the_mode_the_last_round_ran_is_kept_unless_the_other_wins_by_the_margin(a, after_plain, after_draft):
    p, rows = SpecPolicy(prior=Prior(TIMED), max_k=1), [RowState((a,))]
    assert p.decide(rows) == p.decide(rows, PLAIN) == after_plain
    assert p.decide(rows, Decision(1)) == after_draft


def test_timed_rounds_price_themselves_and_the_model_fills_between_and_past_them():
    assert TIMED.plain_s(1) == 0.010 and TIMED.chain_s(4, 1) == 0.016
    assert TIMED.plain_s(2) == pytest.approx(0.010 + 0.002 / 3)  # linear between timed widths
    model = attrs.evolve(TIMED, rounds=())
    # past the widest timed width: the model scaled to agree there
    assert TIMED.plain_s(8) == pytest.approx(0.012 * model.plain_s(8) / model.plain_s(4))
    # a k never timed: the model scaled from the nearest timed k at that width
    assert TIMED.chain_s(4, 3) == pytest.approx(0.016 * model.chain_s(4, 3) / model.chain_s(4, 1))
    assert CostModel.from_json(TIMED.to_json()) == TIMED


def test_a_row_starts_from_and_relaxes_toward_its_temperature_bands_prior():
    prior = Prior(CostModel(), (0.35, 0.33), [(1.0, (0.31, 0.33)), (0.0, (0.37, 0.39)), (0.7, (0.38, 0.27))])
    assert [t for t, _ in prior.bands] == [0.0, 0.7, 1.0]  # coldest first, whatever the file's order
    assert (prior.at(1, 0.0), prior.at(2, 0.5), prior.at(3, 1.0), prior.at(1, 1.5), prior.at(1)) == (0.37, 0.27, 0.33, 0.35, 0.35)
    book = AcceptanceBook(prior, depth=2)
    greedy, hot = Req("g", 0.0), Req("h", 1.0)
    assert book.row(greedy).acceptance == (0.37, 0.39) and book.row(hot).acceptance == (0.31, 0.33)
    book.observe([greedy], 1, [0])  # a rejection, then a plain round relaxes it toward its band
    book.relax([greedy])
    a = 0.37 + EWMA * (0.0 - 0.37)
    assert book.row(greedy).acceptance[0] == pytest.approx(a + RELAX * (0.37 - a))
    assert to_prior(attrs.asdict(prior)) == prior


def test_bands_come_from_the_cells_chains_of_one_and_two():
    from specbatch.kernels.calibration import acceptance_bands
    cells = {"T=0.0 width=1": {"1": 0.4, "2": 0.3}, "T=0.0 width=2": {"1": 0.36, "2": 0.27},
             "T=0.7 width=1": {"1": 0.3}, "T=1.0 width=1": {}}
    got = acceptance_bands(cells)
    assert [t for t, _ in got] == [0.0, 0.7]
    assert got[0][1] == pytest.approx([0.38, 0.5], abs=1e-4)  # a2 = 2 * rate / a1 - 1: 0.5 at both widths
    assert got[1][1] == [0.3]
