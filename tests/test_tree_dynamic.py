"""Dynamic trees (issue 18): the MTP head keeps exactly the nodes whose path score (the
product of drafted probabilities from the root) reaches the shape's bound, and the
streams they verify equal plain decoding, greedy and seeded, with the KV of a plain decode."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import draft, drive_scalar, make_request, run_plain
from test_tree import assert_kv_equal, held_tokens, plain_kv

from specbatch.kernels.build import make_drafter
from specbatch.kernels.loops.scalar import ScalarLoop
from specbatch.kernels.runner import ModelRunner
from specbatch.runtime.config import EngineConfig
from specbatch.runtime.tree_shape import TreeShape

PROMPT = [5, 9, 13, 5, 9, 17, 5, 9]


def test_dynamic_shapes_parse_print_cut_and_configure():
    shape = TreeShape.parse("2,2,1@0.1")
    assert shape.branching == (2, 2, 1) and shape.min_score == 0.1 and shape.dynamic
    assert str(shape) == "2,2,1@0.1" and TreeShape.parse(str(shape)) == shape
    assert shape.cut(2) == TreeShape([2, 2], 0.1) and shape.nodes == 11  # the bound
    dyn_chain = TreeShape.parse("1,1,1@0.3")
    assert not dyn_chain.is_chain and TreeShape.parse("1,1,1").is_chain  # a dynamic chain stops early
    assert EngineConfig(tree_shape="1,1,1@0.3").drafts.tree_shape == dyn_chain
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError):
            TreeShape([2, 1], bad)
    from specbatch.tools.calibrate_tree import candidates
    assert [str(s) for s in candidates("1,1;2,1;3,2,1@0.1;1,1@0.3")] == ["2,1", "3,2,1@0.1", "1,1@0.3"]
    assert [str(s) for s in candidates("1,1;2,1;3,2,1@0.1", dynamic=False)] == ["2,1"]  # no pruning drafter


def fresh_loop(tiny, head):
    request = make_request(tiny, PROMPT, max_tokens=30)
    runner = ModelRunner(tiny.model)
    loop = ScalarLoop(runner, make_drafter(head, runner, False), request)
    loop.start()
    return loop


def top(logits, d, b):
    return mx.argsort(-logits, axis=-1)[:, :b].astype(mx.int32)


def path_tokens(layout, tokens, node):
    out = []
    while node > 0:
        out.insert(0, tokens[node])
        node = layout.parents[node]
    return tuple(out)


def test_dynamic_tree_keeps_exactly_the_nodes_whose_path_score_reaches_the_bound(tiny, mtp_head):
    """The static draft of the bound (exact per node: ``test_tree``) scores every path; the
    dynamic draft keeps those at or above the bound, and nothing else."""
    bound = TreeShape([3, 2, 2])
    probs = {}

    def scoring(logits, d, b):
        kids = top(logits, d, b)
        probs[d] = mx.take_along_axis(mx.softmax(logits, axis=-1), kids, axis=-1).reshape(-1).tolist()
        return kids
    loop = fresh_loop(tiny, mtp_head)
    static = loop.drafter.draft_tree(mx.array([loop.prev]), mx.array([loop.pending]), bound, scoring,
                                     context=loop.cache)
    layout, tokens = static.layout, static.tokens.tolist()
    first = {d: layout.depths.index(d) for d in range(1, bound.depth + 1)}
    score = [1.0] * layout.size
    for n in range(1, layout.size):
        d = layout.depths[n]
        score[n] = score[layout.parents[n]] * probs[d][n - first[d]]
    deep = sorted(score[first[2]:])
    for threshold in (deep[len(deep) // 2], deep[-1], min(score[1:first[2]]) / 2):
        want = {path_tokens(layout, tokens, n) for n in range(1, layout.size) if score[n] >= threshold}
        loop = fresh_loop(tiny, mtp_head)
        tree = loop.drafter.draft_tree(mx.array([loop.prev]), mx.array([loop.pending]),
                                       TreeShape(bound.branching, threshold), top, context=loop.cache)
        got_tokens = tree.tokens.tolist()
        got = {path_tokens(tree.layout, got_tokens, n) for n in range(1, tree.layout.size)}
        assert got == want and tree.layout.size == len(want) + 1, threshold
        assert got_tokens[0] == loop.pending and all(p < n for n, p in enumerate(tree.layout.parents))
    loop = fresh_loop(tiny, mtp_head)  # nothing reaches a bound of 1: the round verifies the root alone
    tree = loop.drafter.draft_tree(mx.array([loop.prev]), mx.array([loop.pending]), TreeShape([2, 2], 1.0), top,
                                   context=loop.cache)
    assert tree.layout.size == 1 or max(probs[1]) == 1.0


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("shape", ["3,2,1@0.0001", "2,2,2@0.02", "1,1,1,1@0.01"])
def test_dynamic_tree_streams_and_kv_equal_plain(tiny, mtp_head, shape, temperature):
    params = dict(max_tokens=24, temperature=temperature, seed=7)
    request = make_request(tiny, PROMPT, **params)
    runner = ModelRunner(tiny.model)
    loop = ScalarLoop(runner, make_drafter(mtp_head, runner, False), request)
    loop.start()
    sizes = []
    while not loop.finished:
        out = loop.step(draft(3, TreeShape.parse(shape)))
        if out.verify:
            sizes.append(out.verify.drafted)
            if not loop.finished:
                assert_kv_equal(loop.singles(), plain_kv(tiny, held_tokens(request, loop)))
    assert request.tokens == run_plain(tiny, PROMPT, **params)
    assert sizes and max(sizes) <= 3
    got, _, _ = drive_scalar(tiny, mtp_head, PROMPT, 3, tree=TreeShape.parse(shape), **params)
    assert got == request.tokens
