"""The state machine through the engine: transitions, switches, guarantees, the chart."""

from __future__ import annotations

import time

import pytest

from specbatch import Engine, SamplingParams
from specbatch.config import EngineConfig, check_cap, load_pair
from specbatch.machine import STATES, TRANSITIONS
from specbatch.statechart import CHART, render

EDGES = {f"{s}->{d}" for _, src, d, *_ in TRANSITIONS for s in (src if isinstance(src, list) else [src])}


def reference(engine_plain, jobs):
    return [engine_plain.submit(p, sp).result(120).token_ids for p, sp in jobs]


@pytest.fixture
def plain(tiny):
    with Engine(tiny, None, EngineConfig(speculation=False)) as engine:
        yield engine


def wait_idle(engine, timeout=30):
    deadline = time.time() + timeout
    while engine.stats()["state"] != "Idle" and time.time() < deadline:
        time.sleep(0.005)
    return engine.stats()


def staged_run(engine, jobs, first_gap=0.05):
    """One long request alone, then the rest arrive while it decodes."""
    handles = [engine.submit(*jobs[0])]
    next(iter(handles[0]))
    time.sleep(first_gap)
    handles += [engine.submit(p, sp) for p, sp in jobs[1:]]
    return [h.result(120) for h in handles]


def test_a_run_through_every_transition(tiny, plain):
    jobs = [("def f(x):", SamplingParams(max_tokens=120, temperature=0.8, seed=1, ignore_eos=True))]
    jobs += [(f"x = {i}", SamplingParams(max_tokens=6 + 2 * i, temperature=0.0, ignore_eos=True)) for i in range(4)]
    ref = reference(plain, jobs)
    with Engine(tiny, tiny, EngineConfig(num_draft_tokens=3, speculative_width_cap=2, rearm_min_remaining=4)) as spec:
        out = staged_run(spec, jobs)
        stats = wait_idle(spec)
        assert [o.token_ids for o in out] == ref
        assert out[0].finish_reason == "length"
        t = stats["transitions"]
        for edge in ("Idle->Scalar", "Scalar->Batched", "Batched->Gated", "Gated->Batched"):
            assert t.get(edge, 0) >= 1, (edge, t)
        assert set(t) <= EDGES
        assert max(stats["spec_widths"]) <= 2  # never speculates over the cap
        assert stats["width"] == 0 and stats["kv_bytes"] == 0 and stats["drafter_kv_bytes"] == 0
        # the next request starts scalar again
        before = t.get("Idle->Scalar", 0)
        spec.submit("y = 2", SamplingParams(max_tokens=5)).result(30)
        assert wait_idle(spec)["transitions"]["Idle->Scalar"] == before + 1


def test_preempt_switch_off_makes_arrivals_wait(tiny, monkeypatch):
    monkeypatch.setenv("GMLX_MTP_PREEMPT", "0")
    config = EngineConfig(num_draft_tokens=3, speculative_width_cap=4)
    assert not config.preempt
    with Engine(tiny, tiny, config) as spec:
        jobs = [("def f(x):", SamplingParams(max_tokens=60, ignore_eos=True)),
                ("x = 1", SamplingParams(max_tokens=5, ignore_eos=True))]
        first, second = staged_run(spec, jobs)
        stats = wait_idle(spec)
        assert "Scalar->Batched" not in stats["transitions"]
        assert stats["transitions"]["Idle->Scalar"] == 2


def test_resume_switch_off_keeps_a_gated_batch_plain(tiny, plain, monkeypatch):
    monkeypatch.setenv("SPECBATCH_RESUME", "0")
    jobs = [("def f(x):", SamplingParams(max_tokens=80, ignore_eos=True))]
    jobs += [(f"x = {i}", SamplingParams(max_tokens=4, ignore_eos=True)) for i in range(3)]
    with Engine(tiny, tiny, EngineConfig(num_draft_tokens=3, speculative_width_cap=2)) as spec:
        out = staged_run(spec, jobs)
        stats = wait_idle(spec)
    assert [o.token_ids for o in out] == reference(plain, jobs)
    assert "Batched->Gated" in stats["transitions"] and "Gated->Batched" not in stats["transitions"]


def test_preempted_request_keeps_batch_semantics_and_does_not_retire(tiny):
    with Engine(tiny, tiny, EngineConfig(num_draft_tokens=3, speculative_width_cap=4)) as spec:
        first = spec.submit("def f(x):", SamplingParams(max_tokens=60, ignore_eos=True))
        next(iter(first))
        spec.submit("x = 1", SamplingParams(max_tokens=3, ignore_eos=True)).result(30)
        request = next(r for r in spec.scheduler.requests() if r.id == first.request_id)
        assert not request.retire
        first.result(30)
        stats = wait_idle(spec)
        # after the batch drained to one row it stayed in the batch loop: one Idle->Scalar only
        assert stats["transitions"]["Idle->Scalar"] == 1
        assert stats["transitions"].get("Batched->Idle", 0) + stats["transitions"].get("Gated->Idle", 0) == 1


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
    assert EngineConfig(speculative_width_cap=2).speculates_at(2)
    assert not EngineConfig(speculative_width_cap=2).speculates_at(3)
    assert EngineConfig(speculative_width_cap=0).speculates_at(1000)
    assert not EngineConfig(speculation=False).speculates_at(1)


def test_chart_matches_the_machine():
    assert CHART.exists(), "run `specbatch statechart --write`"
    assert CHART.read_text() == render()
    for state in STATES:
        assert f'state "{state}"' in CHART.read_text()


def test_trace_draws_the_path_a_run_took(tmp_path):
    import json

    from specbatch.statechart import trace
    log = tmp_path / "run.jsonl"
    events = [{"event": "transition", "source": "Idle", "dest": "Scalar", "trigger": "start_scalar"},
              {"event": "admit", "request": "req-1"},
              {"event": "transition", "source": "Scalar", "dest": "Batched", "trigger": "preempt"},
              {"event": "transition", "source": "Batched", "dest": "Idle", "trigger": "drain"}]
    log.write_text("\n".join(json.dumps(e) for e in events) + "\nnot json\n")
    chart = trace(log)
    assert "Scalar --> Batched: preempt x1" in chart
    assert "%% not taken: Batched -> Gated (gate)" in chart


def test_rearm_patience_delays_rearming(tiny):
    jobs = [("def f(x):", SamplingParams(max_tokens=60, ignore_eos=True))]
    jobs += [(f"x = {i}", SamplingParams(max_tokens=3, ignore_eos=True)) for i in range(3)]
    counts = {}
    for patience in (0, 10**6):
        config = EngineConfig(num_draft_tokens=3, speculative_width_cap=2, rearm_patience=patience)
        with Engine(tiny, tiny, config) as spec:
            staged_run(spec, jobs)
            counts[patience] = wait_idle(spec)["transitions"].get("Gated->Batched", 0)
    assert counts[0] >= 1 and counts[10**6] == 0


def test_hot_requests_decode_plain_where_speculation_does_not_pay(tiny, plain):
    """max_spec_temperature: a hot lone request starts plain, a hot arrival gates an armed
    batch, and nothing re-arms while a hot row lives; the streams are plain decoding's."""
    hot = SamplingParams(max_tokens=30, temperature=0.9, seed=3, ignore_eos=True)
    cold = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    config = EngineConfig(num_draft_tokens=3, speculative_width_cap=4, rearm_min_remaining=2,
                          max_spec_temperature=0.5)
    with Engine(tiny, tiny, config) as spec:
        assert spec.submit("x = 1", hot).result(60).spec.drafted == 0
        assert wait_idle(spec)["transitions"] == {"Idle->Gated": 1, "Gated->Idle": 1}
        out = staged_run(spec, [("def f(x):", cold), ("y = 2", hot)])
        t = wait_idle(spec)["transitions"]
        assert t["Idle->Scalar"] == 1 and t["Scalar->Batched"] == 1 and t["Batched->Gated"] == 1, t
        assert out[1].spec.drafted == 0  # the hot row never took part in a verify round
    assert [o.token_ids for o in out] == reference(plain, [("def f(x):", cold), ("y = 2", hot)])
