"""The state machine through the engine core, step by step: transitions, switches,
guarantees, the chart.

No thread and no timing: each scenario adds requests before chosen steps and asserts the
state and the transition counts that the steps lead to, so a scenario reaches the same
edges on any machine. Every stream is checked against the same request decoded alone
with speculation off.
"""

from __future__ import annotations

import pytest
from helpers import Run, drive, plain_streams

from specbatch import EngineCore, SamplingParams
from specbatch.kernels.pair import load_pair
from specbatch.runtime.config import EngineConfig, check_cap
from specbatch.runtime.machine import STATES, TRANSITIONS
from specbatch.tools.statechart import CHART, render
from specbatch.kernels.build import new_core

EDGES = {f"{s}->{d}" for _, src, d, *_ in TRANSITIONS for s in (src if isinstance(src, list) else [src])}
LONG = "def f(x):"


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def spec_core(tiny, **config) -> EngineCore:
    """The tiny model drafting for itself: acceptance is high, so every edge is cheap. Plain
    rounds pipelined, whatever the machine's cores (the scenarios count their rounds)."""
    return new_core(tiny, tiny, EngineConfig(num_draft_tokens=3, **{"pipeline": True, **config}))


def step(core: EngineCore, run: Run) -> str:
    run.see(core.step())
    run.states.append(core.state)
    return core.state


def transitions(core: EngineCore) -> dict:
    return core.stats()["transitions"]


def width(core: EngineCore) -> int:
    return core.stats()["width"]


def assert_released(core: EngineCore) -> None:
    stats = core.stats()
    assert core.state == "Idle" and not core.has_work()
    assert stats["width"] == 0 and stats["kv_bytes"] == 0 and stats["drafter_kv_bytes"] == 0
    assert set(stats["transitions"]) <= EDGES


def streams(run: Run, ids: list[str]) -> list[list[int]]:
    assert all(rid in run.finals for rid in ids), "every request finishes"
    return [run.tokens[rid] for rid in ids]


def test_preempt_gate_rearm_drain(tiny):
    """A lone request goes scalar; waiters preempt it; five rows gate over the cap of 2;
    the batch re-arms at the first gated round back within the cap; the last row drains."""
    jobs = [(LONG, SamplingParams(max_tokens=120, temperature=0.8, seed=1, ignore_eos=True))]
    jobs += [(f"x = {i}", greedy(6 + 2 * i)) for i in range(4)]
    with spec_core(tiny, speculative_width_cap=2, rearm_min_remaining=4) as core:
        run = Run()
        ids = [core.add(*jobs[0])]
        assert core.state == "Idle" and core.has_work()
        assert step(core, run) == "Scalar" and transitions(core) == {"Idle->Scalar": 1}
        assert len(run.tokens[ids[0]]) == 1  # the prefill's first token
        assert step(core, run) == "Scalar" and len(run.tokens[ids[0]]) == 2  # one token a step
        ids += [core.add(*job) for job in jobs[1:]]
        assert step(core, run) == "Batched" and width(core) == 1  # preempt; waiters not in yet
        assert transitions(core) == {"Idle->Scalar": 1, "Scalar->Batched": 1}
        assert step(core, run) == "Gated" and width(core) == 1  # 1 + 4 is over the cap: gate first
        assert step(core, run) == "Gated" and width(core) == 5  # then admit, plain
        gated_widths = []
        while step(core, run) == "Gated":
            gated_widths.append(width(core))
        assert transitions(core)["Gated->Batched"] == 1 and width(core) <= 2
        assert min(gated_widths, default=5) > 2  # re-armed at the first round within the cap
        assert "Batched->Batched" not in transitions(core)  # re-arm settles; the capture is next
        assert step(core, run) == "Batched" and transitions(core)["Batched->Batched"] == 1
        drive(core, run=run)
        assert run.path == ["Scalar", "Batched", "Gated", "Batched", "Idle"]
        assert transitions(core) == {"Idle->Scalar": 1, "Scalar->Batched": 1, "Batched->Gated": 1,
                                     "Gated->Batched": 1, "Batched->Batched": 1, "Batched->Idle": 1}
        assert max(core.stats()["spec_widths"]) <= 2  # never speculates over the cap
        assert_released(core)
        assert run.finals[ids[0]].finish_reason == "length"
        assert streams(run, ids) == plain_streams(tiny, jobs)
        # the next request starts scalar again
        again, _ = drive(core, {0: [("y = 2", greedy(5))]})
        assert again.path == ["Scalar", "Idle"] and transitions(core)["Idle->Scalar"] == 2


def test_every_edge_of_the_table_is_reachable(tiny):
    """The edges the scenario above does not take, one scenario each."""
    taken = set()
    scenarios = [
        (dict(speculative_width_cap=2), {0: [("x = 1", greedy(4))]}, ["Scalar", "Idle"]),
        (dict(speculative_width_cap=2), {0: [("x = 1", greedy(4)), ("y = 2", greedy(6))]},
         ["Batched", "Idle"]),  # a burst within the cap at idle: straight to the batch
        (dict(speculative_width_cap=2), {0: [(f"x = {i}", greedy(4)) for i in range(3)]},
         ["Gated", "Idle"]),  # a burst over the cap: plain from the start
        (dict(speculation=False), {0: [("x = 1", greedy(4))]}, ["Gated", "Idle"]),
    ]
    for config, arrivals, path in scenarios:
        with spec_core(tiny, **config) as core:
            run, ids = drive(core, arrivals)
            assert run.path == path, (config, run.states)
            assert_released(core)
            taken |= set(transitions(core))
            jobs = [job for i in sorted(arrivals) for job in arrivals[i]]
            assert streams(run, ids) == plain_streams(tiny, jobs)
    assert taken | {"Scalar->Batched", "Batched->Gated", "Gated->Batched"} == EDGES


def test_preempt_switch_off_makes_arrivals_wait(tiny, monkeypatch):
    monkeypatch.setenv("GMLX_MTP_PREEMPT", "0")
    with spec_core(tiny, speculative_width_cap=4) as core:
        assert not core.config.preempt
        run = Run()
        first = core.add(LONG, greedy(60))
        step(core, run)
        second = core.add("x = 1", greedy(5))
        while first not in run.finals:
            assert step(core, run) == "Scalar" and second not in run.tokens  # it waits
        assert step(core, run) == "Idle" and core.has_work()  # the scalar loop ends; then the waiter
        assert step(core, run) == "Scalar" and len(run.tokens[second]) == 1
        drive(core, run=run)
        assert transitions(core) == {"Idle->Scalar": 2, "Scalar->Idle": 2}
        assert streams(run, [first, second]) == plain_streams(tiny, [(LONG, greedy(60)), ("x = 1", greedy(5))])


def test_resume_switch_off_keeps_a_gated_batch_plain(tiny, monkeypatch):
    monkeypatch.setenv("SPECBATCH_RESUME", "0")
    jobs = [(LONG, greedy(80))] + [(f"x = {i}", greedy(4)) for i in range(3)]
    with spec_core(tiny, speculative_width_cap=2) as core:
        run, ids = drive(core, {0: jobs[:1], 1: jobs[1:]})
        assert run.path == ["Scalar", "Batched", "Gated", "Idle"]
        assert transitions(core) == {"Idle->Scalar": 1, "Scalar->Batched": 1, "Batched->Gated": 1,
                                     "Gated->Idle": 1}
        assert_released(core)
    assert streams(run, ids) == plain_streams(tiny, jobs)


def test_preempted_request_keeps_batch_semantics_and_does_not_retire(tiny):
    with spec_core(tiny, speculative_width_cap=4) as core:
        run = Run()
        first = core.add(LONG, greedy(60))
        step(core, run)
        second = core.add("x = 1", greedy(3))
        assert step(core, run) == "Batched"  # preempt
        (request,) = [r for r in core.scheduler.requests() if r.id == first]
        assert not request.retire  # its prefix is not offered back to the prompt cache
        while second not in run.finals:
            assert step(core, run) == "Batched"
        drive(core, run=run)
        # after the batch drained to one row it stayed in the batch loop: one Idle->Scalar only
        assert run.path == ["Scalar", "Batched", "Idle"]
        assert transitions(core) == {"Idle->Scalar": 1, "Scalar->Batched": 1, "Batched->Batched": 1,
                                     "Batched->Idle": 1}  # preempt, then the capture round arms it
        assert_released(core)


def rearm_step(tiny, patience: int, jobs) -> tuple[int | None, dict]:
    """The step at which the batch re-armed (None: never), and the transitions."""
    config = dict(speculative_width_cap=2, rearm_patience=patience)
    with spec_core(tiny, **config) as core:
        run, _ = drive(core, {0: jobs[:1], 1: jobs[1:]})
        back = [i for i in range(1, len(run.states))
                if (run.states[i - 1], run.states[i]) == ("Gated", "Batched")]
        return (back[0] if back else None), transitions(core)


def test_rearm_patience_delays_rearming(tiny):
    """Patience p re-arms on the p-th gated round in a row within the cap (the first calm
    round counts as one): 0 and 1 re-arm at once, 3 two rounds later, a huge one never."""
    jobs = [(LONG, greedy(60))] + [(f"x = {i}", greedy(3)) for i in range(3)]
    at = {p: rearm_step(tiny, p, jobs) for p in (0, 1, 3, 10**6)}
    assert at[0][0] is not None and at[1][0] == at[0][0] and at[3][0] == at[0][0] + 2
    assert at[10**6][0] is None and "Gated->Batched" not in at[10**6][1]
    assert at[10**6][1]["Gated->Idle"] == 1 and at[0][1]["Batched->Idle"] == 1


def test_hot_requests_decode_plain_where_speculation_does_not_pay(tiny):
    """max_spec_temperature: a hot lone request starts plain, a hot arrival gates an armed
    batch, and nothing re-arms while a hot row lives; the streams are plain decoding's."""
    hot = SamplingParams(max_tokens=30, temperature=0.9, seed=3, ignore_eos=True)
    cold = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    with spec_core(tiny, speculative_width_cap=4, rearm_min_remaining=2, max_spec_temperature=0.5) as core:
        lone, (rid,) = drive(core, {0: [("x = 1", hot)]})
        assert lone.path == ["Gated", "Idle"] and lone.finals[rid].completion.spec.drafted == 0
        assert transitions(core) == {"Idle->Gated": 1, "Gated->Idle": 1}
        run = Run()
        first = core.add(LONG, cold)
        assert step(core, run) == "Scalar"
        second = core.add("y = 2", hot)
        assert step(core, run) == "Batched" and step(core, run) == "Gated"  # preempt, then gate
        while second not in run.finals:
            assert step(core, run) == "Gated"  # no re-arm while the hot row lives
        drive(core, run=run)
        assert run.path == ["Scalar", "Batched", "Gated", "Batched", "Idle"]  # re-armed after it left
        assert transitions(core) == {"Idle->Gated": 1, "Gated->Idle": 1, "Idle->Scalar": 1,
                                     "Scalar->Batched": 1, "Batched->Gated": 1, "Gated->Batched": 1,
                                     "Batched->Batched": 1, "Batched->Idle": 1}
        assert run.finals[second].completion.spec.drafted == 0  # never in a verify round
        assert_released(core)
    jobs = [(LONG, cold), ("y = 2", hot)]
    assert streams(run, [first, second]) == plain_streams(tiny, jobs)
    assert lone.tokens[rid] == plain_streams(tiny, [("x = 1", hot)])[0]


def test_cancel_while_scalar_ends_the_scalar_loop(tiny):
    with spec_core(tiny, speculative_width_cap=2) as core:
        run = Run()
        rid = core.add(LONG, greedy(40))
        assert step(core, run) == "Scalar"
        core.cancel(rid)
        assert step(core, run) == "Idle" and run.finals[rid].finish_reason == "cancelled"
        assert run.tokens[rid] == plain_streams(tiny, [(LONG, greedy(40))])[0][:1]
        assert transitions(core) == {"Idle->Scalar": 1, "Scalar->Idle": 1}
        assert_released(core)


def test_cancels_land_at_the_next_step_in_every_state(tiny):
    """A waiter, a gated row and an armed row cancelled; the others' streams are untouched."""
    jobs = [(LONG, greedy(40))] + [(f"x = {i}", greedy(20)) for i in range(3)]
    with spec_core(tiny, speculative_width_cap=2) as core:
        run = Run()
        ids = [core.add(*jobs[0])]
        step(core, run), step(core, run)
        ids += [core.add(*job) for job in jobs[1:]]
        assert step(core, run) == "Batched"  # preempt: three waiters queued
        core.cancel(ids[1])
        assert step(core, run) == "Gated"  # 1 + 2 waiters still over the cap
        assert run.finals[ids[1]].finish_reason == "cancelled" and run.tokens[ids[1]] == []  # never started
        assert step(core, run) == "Gated" and width(core) == 3
        core.cancel(ids[2])
        assert step(core, run) == "Batched" and ids[2] in run.finals  # reaped: back within the
        assert width(core) == 2 and transitions(core)["Gated->Batched"] == 1  # cap, re-armed at once
        core.cancel(ids[0])
        assert step(core, run) == "Batched" and run.finals[ids[0]].finish_reason == "cancelled"
        assert width(core) == 1
        drive(core, run=run)
        assert [run.finals[r].finish_reason for r in ids] == ["cancelled", "cancelled", "cancelled", "length"]
        assert run.path == ["Scalar", "Batched", "Gated", "Batched", "Idle"]
        assert_released(core)
    for rid, full in zip(ids, plain_streams(tiny, jobs)):
        got = run.tokens.get(rid, [])
        assert got == full[:len(got)] and (run.finals[rid].finish_reason == "cancelled" or got == full)


@pytest.mark.parametrize("bad", [-1, "x", 1.5, True])
def test_invalid_caps_are_refused(bad):
    with pytest.raises(ValueError, match="speculative_width_cap"):
        check_cap(bad)


def test_env_cap_beats_config(model_dir, monkeypatch):
    monkeypatch.setenv("SPECBATCH_WIDTH_CAP", "5")
    _, _, config = load_pair(str(model_dir["llama"]), str(model_dir["llama"]), speculative_width_cap=1)
    assert config.speculative_width_cap == 5
    monkeypatch.setenv("SPECBATCH_WIDTH_CAP", "-2")
    with pytest.raises(ValueError):
        load_pair(str(model_dir["llama"]), str(model_dir["llama"]))


def test_cap_is_inclusive_and_zero_uncaps():
    assert EngineConfig(speculative_width_cap=2).policy().within_cap(2)
    assert not EngineConfig(speculative_width_cap=2).policy().within_cap(3)
    assert EngineConfig(speculative_width_cap=0).policy().within_cap(1000)
    assert not EngineConfig(speculation=False).policy().within_cap(1)


def test_chart_matches_the_machine():
    assert CHART.exists(), "run `specbatch statechart --write`"
    assert CHART.read_text() == render()
    for state in STATES:
        assert f'state "{state}"' in CHART.read_text()


def test_trace_draws_the_path_a_run_took(tmp_path):
    import json

    from specbatch.tools.statechart import trace
    log = tmp_path / "run.jsonl"
    events = [{"event": "transition", "source": "Idle", "dest": "Scalar", "trigger": "start_scalar"},
              {"event": "admit", "request": "req-1"},
              {"event": "transition", "source": "Scalar", "dest": "Batched", "trigger": "preempt"},
              {"event": "transition", "source": "Batched", "dest": "Idle", "trigger": "finish"}]
    log.write_text("\n".join(json.dumps(e) for e in events) + "\nnot json\n")
    chart = trace(log)
    assert "Scalar --> Batched: preempt x1" in chart
    assert "%% not taken: Batched -> Gated (gate)" in chart


def test_chart_tool_runs_without_mlx():
    """The machine and its chart import no kernel: `statechart --check` needs no MLX."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; from specbatch.serving.cli import build_parser; "
            "args = build_parser().parse_args(['statechart', '--check']); rc = args.func(args); "
            "loaded = [m for m in sys.modules if m.startswith('mlx')]; "
            "assert not loaded, loaded; sys.exit(rc)")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root / "src")})
    assert done.returncode == 0, done.stderr
    assert "matches the machine" in done.stdout


def test_the_chart_draws_the_capture_round_and_each_states_order():
    from specbatch.runtime.machine import ROUNDS
    chart = CHART.read_text()
    assert "Batched --> Batched: capture [unarmed]" in chart
    assert "Gated --> Batched: rearm [rearm_pays]" in chart
    assert "%% Gated: inject > count_calm > finish? > rearm? > prefill > plain_round > reap" in chart
    # injection comes before a pending re-arm or capture: arrivals gate first
    assert ROUNDS["Gated"].index("inject") < ROUNDS["Gated"].index("rearm")
    assert ROUNDS["Batched"].index("gate") < ROUNDS["Batched"].index("capture")


@pytest.mark.parametrize(("pipeline", "spare", "ahead"),
                         [(None, True, True), (None, False, False), (True, False, True), (False, True, False)])
def test_plain_rounds_dispatch_a_successor_only_where_the_host_has_a_core(tiny, pipeline, spare, ahead):
    """Left unset, a plain round dispatches the next one before reading its own tokens only where
    the kernels leave the host a core (on two busy cores that build slowed the compute); set, the
    config decides. Either way the streams are the plain ones."""
    with new_core(tiny, None, EngineConfig(speculation=False, pipeline=pipeline)) as core:
        core.kernels.spare_core = spare
        run = Run()
        ids = [core.add(LONG, greedy(12)), core.add("def g(y):", greedy(12))]
        for _ in range(3):
            step(core, run)
        assert core.scheduler.batch.width == 2 and core.scheduler.batch.settled is not ahead
        run, _ = drive(core, run=run)
        assert [len(run.tokens[i]) for i in ids] == [12, 12]
        assert [run.tokens[i] for i in ids] == plain_streams(tiny, [(LONG, greedy(12)), ("def g(y):", greedy(12))])


def test_a_spare_core_is_one_the_kernel_threads_leave(monkeypatch):
    """On the CPU the host has a core of its own only where the kernels' threads number fewer than
    the process's cores; with the kernels off, MLX's ops and the BLAS take every core."""
    import mlx.core as mx

    from specbatch.kernels import build

    if mx.default_device().type != mx.DeviceType.cpu:
        pytest.skip("a GPU computes here: the host always has its cores")

    class Ext:
        def __init__(self, n):
            self.n = n

        def threads(self):
            return self.n

    monkeypatch.setattr(build.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    for ext, spare in ((Ext(4), False), (Ext(3), True), (None, False)):
        monkeypatch.setattr(build.cpu, "extension", lambda ext=ext: ext)
        assert build.spare_core() is spare
