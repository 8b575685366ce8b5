"""Random schedules (arrivals, budgets, caps, k, temperatures, cancels, switches) never
change a stream: each equals its request decoded alone with the same seed.

The schedules drive an ``EngineCore`` step by step, so an arrival or a cancel lands at an
exact step and hypothesis can shrink and replay any failure.
"""

from __future__ import annotations

import pytest
from helpers import Run, drive, run_plain
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from specbatch import EngineCore, SamplingParams
from specbatch.kernels.models import LoadedModel
from specbatch.runtime.config import EngineConfig
from specbatch.runtime.machine import STATES, TRANSITIONS
from specbatch.testing.fake import FakeModel
from specbatch.kernels.build import new_core

EDGES = {f"{s}->{d}" for _, src, d, *_ in TRANSITIONS for s in (src if isinstance(src, list) else [src])}


class Schedules(RuleBasedStateMachine):
    target: LoadedModel
    drafters: list

    def __init__(self):
        super().__init__()
        self.core: EngineCore | None = None
        self.run = Run()
        self.jobs: list[tuple[list[int], SamplingParams, str]] = []

    @initialize(cap=st.integers(0, 4), k=st.integers(1, 6), preempt=st.booleans(), resume=st.booleans(),
                drafter=st.integers(0, 1), verify=st.sampled_from(["coupled", "coupled", "rejection"]),
                chunk=st.sampled_from([128, 4, 9]), pipeline=st.sampled_from([None, True, False]))
    def start(self, cap, k, preempt, resume, drafter, verify, chunk, pipeline):
        self.cap, self.verify, self.chunk = cap, verify, chunk
        config = EngineConfig(num_draft_tokens=k, speculative_width_cap=cap, preempt=preempt, resume=resume,
                              rearm_min_remaining=3, verify=verify, prefill_chunk=chunk, pipeline=pipeline)
        self.core = new_core(self.target, self.drafters[drafter], config)

    @rule(length=st.integers(1, 24), budget=st.integers(1, 24), temperature=st.sampled_from([0.0, 0.0, 0.8, 1.0]),
          top_p=st.sampled_from([1.0, 0.9]), seed=st.integers(0, 2**32 - 1), salt=st.integers(0, 400))
    def submit(self, length, budget, temperature, top_p, seed, salt):
        prompt = [(salt + 7 * i) % 500 + 3 for i in range(length)]
        params = SamplingParams(max_tokens=budget, temperature=temperature, top_p=top_p, seed=seed, ignore_eos=True)
        self.jobs.append((prompt, params, self.core.add(prompt, params)))

    @rule(which=st.integers(0, 50))
    def cancel(self, which):
        if self.jobs:
            self.core.cancel(self.jobs[which % len(self.jobs)][2])

    @rule(steps=st.integers(1, 8))
    def step(self, steps):
        for _ in range(steps):
            self.run.see(self.core.step())
            self.run.states.append(self.core.state)

    @invariant()
    def batched_means_within_the_cap(self):
        if self.core is None:
            return
        assert self.core.state in STATES
        if self.core.state == "Batched" and self.cap:
            assert self.core.stats()["width"] <= self.cap  # a speculating batch never outgrows it

    def teardown(self):
        if self.core is None:
            return
        try:
            drive(self.core, run=self.run)
            self.check()
        finally:
            self.core.close()

    def check(self):
        for prompt, params, rid in self.jobs:
            final = self.run.finals[rid]  # finished exactly once: Run.see refuses events after it
            got = self.run.tokens[rid]
            assert final.completion.token_ids == got
            if self.verify == "rejection" and params.temperature > 0:
                continue  # rejection sampling's output depends on drafts by design
            alone = run_plain(self.target, prompt, chunk=self.chunk, **{f: getattr(params, f) for f in
                              ("max_tokens", "temperature", "top_p", "seed", "ignore_eos")})
            if final.finish_reason == "cancelled":
                assert got == alone[:len(got)]
            else:
                assert got == alone
        stats = self.core.stats()
        assert self.core.state == "Idle" and stats["requests_finished"] == len(self.jobs)
        assert set(stats["transitions"]) <= EDGES
        if self.cap:
            assert max(stats["spec_widths"], default=0) <= self.cap
        assert stats["width"] == 0 and stats["kv_bytes"] == 0 and stats["drafter_kv_bytes"] == 0


def run_schedules(target, drafters, examples, steps):
    Schedules.target, Schedules.drafters = target, drafters
    run_state_machine_as_test(Schedules, settings=settings(max_examples=examples, stateful_step_count=steps,
                                                           deadline=None))


def test_schedules_on_the_fake_kernel(tiny):
    target = LoadedModel(FakeModel(), tiny.tokenizer, "fake-target", 4096)
    drafters = [LoadedModel(FakeModel(skew=0.0), tiny.tokenizer, "fake-oracle", 4096),
                LoadedModel(FakeModel(skew=3.0, salt=1), tiny.tokenizer, "fake-skewed", 4096)]
    run_schedules(target, drafters, examples=200, steps=20)


@pytest.mark.slow
def test_schedules_on_tiny_mlx_models(tiny, tiny_draft):
    run_schedules(tiny, [tiny, tiny_draft], examples=30, steps=12)
