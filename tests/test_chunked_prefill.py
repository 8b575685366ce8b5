"""Long arrivals prefill one chunk per step between the live rows' rounds, in every state.

Driven through ``EngineCore.step()`` (no thread, no timing): the state, the width and the
tokens each request has after every step are exact. A scalar stream keeps speculating
while a long prompt prefills and is preempted only once that prompt is ready to decode;
batched and gated rows keep decoding the same way. Every stream equals its request
decoded alone (greedy and seeded).
"""

from __future__ import annotations

import math

import pytest
from helpers import Run, drive

from specbatch import EngineCore, SamplingParams
from specbatch.runtime.config import EngineConfig
from specbatch.testing.fake import FakeModel
from specbatch.kernels.models import LoadedModel
from specbatch.kernels.build import new_core

CHUNK = 8


@pytest.fixture(scope="module")
def fake(tiny):
    target = LoadedModel(FakeModel(), tiny.tokenizer, "fake-target", 4096)
    oracle = LoadedModel(FakeModel(), tiny.tokenizer, "fake-oracle", 4096)  # accepts every draft
    return target, oracle


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(salt + 7 * i) % 500 + 3 for i in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def seeded(n: int, seed: int = 5) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.8, seed=seed, ignore_eos=True)


def config(**kw) -> EngineConfig:
    return EngineConfig(**{"num_draft_tokens": 3, "speculative_width_cap": 2, "prefill_chunk": CHUNK,
                           "prompt_cache_bytes": 0, **kw})


class Stepper:
    """Steps a core and records, per step, the state, width and each request's tokens."""

    def __init__(self, core: EngineCore):
        self.core, self.run, self.ids = core, Run(), []

    def add(self, job) -> str:
        self.ids.append(self.core.add(*job))
        return self.ids[-1]

    def step(self) -> str:
        self.run.see(self.core.step())
        self.run.states.append(self.core.state)
        return self.core.state

    def tokens(self, rid: str) -> int:
        return len(self.run.tokens.get(rid, []))

    def stat(self, name: str):
        return self.core.stats()[name]

    def finish(self) -> list[list[int]]:
        drive(self.core, run=self.run)
        assert all(rid in self.run.finals for rid in self.ids)
        assert self.stat("prefilling") == 0 and self.stat("prefill_kv_bytes") == 0
        return [self.run.tokens[rid] for rid in self.ids]


def alone(target, jobs, **kw) -> list[list[int]]:
    """Each job decoded alone, plain, with the same chunk size (the same prefill forwards)."""
    out = []
    with new_core(target, None, config(speculation=False, **kw)) as core:
        for job in jobs:
            run, (rid,) = drive(core, {0: [job]})
            out.append(run.tokens[rid])
    return out


@pytest.mark.parametrize("live_params", [greedy(60), seeded(60)])
def test_a_scalar_stream_speculates_until_the_long_arrival_is_ready(fake, live_params):
    """One chunk per scalar round (a round's buffered tokens go out one a step, between
    them); the preempt comes the step after the last chunk."""
    target, oracle = fake
    jobs = [(prompt(5), live_params), (prompt(30, salt=1), greedy(12))]
    with new_core(target, oracle, config()) as core:
        s = Stepper(core)
        live = s.add(jobs[0])
        assert s.step() == "Scalar" and s.step() == "Scalar"
        arrival = s.add(jobs[1])
        done, chunks = 0, 0
        while done < 30:  # the live stream gets a token every step; a verify round runs a chunk
            before, rounds = s.tokens(live), s.stat("spec_rounds")
            assert s.step() == "Scalar"
            assert s.tokens(live) == before + 1 and s.tokens(arrival) == 0
            ran = s.stat("spec_rounds") - rounds
            assert s.stat("prefill_tokens") == (min(30, done + CHUNK) if ran else done)
            done, chunks = s.stat("prefill_tokens"), chunks + ran
            assert s.stat("prefilling") == int(done > 0) and (s.stat("prefill_kv_bytes") > 0) == (done > 0)
        assert chunks == math.ceil(30 / CHUNK)  # it kept speculating: a verify round per chunk
        assert s.stat("transitions") == {"Idle->Scalar": 1}
        assert s.step() == "Batched" and s.tokens(arrival) == 0  # ready: now the preempt
        assert s.stat("transitions")["Scalar->Batched"] == 1
        assert s.step() == "Batched" and s.stat("width") == 2  # joins: first token, capture round
        assert s.tokens(arrival) == 2 and s.stat("prefilling") == 0 and s.stat("prefill_tokens") == 0
        assert s.finish() == alone(target, jobs)


def test_without_chunking_the_arrival_preempts_at_once_and_prefills_whole(fake):
    target, oracle = fake
    jobs = [(prompt(5), greedy(40)), (prompt(30, salt=1), greedy(12))]
    with new_core(target, oracle, config(chunked_prefill=False)) as core:
        s = Stepper(core)
        s.add(jobs[0])
        s.step(), s.step()
        arrival = s.add(jobs[1])
        assert s.step() == "Batched" and s.stat("prefilling") == 0  # preempted before any prefill
        assert s.step() == "Batched" and s.tokens(arrival) == 2  # the whole prompt in one step
        assert s.finish() == alone(target, jobs, chunked_prefill=False)


def test_a_speculating_batch_keeps_speculating_and_the_arrival_joins_armed(fake):
    target, oracle = fake
    jobs = [(prompt(5), greedy(50)), (prompt(6, salt=2), seeded(50)), (prompt(20, salt=1), seeded(10, 9))]
    with new_core(target, oracle, config(speculative_width_cap=3)) as core:
        s = Stepper(core)
        a, b = s.add(jobs[0]), s.add(jobs[1])
        assert [s.step() for _ in range(3)] == ["Batched"] * 3  # start, capture, a verify round
        arrival = s.add(jobs[2])
        for _ in range(math.ceil(20 / CHUNK)):
            before, rounds = (s.tokens(a), s.tokens(b)), s.stat("spec_rounds")
            assert s.step() == "Batched" and s.stat("width") == 2 and s.tokens(arrival) == 0
            assert s.stat("spec_rounds") == rounds + 1 and s.tokens(a) > before[0] and s.tokens(b) > before[1]
        rounds = s.stat("spec_rounds")
        assert s.step() == "Batched" and s.stat("width") == 3 and s.tokens(arrival) >= 1
        assert s.stat("spec_rounds") == rounds + 1  # joined the armed batch: no capture round
        assert s.finish() == alone(target, jobs)


def test_a_batch_gates_only_when_the_arrival_is_ready(fake):
    target, oracle = fake
    jobs = [(prompt(5), greedy(40)), (prompt(6, salt=2), greedy(40)), (prompt(20, salt=1), greedy(10))]
    with new_core(target, oracle, config()) as core:
        s = Stepper(core)
        s.add(jobs[0]), s.add(jobs[1])
        assert [s.step() for _ in range(2)] == ["Batched"] * 2
        arrival = s.add(jobs[2])
        for _ in range(math.ceil(20 / CHUNK)):
            assert s.step() == "Batched" and s.stat("width") == 2  # speculating at the cap
        assert s.step() == "Gated" and s.stat("width") == 2 and s.tokens(arrival) == 0
        assert s.step() == "Gated" and s.stat("width") == 3 and s.tokens(arrival) >= 1
        assert s.finish() == alone(target, jobs)


def test_a_gated_batch_keeps_decoding_plain_while_the_arrival_prefills(fake):
    target, oracle = fake
    jobs = [(prompt(5), greedy(40)), (prompt(6, salt=2), seeded(40)), (prompt(20, salt=1), greedy(10))]
    with new_core(target, oracle, config(speculative_width_cap=1)) as core:
        s = Stepper(core)
        a, b = s.add(jobs[0]), s.add(jobs[1])
        assert [s.step() for _ in range(2)] == ["Gated"] * 2
        arrival = s.add(jobs[2])
        for _ in range(math.ceil(20 / CHUNK)):
            before = s.tokens(a), s.tokens(b)
            assert s.step() == "Gated" and s.stat("width") == 2 and s.tokens(arrival) == 0
            assert s.tokens(a) == before[0] + 1 and s.tokens(b) == before[1] + 1
        assert s.step() == "Gated" and s.stat("width") == 3 and s.tokens(arrival) >= 1
        assert s.finish() == alone(target, jobs)


def test_while_rows_decode_admission_prefills_at_most_a_chunk_a_step(fake):
    target, oracle = fake
    jobs = [(prompt(5), greedy(30)), (prompt(6, salt=2), greedy(30))]
    jobs += [(prompt(6, salt=10 + i), greedy(8)) for i in range(3)]  # 6 + 6 > CHUNK
    with new_core(target, oracle, config(speculative_width_cap=1)) as core:
        s = Stepper(core)
        s.add(jobs[0]), s.add(jobs[1])
        s.step(), s.step()
        for job in jobs[2:]:
            s.add(job)
        widths = []
        for _ in range(3):
            s.step()
            widths.append(s.stat("width"))
        assert widths == [3, 4, 5]
        assert s.finish() == alone(target, jobs)


def test_cancelling_a_long_arrival_mid_prefill_drops_its_partial_kv(fake):
    target, oracle = fake
    jobs = [(prompt(5), greedy(30)), (prompt(40, salt=1), greedy(10))]
    with new_core(target, oracle, config()) as core:
        s = Stepper(core)
        s.add(jobs[0])
        s.step(), s.step()
        arrival = s.add(jobs[1])
        while s.stat("prefill_tokens") < 2 * CHUNK:
            assert s.step() == "Scalar"
        assert s.stat("prefilling") == 1
        core.cancel(arrival)
        assert s.step() == "Scalar" and s.stat("prefilling") == 0 and s.stat("prefill_kv_bytes") == 0
        assert s.run.finals[arrival].finish_reason == "cancelled" and s.tokens(arrival) == 0
        got = s.finish()
        assert got[0] == alone(target, jobs[:1])[0]
        assert s.run.path == ["Scalar", "Idle"]


def test_a_scalar_stream_that_ends_mid_prefill_hands_over_to_the_arrival(fake):
    target, oracle = fake
    jobs = [(prompt(5), greedy(4)), (prompt(60, salt=1), seeded(12))]
    with new_core(target, oracle, config()) as core:
        s = Stepper(core)
        s.add(jobs[0])
        s.step()
        s.add(jobs[1])
        got = s.finish()
        assert s.run.path == ["Scalar", "Idle", "Scalar", "Idle"]  # it went on from its partial prefill
        assert got == alone(target, jobs)


def test_a_failing_chunk_fails_only_its_arrival(fake):
    target, oracle = fake
    jobs = [(prompt(5), greedy(30)), (prompt(30, salt=1), greedy(10))]
    with new_core(target, oracle, config()) as core:
        s = Stepper(core)
        live = s.add(jobs[0])
        s.step()
        runner = core.scheduler.kernels.runner

        def broken(tokens, cache):  # only prefill goes through forward_last once it decodes
            raise RuntimeError("injected prefill failure")
        runner.forward_last = broken
        arrival = s.add(jobs[1])
        assert s.step() == "Scalar"
        final = s.run.finals[arrival]
        assert final.finish_reason == "error" and "injected prefill failure" in final.error
        del runner.forward_last
        got = s.finish()
        assert s.run.finals[live].finish_reason == "length" and got[0] == alone(target, jobs[:1])[0]


@pytest.mark.parametrize("drafter", ["model", "mtp"])
def test_tiny_models_stream_equal_alone_through_a_chunked_preempt(tiny, drafter):
    if drafter == "mtp":
        import mlx.core as mx

        from specbatch.kernels.drafters.mtp import MTPHead, head_config
        mx.random.seed(3)
        source = MTPHead(head_config(tiny.model.args, intermediate_size=64))
        mx.eval(source.parameters())
    else:
        source = tiny  # drafting for itself
    jobs = [("def f(x):", seeded(40, 1)), (" ".join(f"x{i} = {i}" for i in range(12)), greedy(10)),
            ("import os\n", greedy(8))]
    with new_core(tiny, source, config(speculative_width_cap=3)) as core:
        s = Stepper(core)
        s.add(jobs[0])
        s.step(), s.step()
        long_id = s.add(jobs[1])
        assert len(core.encode(jobs[1][0])) > 2 * CHUNK
        states = [s.step()]
        s.add(jobs[2])  # a short arrival behind the long one joins first
        states += [s.step() for _ in range(2)]
        assert states[0] == "Scalar" and states[1] == "Batched" and s.tokens(long_id) == 0
        got = s.finish()
        assert got == alone(tiny, jobs)


def test_calibration_picks_the_largest_chunk_within_the_gap_and_load_pair_uses_it(tiny, model_dir, tmp_path,
                                                                                   monkeypatch):
    import argparse

    from specbatch.tools.calibrate_prefill import calibrate_prefill, measure_chunks, pick_chunk
    from specbatch.kernels.pair import load_pair
    from specbatch.kernels.runner import ModelRunner

    times = {16: 0.05, 32: 0.08, 64: 0.15, 128: 0.3}
    assert pick_chunk(times, decode_s=0.04, gap=4.0) == 64  # 0.15 <= 0.16 < 0.3
    assert pick_chunk(times, decode_s=0.001, gap=4.0) == 16  # nothing fits: the smallest
    assert pick_chunk(times, decode_s=0.04, gap=4.0, floor=32) == 64
    assert pick_chunk(times, decode_s=0.025, gap=4.0) == 32
    assert pick_chunk(times, decode_s=0.025, gap=4.0, floor=32) == 64  # 32 fits, but pins idle prefill to the kernel
    assert pick_chunk({16: 0.05, 32: 0.08}, decode_s=0.04, gap=4.0, floor=32) == 32  # nothing larger measured
    chunks, decode = measure_chunks(ModelRunner(tiny.model), [4, 8], context=16, repeats=1)
    assert set(chunks) == {4, 8} and decode > 0 and all(t > 0 for t in chunks.values())

    monkeypatch.setenv("SPECBATCH_CALIBRATION", str(tmp_path / "cal.json"))
    target = load_pair(str(model_dir["llama"]), speculation=False)[0]
    args = argparse.Namespace(prefill_chunks="4,8", prefill_context=16, prefill_gap=1e9, repeats=1)
    assert calibrate_prefill(target, args) == 8  # an unbounded gap: the largest size
    assert load_pair(str(model_dir["llama"]), speculation=False)[2].prefill.prefill_chunk == 8
    assert load_pair(str(model_dir["llama"]), speculation=False, prefill_chunk=32)[2].prefill.prefill_chunk == 32
    assert load_pair(str(model_dir["llama"]), drafter="ngram")[2].prefill.prefill_chunk == 8  # per target, any drafter


def test_the_cli_carries_the_chunk_flags():
    from specbatch.serving.cli import build_parser

    args = build_parser().parse_args(["generate", "--prompt", "x", "--prefill-chunk", "64", "--no-chunked-prefill"])
    assert args.prefill_chunk == 64 and args.chunked_prefill is False
    args = build_parser().parse_args(["calibrate", "--measure", "prefill", "--prefill-gap", "3"])
    assert args.measure == "prefill" and args.prefill_gap == 3.0 and args.prefill_chunk is None


@pytest.mark.parametrize("fits", [False, True])
def test_a_long_arrival_starts_prefilling_only_within_the_kv_budget(tiny, fits):
    """A partial prefill holds KV: its chunks start only once its reservation fits beside
    the live rows'; past the budget it waits whole and prefills when there is room."""
    from specbatch.kernels.models import kv_bytes_per_token
    per_token = kv_bytes_per_token(tiny.model)
    live_job, long_job = (prompt(5), greedy(12)), (prompt(40, salt=2), greedy(4))
    reserve = lambda job: (len(job[0]) + job[1].max_tokens + 3 + 1) * per_token  # noqa: E731
    budget = reserve(live_job) + (reserve(long_job) if fits else reserve(long_job) // 2)
    with new_core(tiny, None, config(speculation=False, kv_budget_bytes=budget)) as core:
        s = Stepper(core)
        live = s.add(live_job)
        s.step()
        s.add(long_job)
        seen = set()
        while s.tokens(live) < 12:
            s.step()
            seen.add(s.stat("prefilling"))
        assert seen == ({0, 1} if fits else {0})
        assert [len(t) for t in s.finish()] == [12, 4]


def test_a_whole_prefill_merges_the_between_round_chunks_and_keeps_their_boundaries():
    import mlx.core as mx

    from specbatch.kernels.runner import idle_chunk, prefill

    class Recorder:  # a runner that records each forward's length
        def __init__(self, chunk):
            self.prefill_chunk, self.sizes = chunk, []

        def forward_last(self, tokens, cache):
            self.sizes.append(tokens.shape[1])
            return mx.zeros((1, 4))

    big = Recorder(48)
    prefill(big, list(range(1450)), [])
    assert big.sizes == [480, 480, 480, 10]  # 30 whole chunks of 48 in three forwards, the tail alone
    small = Recorder(8)  # within the small-M kernels' rows: merging would switch kernels
    prefill(small, list(range(30)), [])
    assert small.sizes == [8, 8, 8, 6] and idle_chunk(8) == 8 and idle_chunk(128) == 512


def test_a_whole_prefill_merges_only_where_the_blas_keeps_each_chunks_bits(monkeypatch):
    from specbatch.kernels import cpu, runner

    shapes = ((576, 576), (1536, 576))  # linears that are not swapped: their rows go to the BLAS whole
    monkeypatch.setattr(cpu, "merged_rows_match", lambda chunk, big, shapes: False)
    assert runner.idle_chunk(48, shapes) == 48 and runner.idle_chunk(48) == 480
    monkeypatch.setattr(cpu, "merged_rows_match", lambda chunk, big, shapes: (chunk, big) == (48, 480))
    assert runner.idle_chunk(48, shapes) == 480 and runner.idle_chunk(40, shapes) == 40


@pytest.mark.parametrize("n, k", [(576, 576), (192, 576), (1536, 576), (576, 1536)])
def test_the_probe_says_what_every_chunk_of_a_merged_matmul_shows(n, k):
    # the embedded target's shapes: where the probe lets prefill merge, no chunk's bits move
    import mlx.core as mx

    from specbatch.kernels.cpu import merged_rows_match
    w, x = mx.random.normal((n, k)), mx.random.normal((480, k))
    full = x @ w.T
    same = all(mx.array_equal(x[i:i + 48] @ w.T, full[i:i + 48]).item() for i in range(0, 480, 48))
    assert merged_rows_match(48, 480, ((n, k),)) == same


def test_a_tiny_models_whole_prefill_has_the_bits_of_its_chunks_on_this_blas(tiny):
    """A whole prefill (merged forwards) leaves the KV and last logits a prefill of one chunk
    per forward leaves, whatever this BLAS does with a chunk inside a larger matmul."""
    import mlx.core as mx

    from specbatch.kernels import cpu
    from specbatch.kernels.runner import ModelRunner, idle_chunk, prefill, prefill_chunk
    runner = ModelRunner(tiny.model, 40)
    assert (runner.linear_shapes == ()) == cpu.status().active  # swapped linears keep chunks apart
    tokens = prompt(203)
    whole, chunked = runner.make_cache(), runner.make_cache()
    logits = prefill(runner, tokens, whole)
    for i in range(0, len(tokens), 40):
        last = prefill_chunk(runner, tokens[i:i + 40], chunked)
    assert idle_chunk(40, runner.linear_shapes) == 480 or not cpu.status().active
    assert mx.array_equal(logits, last).item()
    assert all(mx.array_equal(a.keys[..., :a.offset, :], b.keys[..., :b.offset, :]).item()
               for a, b in zip(whole, chunked))
