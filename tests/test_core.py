"""The EngineCore API on its own: add, step, cancel, events, state, has_work, stats, close."""

from __future__ import annotations

import pytest
from helpers import Run, drive, inject_failure, plain_streams

from specbatch import EngineClosed, InvalidRequest, QueueFull, SamplingParams, StepEvent
from specbatch.runtime.config import EngineConfig
from specbatch.kernels.build import from_pretrained, new_core


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture
def plain(tiny):
    with new_core(tiny, None, EngineConfig(speculation=False)) as core:
        yield core


def test_a_fresh_core_is_idle_and_a_step_without_work_does_nothing(plain):
    assert plain.state == "Idle" and not plain.has_work()
    assert plain.step() == [] and plain.state == "Idle"
    stats = plain.stats()
    assert stats["rounds"] == 0 and stats["transitions"] == {} and stats["queue_depth"] == 0


def test_add_queues_until_the_next_step(plain):
    rid = plain.add("def f(x):", greedy(5))
    assert rid.startswith("req-") and plain.has_work() and plain.state == "Idle"
    assert plain.stats()["queue_depth"] == 1 and plain.stats()["requests_submitted"] == 1
    (event,) = plain.step()
    assert isinstance(event, StepEvent) and event.request_id == rid
    assert len(event.token_ids) == 1 and event.finish_reason is None and event.completion is None
    assert plain.state == "Gated" and plain.stats()["queue_depth"] == 0  # plain: speculation off


def test_events_carry_each_step_and_the_last_one_the_result(plain, tiny):
    rid = plain.add("def g():", greedy(12))
    steps = []
    while plain.has_work():
        steps.append(plain.step())
    events = [e for batch in steps for e in batch]
    assert all(len(batch) <= 1 for batch in steps)  # one event per request per step
    assert {e.request_id for e in events} == {rid}
    assert [e.finish_reason for e in events[:-1]] == [None] * (len(events) - 1)
    last = events[-1]
    assert last.finish_reason == "length" and last.completion is not None
    tokens = [t for e in events for t in e.token_ids]
    assert tokens == last.completion.token_ids == plain_streams(tiny, [("def g():", greedy(12))])[0]
    assert "".join(e.text for e in events) == last.completion.text
    assert last.completion.usage.completion_tokens == 12 and plain.stats()["requests_finished"] == 1
    assert plain.step() == [] and plain.state == "Idle"


def test_a_step_runs_at_most_one_round(tiny):
    """Through preempt, gate, re-arm and drain: each step adds 0 or 1 to the round count."""
    with new_core(tiny, tiny, EngineConfig(num_draft_tokens=3, speculative_width_cap=2)) as core:
        core.add("def f(x):", greedy(40))
        rounds = [0]
        for i in range(10_000):
            if i == 2:
                for j in range(3):
                    core.add(f"x = {j}", greedy(6))
            if i > 2 and not core.has_work():
                break
            core.step()
            rounds.append(core.stats()["rounds"])
        assert {b - a for a, b in zip(rounds, rounds[1:])} <= {0, 1}
        assert set(core.stats()["transitions"]) >= {"Scalar->Batched", "Batched->Gated", "Gated->Batched"}


def test_cancel_a_waiting_request_and_ignore_unknown_ids(plain):
    keep = plain.add("a = 1", greedy(6))
    drop = plain.add("b = 2", greedy(6))
    plain.cancel(drop)
    plain.cancel("req-does-not-exist")
    run, _ = drive(plain)
    assert run.finals[drop].finish_reason == "cancelled" and run.tokens[drop] == []
    assert run.finals[keep].finish_reason == "length" and len(run.tokens[keep]) == 6
    assert plain.stats()["finish_reasons"] == {"cancelled": 1, "length": 1}


def test_cancel_a_live_row_frees_it_at_the_next_step(plain):
    keep = plain.add("a = 1", greedy(30))
    drop = plain.add("b = 2", greedy(1000))
    run = Run()
    for _ in range(3):
        run.see(plain.step())
    assert plain.stats()["width"] == 2
    plain.cancel(drop)
    run.see(plain.step())
    assert run.finals[drop].finish_reason == "cancelled" and plain.stats()["width"] == 1
    drive(plain, run=run)
    assert len(run.tokens[keep]) == 30 and plain.stats()["kv_bytes"] == 0


@pytest.mark.parametrize("prompt, params, param", [
    ("", None, "prompt"),
    ([], None, "prompt"),
    ([1, 2, 10**6], None, "prompt"),
    ([1, True], None, "prompt"),
    ("x", {"max_tokens": 0}, "max_tokens"),
    ("x", {"temperature": -1}, "temperature"),
    ("x", {"top_p": 2}, "top_p"),
    ("x", {"seed": "abc"}, "seed"),
])
def test_bad_input_is_refused_and_nothing_else_changes(plain, prompt, params, param):
    other = plain.add("def ok():", greedy(10))
    plain.step()
    with pytest.raises((InvalidRequest, ValueError, TypeError), match=param):
        plain.add(prompt, params)
    assert plain.stats()["requests_submitted"] == 1 and plain.stats()["queue_depth"] == 0
    run, _ = drive(plain)
    assert list(run.finals) == [other] and len(run.tokens[other]) == 9  # the first came earlier


def test_prompt_over_the_context_names_its_code(plain, tiny):
    with pytest.raises(InvalidRequest) as info:
        plain.add([5] * tiny.context_length)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    near = plain.add([5] * (tiny.context_length - 3), greedy(50))  # the budget shrinks to fit
    run, _ = drive(plain)
    assert run.finals[near].finish_reason == "length" and len(run.tokens[near]) == 3


def test_queue_full_counts_added_and_waiting_requests(tiny):
    with new_core(tiny, None, EngineConfig(speculation=False, max_queue=2)) as core:
        core.add("a", greedy(2)), core.add("b", greedy(2))
        with pytest.raises(QueueFull):
            core.add("c", greedy(2))
        core.step()  # both admitted: the queue has room again
        core.add("c", greedy(2))
        assert core.stats()["requests_submitted"] == 3


def test_a_failing_round_fails_its_rows_and_the_core_steps_on(tiny):
    with new_core(tiny, None, EngineConfig(speculation=False)) as core:
        inject_failure(core, at_call=5)
        run, (victim,) = drive(core, {0: [("def f(x):", greedy(30))]})
        assert run.finals[victim].finish_reason == "error" and "injected" in run.finals[victim].error
        assert core.state == "Idle" and not core.has_work()
        after, (rid,) = drive(core, {0: [("def g(x):", greedy(5))]})
        assert after.finals[rid].finish_reason == "length" and len(after.tokens[rid]) == 5


def test_close_cancels_in_flight_work_and_refuses_more(plain):
    rid = plain.add("def f(x):", greedy(500))
    plain.step()
    events = plain.close()
    assert [e.finish_reason for e in events if e.request_id == rid][-1] == "cancelled"
    assert plain.closed and plain.state == "Idle" and plain.stats()["kv_bytes"] == 0
    with pytest.raises(EngineClosed):
        plain.add("x", greedy(2))
    assert plain.step() == []


def test_close_with_drain_finishes_the_work(tiny):
    core = new_core(tiny, None, EngineConfig(speculation=False))
    rids = [core.add("a = 1", greedy(7)), core.add("b = 2", greedy(4))]
    core.step()
    run = Run()
    run.see(core.close(drain=True))
    assert [run.finals[r].finish_reason for r in rids] == ["length", "length"]
    assert len(run.tokens[rids[0]]) == 6  # the first token came out of the step before close


def test_from_pretrained_takes_the_engines_arguments(model_dir):
    core = from_pretrained(str(model_dir["llama"]), str(model_dir["draft"]), core=True,
                           speculative_width_cap=1, num_draft_tokens=2)
    with core:
        assert core.config.speculative_width_cap == 1 and core.config.num_draft_tokens == 2
        assert core.kernels.drafter is not None
        run, (rid,) = drive(core, {0: [("def f(x):", greedy(6))]})
        assert run.path == ["Scalar", "Idle"] and len(run.tokens[rid]) == 6
    off = from_pretrained(str(model_dir["llama"]), core=True, speculation=False)
    assert off.kernels.drafter is None and off.close() == []


def test_max_model_len_bounds_prompt_and_budget(tiny):
    with new_core(tiny, None, EngineConfig(speculation=False, max_model_len=40)) as core:
        assert core.context_length == 40 < tiny.context_length
        with pytest.raises(InvalidRequest, match="prompt has 40 tokens; --max-model-len is 40") as info:
            core.add([5] * 40)
        assert info.value.code == "context_length_exceeded"
        rid = core.add([5] * 30, greedy(50))  # 10 tokens of room left
        run, _ = drive(core)
        assert len(run.tokens[rid]) == 10 and run.finals[rid].finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(max_model_len=0)


def test_a_row_finishing_in_a_verify_round_reports_that_round(tiny):
    """The completion is taken after the round is recorded: its spec stats include it."""
    config = EngineConfig(num_draft_tokens=3, speculative_width_cap=4, fixed_draft=True)
    with new_core(tiny, tiny, config) as core:
        rids = [core.add("def f(x):", greedy(14)), core.add("x = 1", greedy(14))]
        run, rounds_at_finish = Run(), {}
        while core.has_work():
            before = core.stats()["spec_rounds"]
            events = core.step()
            run.see(events)
            run.states.append(core.state)
            for event in events:
                if event.finish_reason:
                    rounds_at_finish[event.request_id] = (before, core.stats()["spec_rounds"])
        stats = core.stats()
        assert run.path == ["Batched", "Idle"]
        for rid in rids:
            before, after = rounds_at_finish[rid]
            assert after == before + 1  # it finished inside a verify round
            spec = run.finals[rid].completion.spec
            assert spec.rounds == stats["spec_rounds"] and spec.drafted == 3 * stats["spec_rounds"]
        assert sum(run.finals[r].completion.spec.accepted for r in rids) == stats["accepted_tokens"]


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_each_kv_layout_speculates_in_a_batch_equal_to_plain(tiny, layout):
    jobs = [(p, SamplingParams(max_tokens=20, ignore_eos=True, temperature=t, seed=3))
            for p, t in [("def f(x):", 0.0), ("x = 1", 0.8), ("import os", 0.0)]]
    config = EngineConfig(speculative_width_cap=0, num_draft_tokens=3, kv_layout=layout)
    with new_core(tiny, tiny, config) as core:
        run, ids = drive(core, {0: jobs})
        assert core.stats()["spec_rounds"] > 0
    assert [run.tokens[i] for i in ids] == plain_streams(tiny, jobs)
