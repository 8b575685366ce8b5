"""The draft-length schedule (what calibration measures): lookups by width and temperature
band, the cap it implies, the calibration's choice per cell; a fixed draft through the engine."""

from __future__ import annotations

import pytest

from specbatch.kernels import calibration
from specbatch.runtime.config import EngineConfig
from specbatch.runtime.params import SamplingParams
from specbatch.runtime.schedule import Band, DraftSchedule
from specbatch.tools.calibrate import best_k
from specbatch.kernels.build import new_core

SCHEDULE = DraftSchedule([1, 2, 4, 8], [Band(0.0, [4, 3, 2, 0]), Band(0.7, [2, 1, 0, 0])])


def test_lookup_by_width_and_band():
    assert [SCHEDULE.draft_length(w, 0.0) for w in (1, 2, 3, 4, 7, 8, 100)] == [4, 3, 3, 2, 2, 0, 0]
    assert [SCHEDULE.draft_length(w, 0.5) for w in (1, 2, 4)] == [2, 1, 0]  # (0, 0.7] uses the 0.7 band
    assert SCHEDULE.draft_length(1, 0.7) == 2 and SCHEDULE.draft_length(1, 0.71) == 0  # past every band
    assert SCHEDULE.cap() == 4 and SCHEDULE.max_k() == 4
    assert DraftSchedule.from_json(SCHEDULE.to_json()) == SCHEDULE


@pytest.mark.parametrize("bad", [dict(widths=[2, 4], bands=[Band(0.0, [1, 1])]),
                                 dict(widths=[1, 1], bands=[Band(0.0, [1, 1])]),
                                 dict(widths=[1, 2], bands=[Band(0.0, [1])]),
                                 dict(widths=[1], bands=[Band(0.7, [1]), Band(0.0, [1])])])
def test_malformed_schedules_are_refused(bad):
    with pytest.raises(ValueError):
        DraftSchedule(**bad)
    with pytest.raises(ValueError):
        Band(0.0, [-1])


def test_calibration_picks_each_cell_and_stores_the_schedule(tmp_path, monkeypatch):
    assert best_k({0: 10.0, 1: 12.0, 2: 14.0, 4: 13.0}) == 2
    assert best_k({0: 10.0, 1: 10.2, 2: 9.0}) == 0  # within the margin: plain
    monkeypatch.setenv("SPECBATCH_CALIBRATION", str(tmp_path / "cal.json"))
    calibration.store("/m/target.gguf", "ngram", SCHEDULE, {})
    assert calibration.lookup("/x/target.gguf", "ngram", "schedule", DraftSchedule.from_json) == SCHEDULE
    assert calibration.lookup_cap("/x/target.gguf", "ngram") == 4
    assert calibration.lookup("/x/other.gguf", "ngram", "schedule", DraftSchedule.from_json) is None


def test_a_fixed_draft_drafts_num_draft_tokens_at_each_width(tiny):
    from helpers import drive, plain_streams

    config = EngineConfig(speculative_width_cap=0, num_draft_tokens=3, fixed_draft=True)
    jobs = [(p, SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0)) for p in ("def f(x):", "x = 1")]
    with new_core(tiny, tiny, config) as core:
        run, ids = drive(core, {0: jobs[:1]})
        alone = core.stats()
        assert alone["spec_rounds"] > 0 and alone["drafted_tokens"] <= 3 * alone["spec_rounds"]
        assert alone["drafted_tokens"] > 2 * alone["spec_rounds"]  # k = 3 but for the budget's tail
    with new_core(tiny, tiny, config) as core:
        both, both_ids = drive(core, {0: jobs})
        stats = core.stats()
        assert stats["spec_widths"] == {2: stats["spec_rounds"]}
        assert stats["drafted_tokens"] > 2 * 2 * stats["spec_rounds"]  # k = 3 a row, but for the tail
        assert stats["drafted_tokens"] <= 3 * sum(stats["acceptance_histogram"].values())  # 3 a row-round
    assert [run.tokens[ids[0]]] + [both.tokens[i] for i in both_ids[1:]] == plain_streams(tiny, jobs)
