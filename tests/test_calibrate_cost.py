"""The policy's cost model fitted from the rounds calibration timed."""

from __future__ import annotations

import pytest

from specbatch.runtime.policy import CostModel
from specbatch.tools.calibrate_cost import Cell, cells_from, fit_cost

TRUE = CostModel(target_fixed_s=0.030, target_token_s=0.0012, draft_fixed_s=0.004, draft_row_s=0.0006)


def measured(cost: CostModel, width: int, k: int, a: float, noise: float = 1.0) -> Cell:
    """The cell a run at ``cost`` would measure: tokens/s = rows x tokens a round / seconds."""
    seconds = cost.forward_s(width, k + 1) + k * cost.draft_s(width)
    return Cell(width, k, width * (1 + k * a) / (seconds * noise), a)


def test_the_fit_recovers_the_costs_the_rounds_were_timed_at():
    cells = [measured(TRUE, w, k, 0.0 if k == 0 else 0.8 - 0.1 * k) for w in (1, 2, 4, 8) for k in (0, 1, 2, 3)]
    got = fit_cost(cells)
    for field in ("target_fixed_s", "target_token_s", "draft_fixed_s", "draft_row_s"):
        assert getattr(got, field) == pytest.approx(getattr(TRUE, field), rel=1e-6)


def test_a_cost_fitted_below_zero_is_pinned_at_zero_and_the_rest_still_explain_the_rounds():
    free_drafts = CostModel(0.030, 0.0012, 0.0, 0.0)  # a drafter that costs nothing
    cells = [measured(free_drafts, w, k, 0.7 if k else 0.0, noise=1.0 + 0.01 * ((w + k) % 3 - 1))
             for w in (1, 2, 4, 8) for k in (0, 1, 2)]
    got = fit_cost(cells)
    assert min(got.target_fixed_s, got.target_token_s, got.draft_fixed_s, got.draft_row_s) >= 0.0
    for c in cells:
        predicted = got.forward_s(c.width, c.k + 1) + c.k * got.draft_s(c.width)
        assert predicted == pytest.approx(c.round_s, rel=0.03)


def test_too_few_widths_give_no_fit():
    assert fit_cost([measured(TRUE, 1, k, 0.5) for k in (0, 1, 2)]) is None
    assert fit_cost([measured(TRUE, w, 0, 0.0) for w in (1, 2, 4)]) is None  # no drafted cells


def test_cells_come_from_the_calibration_table():
    table = {"T=0.0 width=1": {"0": 20.0, "1": 25.0}, "T=0.7 width=4": {"0": 60.0, "2": 0.0}, "acceptance": [0.7]}
    acceptance = {"T=0.0 width=1": {"1": 0.6}, "T=0.7 width=4": {"2": 0.3}}
    cells = cells_from(table, acceptance)
    assert cells == [Cell(1, 0, 20.0, 0.0), Cell(1, 1, 25.0, 0.6), Cell(4, 0, 60.0, 0.0)]  # 0 tok/s: not measured
    assert cells[1].round_s == pytest.approx(1 * 1.6 / 25.0)


TABLE = CostModel(forward_table=[(1, 0.030), (2, 0.031), (4, 0.033), (8, 0.040), (16, 0.070)], row_s=0.001,
                  draft_fixed_s=0.002, draft_row_s=0.0003, verify_s=0.0015, round_s=0.0005, round_row_s=0.0002)


def test_the_table_prices_a_forward_between_below_and_past_its_points():
    assert TABLE.forward_s(1, 1) == pytest.approx(0.030)
    assert TABLE.forward_s(1, 3) == pytest.approx(0.032)  # halfway from 2 to 4 positions
    assert TABLE.forward_s(4, 1) == pytest.approx(0.033 + 3 * 0.001)  # each row past the first adds row_s
    assert TABLE.forward_s(1, 32) == pytest.approx(0.070 + 16 * (0.030 / 8))  # the last slope
    assert CostModel(forward_table=[(4, 0.04)]).forward_s(1, 2) == pytest.approx(0.04)  # never below the first
    assert TABLE.chain_s(2, 3) == pytest.approx(3 * (0.002 + 0.0006) + 0.040 + 0.001 + 0.0005 + 0.0004 + 0.0015)
    assert TABLE.plain_s(2) == pytest.approx(0.031 + 0.001 + 0.0005 + 0.0004)


def test_with_measured_forwards_the_fit_recovers_what_rounds_spend_beyond_them():
    def timed(width: int, k: int, a: float) -> Cell:
        seconds = TABLE.plain_s(width) if k == 0 else TABLE.chain_s(width, k)
        return Cell(width, k, width * (1 + k * a) / seconds, a)
    cells = [timed(w, k, 0.0 if k == 0 else 0.7 - 0.1 * k) for w in (1, 2, 4, 8) for k in (0, 1, 2, 3)]
    forwards = CostModel(forward_table=TABLE.forward_table, row_s=TABLE.row_s)
    got = fit_cost(cells, forwards)
    assert got.forward_table == TABLE.forward_table and got.row_s == TABLE.row_s
    for field in ("draft_fixed_s", "draft_row_s", "verify_s", "round_s", "round_row_s"):
        assert getattr(got, field) == pytest.approx(getattr(TABLE, field), rel=1e-6, abs=1e-9)


def test_a_cost_model_round_trips_through_json_and_old_files_load():
    assert CostModel.from_json(TABLE.to_json()) == TABLE
    old = {"target_fixed_s": 0.03, "target_token_s": 0.005, "draft_fixed_s": 0.001, "draft_row_s": 0.0}
    assert CostModel.from_json(old) == CostModel(0.03, 0.005, 0.001, 0.0)  # no table: the line
