"""An MTP head with a reduced output vocabulary (FR-Spec style): kept rows only, -inf elsewhere."""

from __future__ import annotations

import mlx.core as mx
from helpers import run_batch, run_plain, run_scalar

from specbatch.kernels.drafters.mtp import MTPDrafter, MTPHead, head_config, save_head
from specbatch.kernels.drafters.mtp_checkpoint import load_head
from specbatch.kernels.runner import ModelRunner, prefill

PROMPTS = ["def f(x):", "import os\n", "x = 1"]


def reduced_head(tiny, n=16):
    mx.random.seed(5)
    head = MTPHead(head_config(tiny.model.args, intermediate_size=64) | {"draft_vocab": n})
    head.vocab_ids = mx.arange(0, 2 * n, 2, dtype=mx.int32)
    mx.eval(head.parameters())
    return head


def test_reduced_head_drafts_only_kept_tokens_and_round_trips(tiny, tmp_path):
    head = reduced_head(tiny)
    assert "vocab_ids" not in dict(head.trainable_parameters())
    save_head(head, tmp_path / "h")
    again = load_head(tmp_path / "h")
    assert again.vocab_ids.dtype == mx.int32 and again.vocab_ids.tolist() == head.vocab_ids.tolist()
    runner = ModelRunner(tiny.model)
    cache = runner.make_cache()
    prefill(runner, [5, 9, 33, 7], cache)
    drafter = MTPDrafter(again, runner)
    drafter.hidden = runner.hidden[:, -1]
    tokens, logits = drafter.draft(None, mx.array([11]), 3, lambda lg, j: mx.argmax(lg, axis=-1), context=cache)
    assert logits.shape == (1, 3, runner.vocab_size)
    assert all(t % 2 == 0 and t < 32 for t in tokens[0].tolist())
    assert int(mx.isfinite(logits[0, 0]).sum()) == 16


def test_reduced_head_streams_equal_plain(tiny):
    head = reduced_head(tiny)
    params = [dict(max_tokens=12, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True) for i in range(3)]
    plain = [run_plain(tiny, p, **kw) for p, kw in zip(PROMPTS, params)]
    assert [run_scalar(tiny, head, p, k=3, **kw)[0] for p, kw in zip(PROMPTS, params)] == plain
    assert run_batch(tiny, head, PROMPTS, k=3, params=params)[0] == plain
