"""The embedded target (SmolLM2-135M-Instruct from its GGUF): plausible answers, and every
speculative stream equal to plain decoding, greedy and seeded, alone and in a batch."""

from __future__ import annotations

import pytest

from specbatch import SamplingParams
from specbatch.kernels.models import ModelNotFound, embedded_target, load
from specbatch.kernels.models import chat_prompt as chat
from specbatch.runtime.config import EngineConfig
from specbatch.kernels.build import new_core, new_engine

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of Australia?", "How do I reverse a list in Python?",
             "Name three colours of the rainbow."]


@pytest.fixture(scope="module")
def smol():
    try:
        return load(embedded_target())
    except ModelNotFound as exc:
        pytest.skip(str(exc))


def run(core, jobs):
    """Token ids per job; all added before the first step (a burst)."""
    ids = [core.add(prompt, params) for prompt, params in jobs]
    out = {rid: [] for rid in ids}
    while core.has_work():
        for event in core.step():
            out[event.request_id] += event.token_ids
    return [out[rid] for rid in ids]


def test_greedy_chat_answer_names_canberra(smol):
    with new_core(smol, None, EngineConfig(speculation=False)) as core:
        [ids] = run(core, [(chat(smol.tokenizer, QUESTIONS[0]), SamplingParams(max_tokens=24, temperature=0))])
    assert "Canberra" in smol.tokenizer.decode(ids)
    assert ids[-1] in smol.tokenizer.eos_token_ids  # stops at its end-of-turn token


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_prompt_lookup_speculation_equals_plain_alone_and_batched(smol, temperature):
    from specbatch.kernels.drafters.ngram import NGramSource
    jobs = [(chat(smol.tokenizer, q), SamplingParams(max_tokens=40, temperature=temperature, seed=7 + i))
            for i, q in enumerate(QUESTIONS)]
    with new_core(smol, None, EngineConfig(speculation=False)) as plain:
        ref = run(plain, jobs)
    drafter = NGramSource(smol.vocab_size)
    with new_core(smol, drafter, EngineConfig(speculative_width_cap=0, num_draft_tokens=4)) as spec:
        alone = [run(spec, [job])[0] for job in jobs]
        batched = run(spec, jobs)
        assert spec.stats()["spec_rounds"] > 0
    assert alone == ref and batched == ref


def test_chat_endpoint_uses_the_template_and_stops_at_end_of_turn(smol):
    from test_server import Served  # the suite's uvicorn-in-a-thread server

    served = Served(new_engine(smol, None, EngineConfig(speculation=False)))
    try:
        reply = served.client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=40, temperature=0)
    finally:
        served.close()
    choice = reply.choices[0]
    assert "Canberra" in choice.message.content and choice.finish_reason == "stop"
    assert "<|im_end|>" not in choice.message.content and reply.usage.completion_tokens < 40


def test_a_long_arrival_prefills_in_chunks_while_a_scalar_stream_speculates(smol):
    """The real target: a speculating scalar stream stays Scalar while a ~300-token prompt
    prefills one chunk per round, is preempted the step after that prompt is ready, and
    both streams equal their requests decoded alone."""
    from specbatch.tools.bench.long import long_prompts
    from specbatch.kernels.drafters.ngram import NGramSource
    chunk = 64
    [long] = long_prompts(smol.tokenizer, 280, 1)
    jobs = [(chat(smol.tokenizer, QUESTIONS[1]), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)),
            (long, SamplingParams(max_tokens=6, temperature=0.8, seed=3))]
    with new_core(smol, None, EngineConfig(speculation=False, prefill_chunk=chunk)) as plain:
        ref = [run(plain, [job])[0] for job in jobs]
    config = EngineConfig(speculative_width_cap=1, num_draft_tokens=4, prefill_chunk=chunk, prompt_cache_bytes=0)
    with new_core(smol, NGramSource(smol.vocab_size), config) as core:
        ids, out, seen = [core.add(*jobs[0])], {}, []
        while core.has_work():
            if len(seen) == 2:  # the live stream is under way
                ids.append(core.add(*jobs[1]))
            for event in core.step():
                out.setdefault(event.request_id, []).extend(event.token_ids)
            seen.append((core.state, core.stats()["prefill_tokens"], core.stats()["spec_rounds"]))
        ready = next(i for i, (_, tokens, _) in enumerate(seen) if tokens == len(long))
        assert {state for state, _, _ in seen[:ready + 1]} == {"Scalar"} and seen[ready + 1][0] == "Batched"
        assert seen[ready][2] > seen[2][2]  # it kept speculating while the prompt prefilled
    assert [out[rid] for rid in ids] == ref
