"""Building requests and loops directly, and stepping an EngineCore (no engine thread), for exact tests."""

from __future__ import annotations

import attrs

from specbatch.kernels.build import make_drafter, new_core
from specbatch.kernels.loops.batch import BatchLoop
from specbatch.kernels.loops.scalar import ScalarLoop
from specbatch.kernels.paged_kv import KVLayout
from specbatch.kernels.runner import ModelRunner
from specbatch.runtime.output import StepEvent
from specbatch.runtime.params import SamplingParams
from specbatch.runtime.policy import Decision
from specbatch.runtime.request import Request


def make_request(loaded, prompt, **params) -> Request:
    ids = list(loaded.tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)
    sp = SamplingParams(**{"seed": 0, **params})
    return Request.create(ids, sp, loaded.tokenizer)


def run_plain(target, prompt, chunk: int | None = None, **params) -> list[int]:
    """Decoded alone, plain; ``chunk``: the prefill chunk (the engine's, for the same forwards)."""
    loop = BatchLoop(ModelRunner(target.model, chunk) if chunk else ModelRunner(target.model))
    request = make_request(target, prompt, **params)
    loop.admit(request)
    while not request.finished:
        loop.plain_round()
    loop.settle()
    return request.tokens


def run_scalar(target, drafter, prompt, k=4, verify="coupled", **params):
    tokens, rounds, _ = drive_scalar(target, drafter, prompt, k, verify=verify, **params)
    return tokens, rounds


def draft(k: int, tree=None) -> Decision:
    """A fixed round: a chain of ``k``, or ``tree`` cut to ``k`` levels (a chain shape: a chain)."""
    shape = None if tree is None else tree.cut(k)
    return Decision(k) if shape is None or shape.is_chain else Decision(shape.depth, shape)


def drive_scalar(target, drafter, prompt, k=4, verify="coupled", tree=None, **params):
    """A scalar loop run to the end, every round ``draft(k, tree)``: the request's tokens,
    each verify round, the loop."""
    request = make_request(target, prompt, **params)
    runner = ModelRunner(target.model)
    loop = ScalarLoop(runner, make_drafter(drafter, runner, False), request, verify)
    loop.start()
    rounds = []
    while not loop.finished:
        out = loop.step(draft(k, tree))
        if out.verify:
            rounds.append(out.verify)
    return request.tokens, rounds, loop


def run_batch(target, drafter, prompts, k=4, verify="coupled", armed=True, params=None, together=False,
              tree=None, kv_layout=None, check=None):
    """Decode ``prompts`` in one batch loop; ``together``: one left-padded prefill; ``tree``:
    a ``BatchTree``; ``check(loop)`` after every armed round."""
    runner = ModelRunner(target.model)
    loop = BatchLoop(runner, make_drafter(drafter, runner, True) if drafter else None, verify,
                     KVLayout(kv_layout or "paged"))
    requests = [make_request(target, p, **(params[i] if params else {})) for i, p in enumerate(prompts)]
    if together:
        loop.admit_many(requests)
    else:
        for r in requests:
            loop.admit(r)
    rounds = []
    if armed and loop.width:
        loop.capture_round()
        loop.reap()  # rows whose budget the capture round's token spent
    while loop.width:
        if armed:
            fits = tree is not None and 2 <= loop.width <= tree.max_width and verify == "coupled"
            out = loop.spec_round(draft(k, tree.shape if fits else None))
            if out.verify:
                rounds.append(out.verify)
            if check:
                check(loop)
        else:
            loop.plain_round(successor=False)
        loop.reap()
    return [r.tokens for r in requests], rounds


def inject_failure(engine, at_call: int, message: str = "injected kernel failure") -> None:
    """Make the engine's target forward raise once, on call number ``at_call``."""
    runner = engine.scheduler.kernels.runner
    real, calls = runner.forward, {"n": 0}

    def flaky(tokens, cache):
        calls["n"] += 1
        if calls["n"] == at_call:
            raise RuntimeError(message)
        return real(tokens, cache)

    runner.forward = flaky


# -- driving an EngineCore step by step (no thread, no timing) -----------------------------
@attrs.define
class Run:
    """What ``drive`` saw: the core's state after each step and each request's stream."""

    states: list[str] = attrs.field(factory=list)
    tokens: dict[str, list[int]] = attrs.field(factory=dict)  # request id -> tokens, from events
    text: dict[str, str] = attrs.field(factory=dict)
    finals: dict[str, StepEvent] = attrs.field(factory=dict)  # request id -> its last event

    def see(self, events: list[StepEvent]) -> None:
        for event in events:
            assert event.request_id not in self.finals, f"{event.request_id}: an event after its finish"
            self.tokens.setdefault(event.request_id, []).extend(event.token_ids)
            self.text[event.request_id] = self.text.get(event.request_id, "") + event.text
            if event.finish_reason is not None:
                self.finals[event.request_id] = event

    @property
    def path(self) -> list[str]:
        """The states visited, each run of steps in one state collapsed to one entry."""
        return [s for i, s in enumerate(self.states) if i == 0 or self.states[i - 1] != s]


def drive(core, arrivals: dict | None = None, cancels: dict | None = None, run: Run | None = None,
          max_steps: int = 10_000) -> tuple[Run, list[str]]:
    """Step ``core`` until it has no work. Before step ``i`` (0-based, counted from this
    call) it adds ``arrivals[i]`` (``(prompt, params)`` jobs) and cancels ``cancels[i]``
    (indexes into the ids added so far). Returns the run and the ids, in order added."""
    arrivals, cancels, run = arrivals or {}, cancels or {}, run or Run()
    ids: list[str] = []
    last = max([*arrivals, *cancels], default=-1)
    for i in range(max_steps):
        ids += [core.add(prompt, params) for prompt, params in arrivals.get(i, [])]
        for which in cancels.get(i, []):
            core.cancel(ids[which])
        if i > last and not core.has_work():
            return run, ids
        run.see(core.step())
        run.states.append(core.state)
    raise AssertionError(f"still busy after {max_steps} steps: {core.state}")


def plain_streams(target, jobs) -> list[list[int]]:
    """Each ``(prompt, params)`` job decoded alone with speculation off."""
    from specbatch.runtime.config import EngineConfig

    out = []
    with new_core(target, None, EngineConfig(speculation=False)) as core:
        for job in jobs:
            run, (rid,) = drive(core, {0: [job]})
            out.append(run.tokens[rid])
    return out


def assert_passes_on_avx2(test_file: str) -> None:
    """Run ``test_file``'s other tests again with the AVX2 kernels (``SPECBATCH_CPU_ISA``) in a
    child process and assert they pass; skipped on an AVX2-only CPU (they ran as they are)."""
    import os
    import subprocess
    import sys

    import pytest

    from specbatch.kernels import cpu
    if cpu.status().isa != "avx512":
        pytest.skip("the AVX2 path is the one running here already")
    env = {**os.environ, "SPECBATCH_CPU_ISA": "avx2"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", "not avx2"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:]
