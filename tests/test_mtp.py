"""The MTP head drafter: exact streams through both loops, transitions and schedules."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import make_request, run_batch, run_plain, run_scalar

from specbatch.runtime.policy import Decision
from test_properties import run_schedules

from specbatch import SamplingParams
from specbatch.kernels.drafters.head_context import HeadContext
from specbatch.kernels.drafters.mtp import MTPDrafter, MTPHead, save_head
from specbatch.kernels.drafters.mtp_checkpoint import load_head
from specbatch.kernels.loops.batch import BatchLoop
from specbatch.kernels.loops.scalar import ScalarLoop
from specbatch.kernels.paged_kv import KVLayout
from specbatch.kernels.runner import ModelRunner
from specbatch.runtime.config import EngineConfig
from specbatch.kernels.build import new_engine

PROMPTS = ["def f(x):", "import os\n", "class A:\n    pass\n", "x = 1", "# c\n" * 4]


@pytest.fixture(scope="module")
def head(mtp_head):
    return mtp_head  # conftest's random head over the tiny llama


@pytest.mark.parametrize("k,one_core", [(1, False), (3, False), (6, False), (2, True)])
def test_mtp_streams_equal_plain(tiny, head, k, one_core, monkeypatch):
    """``one_core``: the drafts evaluated on one core while the verify builds (spec_round's overlap)."""
    from specbatch.kernels.drafters.mtp import MTPDrafter
    monkeypatch.setattr(MTPDrafter, "draft_on_one_core", one_core)
    params = [dict(max_tokens=9 + 3 * i, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True)
              for i in range(5)]
    plain = [run_plain(tiny, p, **kw) for p, kw in zip(PROMPTS, params)]
    assert [run_scalar(tiny, head, p, k=k, **kw)[0] for p, kw in zip(PROMPTS, params)] == plain
    assert run_batch(tiny, head, PROMPTS, k=k, params=params)[0] == plain
    assert run_batch(tiny, head, PROMPTS, k=k, params=params, together=True)[0] == plain  # left-padded rows


@pytest.mark.parametrize("scalar_layout,batch_layout", [("paged", "paged"), ("dense", "paged"), ("paged", "dense")])
def test_mtp_close_anywhere_and_rebuild(tiny, head, scalar_layout, batch_layout):
    """The scalar loop's KV (a one-row paged cache, or single-sequence caches) joins either
    batch layout."""
    kw = dict(max_tokens=24, temperature=0.7, seed=9, ignore_eos=True)
    reference = run_plain(tiny, "def g(a):", **kw)
    for delivered in (1, 2, 3, 5, 8):
        request = make_request(tiny, "def g(a):", **kw)
        runner = ModelRunner(tiny.model)
        scalar = ScalarLoop(runner, MTPDrafter(head, runner), request, layout=KVLayout(scalar_layout))
        scalar.start()
        while request.emitted < delivered:
            scalar.step(Decision(3))
        batch = BatchLoop(runner, MTPDrafter(head, runner), layout=KVLayout(batch_layout))
        batch.rebuild(scalar.close())
        batch.capture_round()  # cold start: one hidden state per row, no re-prefill
        assert batch.drafter.width == 1
        while not request.finished:
            batch.spec_round(Decision(3))
        assert request.tokens == reference


def test_mtp_through_the_engine_and_random_schedules(tiny, head):
    jobs = [("def f(x):", SamplingParams(max_tokens=40, temperature=0.8, seed=1, ignore_eos=True))]
    jobs += [(f"y = {i}", SamplingParams(max_tokens=5, ignore_eos=True)) for i in range(3)]
    ref = [run_plain(tiny, p, max_tokens=sp.max_tokens, temperature=sp.temperature, seed=sp.seed,
                     ignore_eos=True) for p, sp in jobs]
    with new_engine(tiny, head, EngineConfig(num_draft_tokens=3, speculative_width_cap=2, rearm_min_remaining=4)) as eng:
        first = eng.submit(*jobs[0])
        next(iter(first))
        rest = [eng.submit(p, sp) for p, sp in jobs[1:]]
        assert [h.result(60).token_ids for h in [first, *rest]] == ref
    run_schedules(tiny, [head, head], examples=10, steps=10)


def test_head_round_trip_and_checkpoint_layout(tiny, head, tmp_path):
    save_head(head, tmp_path / "ours")
    again = load_head(tmp_path / "ours")
    h = mx.random.normal((1, head.config["hidden_size"]))
    assert mx.allclose(again.eh_proj(mx.concatenate([h, h], -1)), head.eh_proj(mx.concatenate([h, h], -1)), atol=1e-2)
    from specbatch.kernels.drafters.mtp_checkpoint import write_tiny_checkpoint
    for style in ("deepseek", "qwen3-next"):
        folder = write_tiny_checkpoint(tmp_path / style, tiny, style=style)
        loaded = load_head(folder, tiny.model.args)
        assert isinstance(loaded, MTPHead)
        out, _ = run_scalar(tiny, loaded, "def f(x):", k=3, max_tokens=10, ignore_eos=True)
        assert out == run_plain(tiny, "def f(x):", max_tokens=10, ignore_eos=True)
    with pytest.raises(ValueError, match="MTP layer"):
        load_head(write_plain(tmp_path / "none", tiny))


def write_plain(folder, tiny):
    import json

    from mlx.utils import tree_flatten
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(tiny.model.parameters())))
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": len(tiny.model.layers)}))
    return folder


def test_training_path_matches_the_drafting_path(tiny, head):
    runner = ModelRunner(tiny.model)
    cache = tiny.model.make_cache()
    x = mx.array([[5, 9, 33, 7, 120, 44, 3, 81]])
    runner.forward(x, cache)
    H, K, V = runner.hidden, cache[-1].keys[..., :8, :], cache[-1].values[..., :8, :]
    out = head.train_forward(H[:, :-1], runner.embed(x[:, 1:]), K[..., :7, :], V[..., :7, :])  # [1, 7, D]
    for n in range(7):
        ctx = HeadContext(K[..., :n + 1, :], V[..., :n + 1, :], mx.ones((1, n + 1), dtype=mx.bool_), [n + 1])
        step, _, _ = head.step(H[:, n], runner.embed(x[:, n + 1]), mx.array([n + 1]), ctx, [], [])
        assert mx.allclose(step, out[:, n], atol=1e-4), n


def test_a_swapped_heads_step_is_two_fused_ops_with_the_separate_kernels_bits(tiny, monkeypatch):
    from specbatch.kernels import cpu
    from specbatch.kernels.cpu import fused
    from specbatch.kernels.cpu.modules import use_cpu_kernels
    from specbatch.kernels.drafters.mtp import head_config
    if not cpu.status().active:
        pytest.skip(f"CPU kernels inactive: {cpu.status().why}")
    mx.random.seed(5)
    swapped = MTPHead(head_config(tiny.model.args, intermediate_size=64))
    assert use_cpu_kernels(swapped) > 0
    runner = ModelRunner(tiny.model)
    cache = tiny.model.make_cache()
    x = mx.array([[5, 9, 33, 7, 120, 44], [8, 2, 61, 19, 4, 90]])
    runner.forward(x, cache)
    H, K, V = runner.hidden, cache[-1].keys[..., :6, :], cache[-1].values[..., :6, :]
    own_k, own_v = [K[..., 5:, :]], [V[..., 5:, :]]  # a second draft step: one key of its own already
    args = (H[:, 4], runner.embed(x[:, 5]), mx.array([5, 5]),
            HeadContext(K[..., :5, :], V[..., :5, :], mx.ones((2, 5), dtype=mx.bool_), [5, 5]), own_k, own_v)
    monkeypatch.setattr(fused, "mtp_step", lambda *a: None)  # the two-op path under the one-op one (test_mtp_step)
    ran = []
    for name in ("qkv_heads", "second_half"):
        original = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, f=original: ran.append(f(*a)) or ran[-1])
    one_op = swapped.step(*args)
    assert len(ran) == 2 and all(r is not None for r in ran)  # both fused ops applied
    monkeypatch.setattr(fused, "qkv_heads", lambda *a: None)
    monkeypatch.setattr(fused, "second_half", lambda *a: None)
    separate = swapped.step(*args)
    assert all(mx.array_equal(a, b).item() for a, b in zip(one_op, separate))


def test_after_a_plain_round_an_armed_head_drafts_from_the_state_that_predicted_the_pending_token(tiny, head):
    from specbatch.kernels.loops.verify import last_hidden
    from specbatch.runtime.policy import PLAIN
    runner = ModelRunner(tiny.model)
    batch = BatchLoop(runner, MTPDrafter(head, runner))
    for p in PROMPTS[:3]:
        batch.admit(make_request(tiny, p, max_tokens=20, ignore_eos=True))
    batch.capture_round()
    batch.spec_round(Decision(2))
    batch.spec_round(PLAIN)  # a plain round the policy decided while armed
    assert mx.array_equal(batch.drafter.hidden, head.first_input(last_hidden(runner)))
    request = make_request(tiny, PROMPTS[0], max_tokens=20, ignore_eos=True)
    scalar = ScalarLoop(runner, MTPDrafter(head, runner), request)
    scalar.start()
    scalar.step(PLAIN)
    assert mx.array_equal(scalar.drafter.hidden, head.first_input(last_hidden(runner)))
