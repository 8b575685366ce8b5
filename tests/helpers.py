"""Building requests and loops directly (no engine thread) for exact loop tests."""

from __future__ import annotations

from specbatch.loops.batch import BatchLoop
from specbatch.loops.scalar import ScalarLoop
from specbatch.machine import make_drafter
from specbatch.request import Request
from specbatch.runner import ModelRunner
from specbatch.sampling import SamplingParams


def make_request(loaded, prompt, **params) -> Request:
    ids = list(loaded.tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)
    sp = SamplingParams(**{"seed": 0, **params})
    return Request.create(ids, sp, loaded.tokenizer)


def run_plain(target, prompt, **params) -> list[int]:
    loop = BatchLoop(ModelRunner(target.model))
    request = make_request(target, prompt, **params)
    loop.admit(request)
    while not request.finished:
        loop.plain_round()
    loop.settle()
    return request.tokens


def run_scalar(target, drafter, prompt, k=4, verify="coupled", **params):
    request = make_request(target, prompt, **params)
    runner = ModelRunner(target.model)
    loop = ScalarLoop(runner, make_drafter(drafter, runner, False), request, k, verify)
    loop.start()
    rounds = []
    while not loop.finished:
        loop.step()
        if loop.last_round:
            rounds.append(loop.last_round)
    return request.tokens, rounds


def run_batch(target, drafter, prompts, k=4, verify="coupled", armed=True, params=None, together=False):
    """Decode ``prompts`` in one batch loop; ``together``: one left-padded prefill."""
    runner = ModelRunner(target.model)
    loop = BatchLoop(runner, make_drafter(drafter, runner, True) if drafter else None, k, verify)
    requests = [make_request(target, p, **(params[i] if params else {})) for i, p in enumerate(prompts)]
    if together:
        loop.admit_many(requests)
    else:
        for r in requests:
            loop.admit(r)
    rounds = []
    if armed and loop.width:
        loop.capture_round()
    while loop.width:
        if armed:
            result = loop.spec_round()
            if result:
                rounds.append(result)
        else:
            loop.plain_round(successor=False)
        loop.reap()
    return [r.tokens for r in requests], rounds


def inject_failure(engine, at_call: int, message: str = "injected kernel failure") -> None:
    """Make the engine's target forward raise once, on call number ``at_call``."""
    runner = engine.scheduler.runner
    real, calls = runner.forward, {"n": 0}

    def flaky(tokens, cache):
        calls["n"] += 1
        if calls["n"] == at_call:
            raise RuntimeError(message)
        return real(tokens, cache)

    runner.forward = flaky
