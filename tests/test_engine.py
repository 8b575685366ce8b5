"""The public API on the plain continuous-batching path (speculation off)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from specbatch import InvalidRequest, SamplingParams
from specbatch.runtime.config import EngineConfig
from specbatch.kernels.build import new_engine

PROMPTS = ["def f(x):", "import os\nimport sys\n", "class A:\n    pass\n" * 3, "x = 1", "# comment\n" * 9,
           "return", "for i in range(10):\n    print(i)\n", "while True:"]


@pytest.fixture
def plain(tiny):
    with new_engine(tiny, None, EngineConfig(speculation=False)) as engine:
        yield engine


def alone(engine, prompt, params):
    return engine.submit(prompt, params).result(timeout=60).token_ids


def staggered(engine, jobs, gap=0.004):
    handles = []
    for i, (prompt, params) in enumerate(jobs):
        handles.append(engine.submit(prompt, params))
        time.sleep(gap * (i % 3))
    return [h.result(timeout=120).token_ids for h in handles]


def test_greedy_batch_equals_alone(plain):
    jobs = [(p, SamplingParams(max_tokens=6 + 5 * i, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(PROMPTS)]
    solo = [alone(plain, p, sp) for p, sp in jobs]
    assert staggered(plain, jobs) == solo
    assert [len(s) for s in solo] == [6 + 5 * i for i in range(8)]


def test_seeded_sampling_equals_alone(plain):
    jobs = [(p, SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=100 + i)) for i, p in enumerate(PROMPTS)]
    solo = [alone(plain, p, sp) for p, sp in jobs]
    assert staggered(plain, jobs) == solo


def test_events_and_result_agree(plain):
    handle = plain.submit("def g():", SamplingParams(max_tokens=12, ignore_eos=True))
    events = []
    for event in handle:
        events.append(event)
        if len(events) == 3:
            break
    done = handle.result(timeout=30)  # also after some events were consumed
    assert done.finish_reason == "length" and len(done.token_ids) == 12
    assert [e.token for e in events] == done.token_ids[:3]
    all_events = events + list(handle)
    assert "".join(e.text for e in all_events) == done.text
    assert all_events[-1].finish_reason == "length" and done.usage.completion_tokens == 12


def test_max_tokens_one_and_context_fill(plain, tiny):
    assert len(plain.submit("x", SamplingParams(max_tokens=1)).result(30).token_ids) == 1
    near = [5] * (tiny.context_length - 3)
    done = plain.submit(near, SamplingParams(max_tokens=50, ignore_eos=True)).result(60)
    assert done.finish_reason == "length" and len(done.token_ids) == 3


@pytest.mark.parametrize("prompt, params, param", [
    ("", None, "prompt"),
    ([], None, "prompt"),
    ([1, 2, 10**6], None, "prompt"),
    ("x", {"max_tokens": 0}, "max_tokens"),
    ("x", {"temperature": -1}, "temperature"),
    ("x", {"top_p": 2}, "top_p"),
    ("x", {"seed": "abc"}, "seed"),
])
def test_bad_input_is_refused_and_nothing_is_lost(plain, prompt, params, param):
    other = plain.submit("def ok():", SamplingParams(max_tokens=10, ignore_eos=True))
    with pytest.raises((InvalidRequest, ValueError, TypeError), match=param):
        plain.submit(prompt, params)
    assert len(other.result(30).token_ids) == 10


def test_prompt_over_context(plain, tiny):
    with pytest.raises(InvalidRequest) as info:
        plain.submit([5] * tiny.context_length)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"


def test_cancel_frees_the_row(plain):
    keep = plain.submit("a = 1", SamplingParams(max_tokens=60, ignore_eos=True))
    drop = plain.submit("b = 2", SamplingParams(max_tokens=10_00, ignore_eos=True))
    next(iter(drop))
    plain.cancel(drop)
    assert drop.result(30).finish_reason == "cancelled"
    assert len(keep.result(30).token_ids) == 60
    deadline = time.time() + 5
    while plain.stats()["width"] and time.time() < deadline:
        time.sleep(0.01)
    stats = plain.stats()
    assert stats["width"] == 0 and stats["kv_bytes"] == 0


def test_async_stream(plain):
    async def collect():
        text = []
        async for event in plain.stream("def h():", SamplingParams(max_tokens=8, ignore_eos=True)):
            text.append(event.text)
        return "".join(text)

    assert isinstance(asyncio.run(collect()), str)


def test_async_stream_gets_events_pushed_before_it_reads(plain):
    """The worst interleaving, forced: the engine thread finishes the request before the
    caller's coroutine returns from queueing it. The stream still carries every token (its
    listener was attached before the request reached the engine)."""
    params = SamplingParams(max_tokens=9, ignore_eos=True, seed=3, temperature=0.5)
    want = plain.submit("def h():", params).result(timeout=60)
    inbox = plain._inbox

    class FinishingInbox:  # the engine's queue, whose put returns once queued requests are done
        def put(self, item):
            handles = [plain.handle(request) for request in item or ()]  # item: requests, or a wake-up
            inbox.put(item)
            for handle in handles:
                handle.result(timeout=60)

        def __getattr__(self, name):
            return getattr(inbox, name)

    async def collect():
        events = [e async for e in plain.stream("def h():", params)]
        return [e.token for e in events if e.token is not None], "".join(e.text for e in events)

    plain._inbox = FinishingInbox()
    try:
        tokens, text = asyncio.run(asyncio.wait_for(collect(), 60))
    finally:
        plain._inbox = inbox
    assert (tokens, text) == (want.token_ids, want.text)


def test_threads_submit_concurrently(plain):
    out = {}

    def worker(i):
        out[i] = plain.submit(PROMPTS[i], SamplingParams(max_tokens=9, ignore_eos=True)).result(60)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert all(len(out[i].token_ids) == 9 for i in range(6))
    deadline = time.time() + 10  # handles complete first; the engine books the finish right after
    while plain.stats()["requests_finished"] < plain.stats()["requests_submitted"] and time.time() < deadline:
        time.sleep(0.005)
    stats = plain.stats()
    assert stats["requests_finished"] == stats["requests_submitted"]


def test_a_failing_round_fails_its_rows_and_the_engine_serves_on(tiny):
    from helpers import inject_failure

    with new_engine(tiny, None, EngineConfig(speculation=False)) as engine:
        inject_failure(engine, at_call=5)
        victim = engine.submit("def f(x):", SamplingParams(max_tokens=30, ignore_eos=True)).result(30)
        assert victim.finish_reason == "error" and "injected" in victim.error
        after = engine.submit("def g(x):", SamplingParams(max_tokens=5, ignore_eos=True)).result(30)
        assert after.finish_reason == "length" and len(after.token_ids) == 5


def test_kv_budget_makes_admission_wait(tiny):
    from specbatch.kernels.models import kv_bytes_per_token
    per_row = (8 + 20 + 5) * kv_bytes_per_token(tiny.model)
    with new_engine(tiny, None, EngineConfig(speculation=False, kv_budget_bytes=int(per_row * 2.5))) as engine:
        handles = [engine.submit([5] * 8, SamplingParams(max_tokens=20, ignore_eos=True)) for _ in range(6)]
        widths = set()
        while not all(h.done for h in handles):
            widths.add(engine.stats()["width"])
        assert max(widths) <= 2 and all(len(h.result().token_ids) == 20 for h in handles)


def test_submit_many_arrives_as_one_burst(tiny):
    with new_engine(tiny, tiny, EngineConfig(num_draft_tokens=2, speculative_width_cap=2)) as engine:
        handles = engine.submit_many(["a = 1", "b = 2", "c = 3"], SamplingParams(max_tokens=4, seed=1))
        assert all(len(h.result(30).token_ids) <= 4 for h in handles)
        deadline = time.time() + 10
        while engine.stats()["state"] != "Idle" and time.time() < deadline:
            time.sleep(0.005)
        assert engine.stats()["transitions"] == {"Idle->Gated": 1, "Gated->Idle": 1}
        with pytest.raises(InvalidRequest):
            engine.submit_many(["ok", ""])
        assert engine.stats()["requests_submitted"] == 3  # nothing of a bad batch is queued


def test_freed_memory_is_kept_for_reuse_unless_switched_off(monkeypatch):
    """glibc keeps freed blocks for reuse once an engine is built (a retired row's copy then
    lands on pages already faulted in); SPECBATCH_RETAIN_MEMORY=0 leaves the allocator alone."""
    import platform

    from specbatch.kernels.build import retain_freed_memory

    monkeypatch.setenv("SPECBATCH_RETAIN_MEMORY", "0")
    assert retain_freed_memory.__wrapped__() is False
    monkeypatch.delenv("SPECBATCH_RETAIN_MEMORY")
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert retain_freed_memory.__wrapped__() is True
