"""Logprobs: the target's raw distribution at each emitted position, whatever the loop.

Speculation on (scalar, batched, through a preempt) equals speculation off within 1e-4,
and the sampled token's value equals log_softmax of one plain forward at its position.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import drive, make_request

from specbatch.runtime.policy import Decision

from specbatch.kernels.drafters.model import ModelDrafter
from specbatch.kernels.loops.batch import BatchLoop
from specbatch.kernels.loops.scalar import ScalarLoop
from specbatch.kernels.runner import ModelRunner
from specbatch.runtime.config import EngineConfig
from specbatch.runtime.params import SamplingParams
from specbatch.kernels.build import new_core

TOL = 1e-4
PROMPTS = ["def f(x):", "import os\n", "class A:", "x = [1, 2"]
MODES = [dict(temperature=0.0), dict(temperature=0.8, seed=11), dict(temperature=0.9, top_p=0.9, seed=3)]


def max_diff(a, b) -> float:
    """Max |difference| of two logprob streams, asserting same tokens and same top ids."""
    assert [x.token for x in a] == [y.token for y in b]
    worst = 0.0
    for x, y in zip(a, b):
        assert [i for i, _ in x.top] == [i for i, _ in y.top]
        worst = max([worst, abs(x.logprob - y.logprob)] + [abs(p - q) for (_, p), (_, q) in zip(x.top, y.top)])
    return worst


def completions(target, drafter, config, jobs, at=None) -> list:
    """Each job's Completion; ``at``: the step each job arrives at (default all at once)."""
    arrivals: dict = {}
    for i, job in enumerate(jobs):
        arrivals.setdefault(at[i] if at else 0, []).append(job)
    with new_core(target, drafter, config) as core:
        run, ids = drive(core, arrivals)
    return [run.finals[rid].completion for rid in ids]


@pytest.mark.parametrize("mode", MODES)
def test_speculation_on_equals_off(tiny, mode):
    jobs = [(p, SamplingParams(max_tokens=24, ignore_eos=True, logprobs=5, **mode)) for p in PROMPTS]
    off = [completions(tiny, None, EngineConfig(speculation=False), [job])[0] for job in jobs]
    spec = EngineConfig(num_draft_tokens=3, speculative_width_cap=4, rearm_min_remaining=4)
    alone = [completions(tiny, tiny, spec, [job])[0] for job in jobs]  # scalar: a self-draft accepts runs
    batched = completions(tiny, tiny, spec, jobs)  # one burst: the batch loop, armed, self-drafting
    staggered = completions(tiny, tiny, spec, jobs, at=[0, 3, 5, 9])  # arrivals preempt the scalar loop
    worst = 0.0
    for i, ref in enumerate(off):
        assert len(ref.logprobs) == len(ref.token_ids) == 24
        for got in (alone[i], batched[i], staggered[i]):
            worst = max(worst, max_diff(got.logprobs, ref.logprobs))
    assert worst < TOL
    assert sum(c.spec.accepted for c in alone) > 0  # speculation really ran


def _events(out, request) -> list:
    row = out.rows.get(request.id)
    return list(row.logprobs) if row else []


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_through_a_preempt_equals_plain(tiny, temperature):
    kw = dict(max_tokens=20, temperature=temperature, seed=5, ignore_eos=True, logprobs=3)
    ref_req = make_request(tiny, "def g(a, b):", **kw)
    plain = BatchLoop(ModelRunner(tiny.model))
    ref = _events(plain.admit(ref_req), ref_req)
    while not ref_req.finished:
        ref += _events(plain.plain_round(), ref_req)
    ref += _events(plain.settle(), ref_req)
    for delivered in (1, 3, 6):
        request = make_request(tiny, "def g(a, b):", **kw)
        scalar = ScalarLoop(ModelRunner(tiny.model), ModelDrafter(tiny.model, batch=False), request)
        got = _events(scalar.start(), request)
        while request.emitted < delivered:
            got += _events(scalar.step(Decision(4)), request)
        batch = BatchLoop(ModelRunner(tiny.model), ModelDrafter(tiny.model))
        got += _events(batch.rebuild(scalar.close()), request)
        got += _events(batch.capture_round(), request)
        while not request.finished:
            got += _events(batch.spec_round(Decision(4)), request)
        assert max_diff(got, ref) < TOL, delivered


@pytest.mark.parametrize("verify", ["coupled", "rejection"])
def test_values_are_the_plain_forward_log_softmax(tiny, tiny_draft, verify):
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.7, seed=2, logprobs=4)
    spec = EngineConfig(num_draft_tokens=3, verify=verify)  # rejection: accepted drafts are scored by the target too
    [done] = completions(tiny, tiny_draft, spec, [("def f(x):", params)])
    prompt = list(tiny.tokenizer.encode("def f(x):"))
    logits = tiny.model(mx.array(prompt + done.token_ids[:-1])[None]).astype(mx.float32)[0]  # [L, V]
    lsm = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    rows = lsm[len(prompt) - 1:].tolist()  # the distribution that sampled token i
    for i, lp in enumerate(done.logprobs):
        assert lp.token == done.token_ids[i]
        assert abs(lp.logprob - rows[i][lp.token]) < TOL
        values = [v for _, v in lp.top]
        assert len(lp.top) == 4 and values == sorted(values, reverse=True)
        argmax = max(range(len(rows[i])), key=rows[i].__getitem__)
        assert lp.top[0][0] == argmax and abs(lp.top[0][1] - rows[i][argmax]) < TOL


def test_rows_that_did_not_ask_get_none(tiny, tiny_draft):
    jobs = [("def f(x):", SamplingParams(max_tokens=8, logprobs=0, seed=1)),
            ("class A:", SamplingParams(max_tokens=8, seed=1))]
    asked, quiet = completions(tiny, tiny_draft, EngineConfig(num_draft_tokens=3), jobs)
    assert quiet.logprobs is None
    assert len(asked.logprobs) == len(asked.token_ids) and all(lp.top == () for lp in asked.logprobs)


def test_a_stop_string_cuts_the_logprobs_with_the_tokens(tiny):
    free = completions(tiny, tiny, EngineConfig(num_draft_tokens=3),
                       [("def f(x):", SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1))])[0]
    stop = free.text[len(free.text) // 2:][:3]
    [cut] = completions(tiny, tiny, EngineConfig(num_draft_tokens=3),
                        [("def f(x):", SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1, stop=stop))])
    assert cut.finish_reason == "stop" and len(cut.token_ids) < len(free.token_ids)
    assert len(cut.logprobs) == len(cut.token_ids) and cut.logprobs == free.logprobs[:len(cut.token_ids)]


@pytest.mark.parametrize("bad", [-1, 21, 2.5, True, "3"])
def test_bad_logprobs_are_rejected(bad):
    with pytest.raises((TypeError, ValueError), match="logprobs"):
        SamplingParams(logprobs=bad)
