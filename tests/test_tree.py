"""Tree drafting (issue 18): every tree-verified stream equals plain decoding, greedy and
seeded, and the KV after an accepted branch equals what a plain decode writes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import draft, drive, drive_scalar, make_request, run_plain
from hypothesis import given, settings
from hypothesis import strategies as st

from specbatch import SamplingParams
from specbatch.runtime.config import EngineConfig
from specbatch.kernels.drafters.ngram import NGramSource, propose, propose_tree
from specbatch.kernels.build import make_drafter, new_core
from specbatch.kernels.loops.scalar import ScalarLoop
from specbatch.kernels.paged_kv import KVLayout, PagedKV
from specbatch.kernels.runner import ModelRunner
from specbatch.kernels.single_kv import SingleKV
from specbatch.runtime.policy import Decision, RowState
from specbatch.runtime.tree_shape import TreeLayout, TreeShape, walk

# dynamic bounds too: drafters other than the MTP head draft the bound
SHAPES = st.builds(TreeShape, st.lists(st.integers(1, 3), min_size=1, max_size=4),
                   st.sampled_from([None, None, 0.05, 0.3]))


def test_shape_layout_and_counts():
    shape = TreeShape.parse("2,2,1")
    layout = shape.layout()
    assert shape.nodes == layout.size == 1 + 2 + 4 + 4 and shape.depth == layout.depth == 3
    assert layout.parents[:7] == (-1, 0, 0, 1, 1, 2, 2) and layout.depths[-1] == 3
    assert TreeShape.chain(3).is_chain and not shape.is_chain and str(shape.cut(2)) == "2,2"
    seen = layout.ancestry()
    assert seen[7][3] and seen[7][1] and seen[7][0] and not seen[7][2] and not seen[7][4]
    with pytest.raises(ValueError):
        TreeShape([2, 0])


def test_walk_follows_the_target_through_second_children():
    layout = TreeShape.parse("2,2").layout()  # 0 -> 1, 2; 1 -> 3, 4; 2 -> 5, 6
    drafted = [9, 10, 11, 12, 13, 14, 15]
    assert walk(layout, drafted, [11, 0, 15, 0, 0, 0, 0]) == [2, 6]
    assert walk(layout, drafted, [11, 0, 99, 0, 0, 0, 0]) == [2]
    assert walk(layout, drafted, [99] * 7) == []


@given(seq=st.lists(st.integers(0, 5), min_size=2, max_size=40), shape=SHAPES)
@settings(max_examples=200)
def test_prompt_lookup_tree_is_a_trie_over_the_chain(seq, shape):
    tokens, parents = propose_tree(np.array(seq), shape.branching, 4, 1)
    layout = TreeLayout.of_parents(parents)
    assert tokens[0] == seq[-1] and all(p < n for n, p in enumerate(parents))
    kids = layout.children()
    for node, children in enumerate(kids):
        assert len({tokens[c] for c in children}) == len(children)  # distinct siblings
        if children:
            assert len(children) <= shape.branching[layout.depths[node]]
    chain = propose(np.array(seq), shape.depth, 4, 1)  # the latest match's chain is in the tree
    node = 0
    for token in chain:
        node = next(c for c in kids[node] if tokens[c] == token)
    one, _ = propose_tree(np.array(seq), (1,) * shape.depth, 4, 1)
    assert one[1:] == chain


def run_tree(target, drafter_source, prompt, shape, k=4, **params):
    return drive_scalar(target, drafter_source, prompt, k, tree=shape, **params)


@given(shape=SHAPES, k=st.integers(1, 5), drafter=st.integers(0, 2),
       temperature=st.sampled_from([0.0, 0.0, 0.8, 1.0]), top_p=st.sampled_from([1.0, 0.9]),
       seed=st.integers(0, 2**32 - 1), length=st.integers(1, 12), budget=st.integers(1, 30),
       salt=st.integers(0, 400))
@settings(max_examples=150)
def test_tree_streams_equal_plain_on_the_fake_kernel(fakes, shape, k, drafter, temperature, top_p,
                                                     seed, length, budget, salt):
    target, drafters = fakes
    # repeats, so prompt lookup matches: one continuation (period 3) or several (a token
    # that recurs before different ones: its tree branches)
    period = [(salt + 7 * (i % 3)) % 500 + 3 for i in range(length)]
    branching = [(salt + (7 * i if i % 2 else 0)) % 500 + 3 for i in range(length)]
    prompt = branching if salt % 2 else period
    params = dict(max_tokens=budget, temperature=temperature, top_p=top_p, seed=seed, ignore_eos=True)
    got, rounds, _ = run_tree(target, drafters[drafter], prompt, shape, k, **params)
    assert got == run_plain(target, prompt, **params)
    depth = k if shape.is_chain else min(k, shape.depth)  # a chain shape drafts chains of k
    assert all(len(r.emitted[0]) == r.accepted[0] + 1 and r.drafted <= depth for r in rounds)
    if drafter == 0:  # the oracle's first child is always right
        assert all(r.accepted[0] == r.drafted for r in rounds)


@given(shape=SHAPES, seeds=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=4),
       temperature=st.sampled_from([0.0, 0.8]), preempt_at=st.integers(1, 6))
@settings(max_examples=25)
def test_tree_config_through_the_core_with_arrivals(fakes, shape, seeds, temperature, preempt_at):
    """Through the machine: a lone request trees, arrivals preempt it into the batch loop
    (which drafts chains); every stream still equals plain decoding."""
    target, drafters = fakes
    config = EngineConfig(num_draft_tokens=4, speculative_width_cap=0, tree_shape=shape, rearm_min_remaining=3)
    jobs = [([(s % 97) + 3, 5, (s % 89) + 3, 5], SamplingParams(max_tokens=16, temperature=temperature, seed=s,
                                                                   ignore_eos=True)) for s in seeds]
    with new_core(target, drafters[1], config) as core:
        run, ids = drive(core, {0: jobs[:1], preempt_at: jobs[1:]})
    for (prompt, params), rid in zip(jobs, ids):
        assert run.tokens[rid] == run_plain(target, prompt, max_tokens=16, temperature=temperature,
                                            seed=params.seed, ignore_eos=True)


def plain_kv(target, tokens: list[int]):
    """Keys/values a plain causal forward of ``tokens`` writes: per layer ``[1, H, n, D]``."""
    runner = ModelRunner(target.model)
    cache = runner.make_cache()
    runner.forward(mx.array(tokens, dtype=mx.int32)[None], cache)
    return [(c.keys[..., :c.offset, :], c.values[..., :c.offset, :]) for c in cache]


def held_tokens(request, loop) -> list[int]:
    """What the target's cache should hold: the prompt and every verified token but the pending one."""
    return (request.prompt + request.tokens + [t for t, _ in loop._buffer])[:-1]


def assert_kv_equal(cache, ref) -> None:
    for c, (k, v) in zip(cache, ref):
        assert c.offset == k.shape[2]
        assert mx.allclose(c.keys[..., :c.offset, :], k, atol=1e-4, rtol=1e-4).item()
        assert mx.allclose(c.values[..., :c.offset, :], v, atol=1e-4, rtol=1e-4).item()


@pytest.mark.parametrize("layout", ["paged", "dense"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_kv_after_accepted_branches_equals_plain_kv(tiny, tiny_draft, temperature, layout):
    """Rounds on tiny fp32 models; after each, the target's KV (a one-row paged cache, or
    single-sequence caches) equals a plain forward of the same tokens. Some accepted paths
    leave the first child (so columns really move)."""
    prompt = [5, 9, 13, 5, 9, 17, 5, 9, 13, 22, 5, 9]
    moved = 0
    for drafter in (tiny, tiny_draft):
        request = make_request(tiny, prompt, max_tokens=24, temperature=temperature, seed=11)
        runner = ModelRunner(tiny.model)
        loop = ScalarLoop(runner, make_drafter(drafter, runner, False), request, layout=KVLayout(layout))
        loop.start()
        assert isinstance(loop.kv, PagedKV if layout == "paged" else SingleKV)
        while not loop.finished:
            out = loop.step(draft(3, TreeShape([3, 2, 1])))
            if out.verify:
                moved += out.verify.accepted[0] >= 2  # p_2 is node 4 or later in [3, 2, 1]
                if not loop.finished:
                    assert_kv_equal(loop.singles(), plain_kv(tiny, held_tokens(request, loop)))
        assert request.tokens == run_plain(tiny, prompt, max_tokens=24, temperature=temperature, seed=11)
    assert moved


def test_kv_check_catches_a_missing_compaction(tiny, monkeypatch):
    """The KV test can fail: with compaction reduced to a trim, the KV differs from plain."""
    import specbatch.kernels.loops.tree as tree_loop

    def trim_only(kv, roots, paths):  # the scalar loop's SingleKV compacts as a batch cache's row does
        kv.trim_rows([n - (r + len(p) + 1) for n, r, p in zip(kv.lengths(), roots, paths)])
    monkeypatch.setattr(tree_loop, "compact_rows", trim_only)
    prompt = [5, 9, 13, 5, 9, 17, 5, 9]
    request = make_request(tiny, prompt, max_tokens=8)
    runner = ModelRunner(tiny.model)
    loop = ScalarLoop(runner, make_drafter(tiny, runner, False), request)
    loop.start()
    loop.step(draft(3, TreeShape([2, 2, 1])))
    assert loop.last_round.accepted[0] == 3  # path 1, 3, 7: columns 3 and 7 should have moved
    held = held_tokens(request, loop)
    with pytest.raises(AssertionError):
        assert_kv_equal(loop.singles(), plain_kv(tiny, held))


@pytest.mark.parametrize("shape", ["2,1,1", "3,2,1"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_tree_streams_equal_plain_on_tiny_models(tiny, tiny_draft, shape, temperature):
    prompt = [7, 21, 8, 7, 21, 9, 7, 21]
    ref = run_plain(tiny, prompt, max_tokens=20, temperature=temperature, seed=5)
    for source in (tiny, tiny_draft, NGramSource(tiny.vocab_size)):
        got, _, _ = run_tree(tiny, source, prompt, TreeShape.parse(shape), max_tokens=20,
                             temperature=temperature, seed=5)
        assert got == ref


@pytest.mark.parametrize("kind", ["model", "mtp"])
def test_tree_drafts_equal_chain_drafts_along_every_path(tiny, tiny_draft, mtp_head, kind):
    """Each node's draft logits in a tree equal a chain draft forced along its path: the
    drafter's own tree attention (positions, ancestors, head keys) is exact."""
    shape = TreeShape([2, 2, 1])
    layout = shape.layout()

    def fresh():
        request = make_request(tiny, [5, 9, 13, 5, 9, 17, 5, 9], max_tokens=30)
        runner = ModelRunner(tiny.model)
        loop = ScalarLoop(runner, make_drafter(tiny_draft if kind == "model" else mtp_head, runner, False),
                          request)
        loop.start()
        return loop

    seen = {}

    def top(logits, d, b):
        seen[d] = logits  # [M, V] of the nodes at depth d - 1
        return mx.argsort(-logits, axis=-1)[:, :b].astype(mx.int32)

    loop = fresh()
    tokens = loop.drafter.draft_tree(mx.array([loop.prev]), mx.array([loop.pending]), shape, top,
                                     context=loop.cache).tokens.tolist()
    first = {d: layout.depths.index(d) for d in range(shape.depth + 1)}
    for leaf in [n for n, d in enumerate(layout.depths) if d == shape.depth]:
        path = [leaf]
        while layout.parents[path[0]] > 0:
            path.insert(0, layout.parents[path[0]])
        chain = []

        def force(logits, j, path=path):
            chain.append(logits)  # [1, V]
            return mx.array([tokens[path[j]]], dtype=mx.int32)
        again = fresh()
        again.drafter.draft(mx.array([again.prev]), mx.array([again.pending]), len(path), force, context=again.cache)
        for j, node in enumerate(path):
            parent = layout.parents[node]
            row = parent - first[j]  # the parent's row among the nodes of depth j
            assert mx.allclose(seen[j + 1][row], chain[j][0], atol=1e-4, rtol=1e-4).item(), (leaf, j)


def test_pick_tree_needs_a_win_over_plain_and_the_chain():
    from specbatch.tools.calibrate_tree import pick_tree

    def row(plain, chain, tree):
        return {"plain": {"tok_s": plain}, "chain k=3": {"tok_s": chain}, "tree 2,1,1": {"tok_s": tree}}
    assert pick_tree({0.0: row(10, 12, 14), 0.7: row(10, 11, 12), 1.0: row(10, 9, 9)}, 0.03) == \
        (TreeShape([2, 1, 1]), 0.7)
    assert pick_tree({0.0: row(10, 12, 12.1), 0.7: row(10, 11, 12)}, 0.03) == (None, None)  # within the margin
    assert pick_tree({0.0: row(15, 12, 14)}, 0.03) == (None, None)  # plain wins


def test_tree_depth_raises_the_width1_draft_length_and_config_reads_the_tree():
    from specbatch.runtime.schedule import Band, DraftSchedule
    from specbatch.tools.calibrate_tree import with_tree_depth
    schedule = DraftSchedule([1, 4], [Band(0.0, [2, 1]), Band(0.7, [1, 0]), Band(1.0, [0, 0])])
    raised = with_tree_depth(schedule, TreeShape([2, 1, 1]), 0.7)
    assert [b.k for b in raised.bands] == [(3, 1), (3, 0), (0, 0)]
    config = EngineConfig(tree_shape="2,1,1", tree_max_temperature=0.7, fixed_draft=True, prompt_lookup=0)
    assert config.drafts.tree_shape == TreeShape([2, 1, 1]) and EngineConfig(tree_shape="1,1").drafts.tree_shape is None
    hot, cold = (config.policy().decide([RowState((0.5,), t)]) for t in (0.9, 0.7))
    assert hot == Decision(4) and cold == Decision(3, TreeShape([2, 1, 1]))


def test_load_pair_reads_a_calibrated_tree(tmp_path, monkeypatch, model_dir):
    import json

    from specbatch.kernels.calibration import machine_key, pair_key
    from specbatch.kernels.pair import load_pair
    path = tmp_path / "calibration.json"
    entry = {"k": 3, "cap": 1, "tree": "2,1,1", "tree_max_temperature": 0.0}
    path.write_text(json.dumps({machine_key(): {pair_key(str(model_dir["llama"]), "ngram"): entry}}))
    monkeypatch.setenv("SPECBATCH_CALIBRATION", str(path))
    _, _, config = load_pair(str(model_dir["llama"]), drafter="ngram")
    assert config.drafts.tree_shape == TreeShape([2, 1, 1]) and config.drafts.tree_max_temperature == 0.0
