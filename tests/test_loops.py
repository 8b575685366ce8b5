"""Both speculative loops emit exactly the target's own stream; handoffs lose nothing."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import make_request, run_batch, run_plain, run_scalar

from specbatch.runtime.policy import PLAIN, Decision

from specbatch.kernels.drafters.model import ModelDrafter
from specbatch.kernels.loops.batch import BatchLoop
from specbatch.kernels.loops.scalar import ScalarLoop
from specbatch.kernels.paged_kv import KVLayout
from specbatch.kernels.runner import ModelRunner

PROMPTS = ["def f(x):", "import os\n", "class A:\n    pass\n" * 2, "x = 1", "# c\n" * 6, "return", "while 1:", "y"]


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_scalar_and_batch_equal_plain(tiny, tiny_draft, k):
    budgets = [5 + 3 * i for i in range(8)]
    plain = [run_plain(tiny, p, max_tokens=b, ignore_eos=True) for p, b in zip(PROMPTS, budgets)]
    for p, b, ref in zip(PROMPTS[:3], budgets, plain):
        assert run_scalar(tiny, tiny_draft, p, k=k, max_tokens=b, ignore_eos=True)[0] == ref
    for width in (1, 3, 8):
        for together in (False, True):  # admitted one by one, or in one left-padded prefill
            out, _ = run_batch(tiny, tiny_draft, PROMPTS[:width], k=k, together=together,
                               params=[dict(max_tokens=b, ignore_eos=True) for b in budgets[:width]])
            assert out == plain[:width], (width, together)


@pytest.mark.parametrize("temperature, top_p", [(0.8, 1.0), (1.0, 0.9)])
def test_seeded_sampling_equals_plain(tiny, tiny_draft, temperature, top_p):
    params = [dict(max_tokens=14, temperature=temperature, top_p=top_p, seed=40 + i, ignore_eos=True) for i in range(6)]
    plain = [run_plain(tiny, p, **kw) for p, kw in zip(PROMPTS, params)]
    for drafter in (tiny, tiny_draft):  # a good drafter and a random one
        assert [run_scalar(tiny, drafter, p, **kw)[0] for p, kw in zip(PROMPTS[:3], params)] == plain[:3]
        assert run_batch(tiny, drafter, PROMPTS[:6], params=params)[0] == plain
        assert run_batch(tiny, drafter, PROMPTS[:6], params=params, together=True)[0] == plain


def test_self_draft_oracle_accepts_everything(tiny):
    tokens, rounds = run_scalar(tiny, tiny, "def f(x):", k=4, max_tokens=41, ignore_eos=True)
    accepted = sum(r.accepted[0] for r in rounds)
    drafted = sum(r.drafted for r in rounds)
    assert accepted / drafted >= 0.98
    assert len(tokens) - 1 == sum(len(r.emitted[0]) for r in rounds)  # the first came from prefill
    assert sum(len(r.emitted[0]) for r in rounds) / len(rounds) == pytest.approx(5, abs=0.2)
    _, brounds = run_batch(tiny, tiny, PROMPTS[:4], k=4, params=[dict(max_tokens=30, ignore_eos=True)] * 4)
    acc = sum(sum(r.accepted) for r in brounds) / sum(r.drafted * len(r.accepted) for r in brounds)
    assert acc >= 0.98


def every_third(i: int) -> Decision:
    """A draft round, then two plain ones (what a policy at the break-even may decide)."""
    return PLAIN if i % 3 else Decision(3)


@pytest.mark.parametrize("kv_layout", ["paged", "dense"])
def test_the_oracle_keeps_accepting_after_the_plain_rounds_an_armed_batch_decides(tiny, kv_layout):
    runner = ModelRunner(tiny.model)
    loop = BatchLoop(runner, ModelDrafter(tiny.model), "coupled", KVLayout(kv_layout))
    requests = [make_request(tiny, p, max_tokens=30, ignore_eos=True) for p in PROMPTS[:3]]
    for r in requests:
        loop.admit(r)
    loop.capture_round()
    rounds, i = [], 0
    while loop.width:
        out = loop.spec_round(every_third(i))
        rounds += [out.verify] if out.verify else []
        loop.reap()
        i += 1
    assert [r.tokens for r in requests] == [run_plain(tiny, p, max_tokens=30, ignore_eos=True) for p in PROMPTS[:3]]
    # the drafter took each plain round's token in: it drafts the target's own continuation
    assert len(rounds) >= 3 and sum(sum(r.accepted) for r in rounds) / sum(r.drafted * len(r.accepted) for r in rounds) >= 0.98


def test_the_oracle_keeps_accepting_after_plain_rounds_in_the_scalar_loop(tiny):
    request = make_request(tiny, "def f(x):", max_tokens=40, ignore_eos=True)
    scalar = ScalarLoop(ModelRunner(tiny.model), ModelDrafter(tiny.model, batch=False), request)
    scalar.start()
    rounds, i = [], 0
    while not request.finished:
        i += 0 if scalar.buffered else 1  # a decision reaches only the steps that run a round
        out = scalar.step(every_third(i))
        rounds += [out.verify] if out.verify else []
    assert request.tokens == run_plain(tiny, "def f(x):", max_tokens=40, ignore_eos=True)
    assert len(rounds) >= 3 and sum(r.accepted[0] for r in rounds) / sum(r.drafted for r in rounds) >= 0.98


def test_random_drafter_accepts_almost_nothing(tiny, tiny_draft):
    _, rounds = run_scalar(tiny, tiny_draft, "def f(x):", k=4, max_tokens=40, ignore_eos=True)
    assert sum(r.accepted[0] for r in rounds) / sum(r.drafted for r in rounds) < 0.2


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_close_anywhere_and_rebuild_in_batch(tiny, temperature):
    kw = dict(max_tokens=30, temperature=temperature, seed=5, ignore_eos=True)
    reference, _ = run_scalar(tiny, tiny, "def g(a, b):", k=4, **kw)
    for delivered in range(1, 12):  # every position within the first rounds
        request = make_request(tiny, "def g(a, b):", **kw)
        scalar = ScalarLoop(ModelRunner(tiny.model), ModelDrafter(tiny.model, batch=False), request)
        scalar.start()
        while request.emitted < delivered:
            scalar.step(Decision(4))
        handoff = scalar.close()
        assert handoff.emitted == delivered
        batch = BatchLoop(ModelRunner(tiny.model), ModelDrafter(tiny.model))
        batch.rebuild(handoff)
        held = request.prompt + request.tokens[:-1]  # everything before the pending token
        assert batch.kv.lengths() == [len(held)]
        assert batch.rows[0].pending == request.tokens[-1]
        fresh = tiny.model.make_cache()
        tiny.model(mx.array(held)[None], cache=fresh)
        assert mx.allclose(batch.kv.layers[0].keys[0, :, :len(held)], fresh[0].keys[0, :, :len(held)], atol=1e-4)
        batch.capture_round()
        assert batch.drafter.kv.lengths() == [len(request.prompt) + request.emitted - 2]
        while not request.finished:
            batch.spec_round(Decision(4))
        assert request.tokens == reference, delivered


def test_stops_inside_an_accepted_run(tiny):
    ref = run_plain(tiny, "def f(x):", max_tokens=40, ignore_eos=True)
    stop_at = 9
    out, _ = run_scalar(tiny, tiny, "def f(x):", k=8, max_tokens=40, stop_token_ids=[ref[stop_at]], ignore_eos=True)
    assert out == ref[:ref.index(ref[stop_at]) + 1]
    outs, _ = run_batch(tiny, tiny, ["def f(x):", "x = 1"], k=8,
                        params=[dict(max_tokens=40, stop_token_ids=[ref[stop_at]], ignore_eos=True),
                                dict(max_tokens=40, ignore_eos=True)])
    assert outs[0] == ref[:ref.index(ref[stop_at]) + 1] and len(outs[1]) == 40
    text = tiny.tokenizer.decode(ref)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    # stop strings are the core's (output.Delivery): through the scalar loop and the batch
    from helpers import drive

    from specbatch import SamplingParams
    from specbatch.kernels.build import new_core
    from specbatch.runtime.config import EngineConfig
    params = SamplingParams(seed=0, max_tokens=40, stop=[stop], ignore_eos=True)
    for burst in (1, 2):
        with new_core(tiny, tiny, EngineConfig(num_draft_tokens=8, speculative_width_cap=4)) as core:
            run, ids = drive(core, {0: [("def f(x):", params)] * burst})
        assert run.path == (["Scalar", "Idle"] if burst == 1 else ["Batched", "Idle"])
        for rid in ids:
            final = run.finals[rid]
            assert final.finish_reason == "stop" and stop not in run.text[rid], burst
            assert text.startswith(run.text[rid]) and final.completion.text == run.text[rid]
            assert run.tokens[rid] == final.completion.token_ids == ref[:len(run.tokens[rid])]


def test_budget_edges(tiny):
    assert len(run_scalar(tiny, tiny, "x", k=8, max_tokens=1)[0]) == 1
    assert len(run_scalar(tiny, tiny, "x", k=8, max_tokens=3, ignore_eos=True)[0]) == 3
    near = [7] * (tiny.context_length - 4)
    out, _ = run_scalar(tiny, tiny, near, k=8, max_tokens=4, ignore_eos=True)
    assert out == run_plain(tiny, near, max_tokens=4, ignore_eos=True)


def test_capture_round_emits_one_token_per_row_at_plain_cost(tiny):
    loop = BatchLoop(ModelRunner(tiny.model), ModelDrafter(tiny.model))
    requests = [make_request(tiny, p, max_tokens=20, ignore_eos=True) for p in PROMPTS[:3]]
    for r in requests:
        loop.admit(r)
    shapes = []
    real = loop.target.forward
    loop.target.forward = lambda tokens, cache: (shapes.append(tokens.shape), real(tokens, cache))[1]
    before = [r.emitted for r in requests]
    out = loop.capture_round()
    assert [len(row.tokens) for row in out.rows.values()] == [1, 1, 1] and out.round and [r.emitted for r in requests] == [b + 1 for b in before]
    assert shapes == [(3, 1)]  # one plain one-position forward of the batch: plain-decode cost
    assert loop.armed and loop.drafter.width == 3


@pytest.mark.parametrize("drafter_kind", ["model", "self"])
def test_a_burst_joins_an_armed_batch_in_one_prefill(tiny, tiny_draft, drafter_kind):
    """Rows prefilled together (left-padded, ragged starts) join an armed loop and its
    drafter; every stream still equals plain decoding."""
    from helpers import make_request

    from specbatch.kernels.build import make_drafter
    drafter = tiny_draft if drafter_kind == "model" else tiny
    params = dict(max_tokens=12, ignore_eos=True)
    plain = [run_plain(tiny, p, **params) for p in PROMPTS[:6]]
    runner = ModelRunner(tiny.model)
    loop = BatchLoop(runner, make_drafter(drafter, runner, True))
    first = [make_request(tiny, p, **params) for p in PROMPTS[:2]]
    loop.admit_many(first)
    loop.capture_round()
    loop.spec_round(Decision(3))
    later = [make_request(tiny, p, **params) for p in PROMPTS[2:6]]
    loop.admit_many(later)
    assert loop.drafter.width == loop.width == 6
    while loop.width:
        loop.spec_round(Decision(3))
        loop.reap()
    assert [r.tokens for r in first + later] == plain




def test_a_speculative_round_after_plain_rounds_drafts_from_the_sequence_as_it_is(tiny):
    # the policy may decide plain for some rounds: the drafter (the target drafting for itself,
    # so every draft is right) must still draft from the current sequence afterwards (a head
    # drafter is handed the new hidden state after each plain round: it drafted from a stale one)
    request = make_request(tiny, "def g(a, b):", max_tokens=30, temperature=0.0, ignore_eos=True)
    scalar = ScalarLoop(ModelRunner(tiny.model), ModelDrafter(tiny.model, batch=False), request)
    scalar.start()
    for _ in range(5):
        scalar.step(PLAIN)
    rounds = []
    while request.emitted < 20:
        out = scalar.step(Decision(3))
        if out.verify is not None:
            rounds.append(out.verify)
    assert rounds and all(r.accepted[0] == r.drafted for r in rounds)
