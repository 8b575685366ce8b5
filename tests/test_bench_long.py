"""The long_prompts bench suite runs end to end on a tiny model (figures not checked)."""

from __future__ import annotations

from specbatch.tools.bench.harness import Context
from specbatch.tools.bench.long import long_prompts, suite_long_prompts
from specbatch.runtime.config import EngineConfig


def test_long_prompts_are_about_the_asked_length_and_differ(tiny):
    got = long_prompts(tiny.tokenizer, 60, 2)
    assert all(55 <= len(p) <= 90 for p in got) and got[0] != got[1]


def test_the_suite_reports_every_state_with_and_without_chunking(tiny, monkeypatch):
    import specbatch.tools.bench.long as bench_long
    monkeypatch.setattr(bench_long, "STAGGER_S", 0.0)
    ctx = Context(tiny, tiny, EngineConfig(num_draft_tokens=2, prefill_chunk=16), [1], 8, 1)
    ctx.long_prompt_tokens, ctx.long_arrivals = 60, 2
    try:
        rows = suite_long_prompts(ctx)["rows"]
    finally:
        ctx.close()
    assert [(r["state"], r["prefill"]) for r in rows] == [(s, m) for s in ("Scalar", "Batched", "Gated")
                                                         for m in ("chunked", "whole")]
    assert all(r["seen_state"] == r["state"] for r in rows)
    assert all(r["arrival_ttft_max_s"] > 0 and r["solo_ttft_s"] > 0 for r in rows)
