"""EAGLE-3-style MTP input: the runner keeps layers only when asked, a fused head drafts
exact streams through every loop, and an old-format head is untouched."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from helpers import run_batch, run_plain, run_scalar
from test_mtp import PROMPTS

from specbatch import SamplingParams
from specbatch.kernels.build import new_engine
from specbatch.kernels.drafters.mtp import MTPDrafter, MTPHead, head_config, save_head
from specbatch.kernels.drafters.mtp_checkpoint import load_head
from specbatch.kernels.runner import ModelRunner, draft_states
from specbatch.runtime.config import EngineConfig
from specbatch.runtime.tree_shape import BatchTree


@pytest.fixture(scope="module")
def fused(tiny):
    """A random fused head over the tiny llama's two layers (fc random too: it must matter)."""
    mx.random.seed(5)
    head = MTPHead(head_config(tiny.model.args, intermediate_size=64) | {"fuse_layers": [0, 1]})
    mx.eval(head.parameters())
    return head


def test_runner_keeps_layers_only_when_asked(tiny):
    x = mx.array([[5, 9, 33, 7, 120]])
    plain = ModelRunner(tiny.model)
    before = plain.forward(x, plain.make_cache())
    assert plain.layer_hidden is None and draft_states(plain) is plain.hidden
    kept = ModelRunner(tiny.model)
    kept.keep_layers((0, 1))
    logits = kept.forward(x, kept.make_cache())
    D = tiny.model.args.hidden_size
    assert kept.layer_hidden.shape == (1, 5, 2 * D) and draft_states(kept) is kept.layer_hidden
    assert mx.array_equal(logits, before)  # the taps change nothing the target computes
    final = tiny.model.model.norm(kept.layer_hidden[..., D:])  # the last layer, normed: the final hidden
    assert mx.allclose(final, kept.hidden, atol=1e-5)
    again = plain.forward(x, plain.make_cache())  # the model is tapped now: an unasked runner still keeps nothing
    assert plain.layer_hidden is None and mx.array_equal(again, before)
    kept.forward_last(x, kept.make_cache())  # prefill keeps them too
    assert kept.layer_hidden.shape == (1, 5, 2 * D)


@pytest.mark.parametrize("k", [1, 3])
def test_fused_head_streams_equal_plain(tiny, fused, k):
    params = [dict(max_tokens=9 + 3 * i, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True)
              for i in range(5)]
    plain = [run_plain(tiny, p, **kw) for p, kw in zip(PROMPTS, params)]
    assert [run_scalar(tiny, fused, p, k=k, **kw)[0] for p, kw in zip(PROMPTS, params)] == plain
    assert run_batch(tiny, fused, PROMPTS, k=k, params=params)[0] == plain
    assert run_batch(tiny, fused, PROMPTS, k=k, params=params, together=True)[0] == plain


def test_fused_head_trees_and_engine(tiny, fused):
    params = [dict(max_tokens=12, temperature=0.0, seed=i, ignore_eos=True) for i in range(3)]
    plain = [run_plain(tiny, p, **kw) for p, kw in zip(PROMPTS, params)]
    tree = BatchTree("2,2", max_width=4)
    assert run_batch(tiny, fused, PROMPTS[:3], k=2, params=params, tree=tree)[0] == plain
    jobs = [(p, SamplingParams(max_tokens=14, temperature=0.8, seed=i, ignore_eos=True)) for i, p in enumerate(PROMPTS[:3])]
    ref = [run_plain(tiny, p, max_tokens=14, temperature=0.8, seed=i, ignore_eos=True) for i, (p, _) in enumerate(jobs)]
    with new_engine(tiny, fused, EngineConfig(num_draft_tokens=3, speculative_width_cap=2)) as eng:
        assert [h.result(60).token_ids for h in [eng.submit(*j) for j in jobs]] == ref


def test_fused_head_first_step_reads_the_layers(tiny, fused):
    runner = ModelRunner(tiny.model)
    drafter = MTPDrafter(fused, runner)  # asks the runner for the layers
    runner.forward(mx.array([[5, 9, 33]]), runner.make_cache())
    states = draft_states(runner)[:, -1]  # [1, 2D]
    drafter.add_rows([[5, 9, 33]], hidden=states)
    assert mx.allclose(drafter.hidden, fused.fc(states))
    with pytest.raises(ValueError, match="layers"):
        fused.first_input(runner.hidden[:, -1])  # the final hidden alone is not its input


def test_old_format_head_loads_unchanged(tiny, mtp_head, tmp_path):
    save_head(mtp_head, tmp_path / "old")
    config = json.loads((tmp_path / "old" / "mtp_config.json").read_text())
    assert "fuse_layers" not in config
    head = load_head(tmp_path / "old")
    assert not head.fuse_layers and "fc" not in head
    h = mx.random.normal((2, config["hidden_size"]))
    assert head.first_input(h) is h  # the final hidden goes in as it did
    runner = ModelRunner(tiny.model)
    MTPDrafter(head, runner)
    assert runner.kept == ()  # nothing asked of the runner
    out, _ = run_scalar(tiny, head, "def f(x):", k=3, max_tokens=10, ignore_eos=True)
    assert out == run_plain(tiny, "def f(x):", max_tokens=10, ignore_eos=True)


def test_fused_head_round_trip(tiny, fused, tmp_path):
    save_head(fused, tmp_path / "fused")
    again = load_head(tmp_path / "fused")
    assert again.fuse_layers == (0, 1)
    x = mx.random.normal((1, 2 * tiny.model.args.hidden_size))
    assert mx.allclose(again.first_input(x), fused.first_input(x), atol=1e-2)
