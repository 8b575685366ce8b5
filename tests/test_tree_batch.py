"""Token trees in the batch loop (issue 18 item 3): one tree per row, every row's nodes in
one target forward, each row's path compacted in the batch cache (dense and paged)."""

from __future__ import annotations

from unittest import mock

import mlx.core as mx
import pytest
from helpers import draft, drive, make_request, run_batch, run_plain
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tree import SHAPES, assert_kv_equal, plain_kv

import specbatch.kernels.loops.round as round_body
from specbatch import SamplingParams
from specbatch.kernels.drafters.base import DraftTree
from specbatch.kernels.drafters.mtp import MTPDrafter
from specbatch.kernels.drafters.ngram import NGramSource
from specbatch.kernels.loops.batch import BatchLoop, held_tokens
from specbatch.kernels.loops.tree import top_chooser, greedy_rows
from specbatch.kernels.paged_kv import KVLayout
from specbatch.kernels.runner import ModelRunner
from specbatch.runtime.config import EngineConfig
from specbatch.runtime.tree_shape import BatchTree, TreeLayout, TreeShape
from specbatch.kernels.build import new_core


def prompts_for(salt: int, rows: int, length: int) -> list[list[int]]:
    """Prompts that repeat (prompt lookup finds one continuation, or several: trees branch)."""
    out = []
    for r in range(rows):
        s = salt + 31 * r
        period = [(s + 7 * (i % 3)) % 500 + 3 for i in range(length)]
        branching = [(s + (7 * i if i % 2 else 0)) % 500 + 3 for i in range(length)]
        out.append(branching if s % 2 else period)
    return out


@given(shape=SHAPES, k=st.integers(1, 5), rows=st.integers(2, 4), salt=st.integers(0, 400),
       temps=st.lists(st.sampled_from([0.0, 0.0, 0.8, 1.0]), min_size=4, max_size=4),
       budgets=st.lists(st.integers(1, 24), min_size=4, max_size=4), seed=st.integers(0, 2**31),
       layout=st.sampled_from(["dense", "paged"]))
@settings(max_examples=60, deadline=None)
def test_batched_tree_streams_equal_plain_on_the_fake_kernel(fakes, shape, k, rows, salt, temps, budgets, seed,
                                                             layout):
    target, _ = fakes
    prompts = prompts_for(salt, rows, 10)
    params = [dict(max_tokens=budgets[i], temperature=temps[i], seed=seed + i, ignore_eos=True) for i in range(rows)]
    with mock.patch.object(round_body, "tree_round", wraps=round_body.tree_round) as spy:
        got, rounds = run_batch(target, NGramSource(512), prompts, k, params=params, kv_layout=layout,
                                tree=BatchTree(shape, max_width=4))
    assert got == [run_plain(target, p, **params[i]) for i, p in enumerate(prompts)]
    assert all(len(run) == a + 1 for r in rounds for run, a in zip(r.emitted, r.accepted))
    live = [b for b in budgets[:rows] if b >= 3]  # rows still decoding after the capture round
    if shape.cut(k).is_chain:
        assert spy.call_count == 0
    elif shape.branching[0] > 1 and len(live) >= 2 and max(live) >= 4:
        assert spy.call_count > 0  # the first armed round at least was a tree


class OracleTrees:
    """A test drafter that knows the tiny target's greedy continuation and hides it behind a
    wrong first child at every depth, so accepted paths run through second children and
    the batch cache's columns really move."""

    tree_width = 1 << 30  # a tree per row at any width

    def __init__(self, target):
        self.runner, self.fed, self.last = ModelRunner(target.model), [], []

    def greedy(self, seq: list[int], n: int) -> list[int]:
        out = []
        for _ in range(n):
            logits = self.runner.forward(mx.array([seq + out], dtype=mx.int32), self.runner.make_cache())
            out.append(int(mx.argmax(logits[0, -1]).item()))
        return out

    def draft_trees(self, prev, pending, shape, choose, context=None) -> list[DraftTree]:
        self.last, trees = [], []
        depth = shape.depth
        for fed, p, y in zip(self.fed, prev.tolist(), pending.tolist()):
            fed += [p, y]
            right = self.greedy(fed, depth)
            tokens, parents, node = [y], [-1], 0
            for d in range(depth):  # node's children: a wrong token, then the right one
                tokens += [(right[d] + 1) % self.runner.vocab_size, right[d]]
                parents += [node, node]
                node = len(tokens) - 1
            self.last.append(tokens)
            trees.append(DraftTree(mx.array(tokens, dtype=mx.int32), TreeLayout.of_parents(parents)))
        return trees

    def commit_trees(self, paths, hidden=None) -> None:
        for fed, tokens, path in zip(self.fed, self.last, paths):
            if not path:
                fed.pop()
            else:
                fed += [tokens[n] for n in path[:-1]]

    def draft(self, prev, pending, k, choose, context=None):
        """Chains (a row left alone in the batch): the greedy continuation itself."""
        rows = []
        for fed, p, y in zip(self.fed, prev.tolist(), pending.tolist()):
            fed += [p, y]
            rows.append(self.greedy(fed, k))
            fed += rows[-1][:-1]
        tokens = mx.array(rows, dtype=mx.int32)  # [B, k]
        return tokens, mx.zeros((*tokens.shape, self.runner.vocab_size))

    def rollback(self, counts, hidden=None):
        for fed, c in zip(self.fed, counts):
            del fed[len(fed) - c:]

    def advance(self, tokens, hidden=None):
        for fed, token in zip(self.fed, tokens):
            fed.append(token)

    def add_rows(self, histories, hidden=None):
        self.fed += [list(h[:-2]) for h in histories]

    def filter(self, keep):
        self.fed = [self.fed[i] for i in keep]

    def reset(self):
        self.fed = []

    def cold_start(self, capture):
        self.reset()
        self.add_rows(capture.histories)

    def nbytes(self):
        return 0


def check_kv(target, checked: list):
    """After a round: each live row's KV in the batch cache equals a plain forward's."""
    def check(loop):
        live = [i for i, row in enumerate(loop.rows) if not row.request.finished]
        for i in live:
            assert_kv_equal(loop.kv.extract(i), plain_kv(target, held_tokens(loop.rows[i].request)))
        checked.append(len(live))
    return check


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_batched_tree_kv_equals_plain_kv_after_second_child_paths(tiny, layout):
    """After every round, each row's KV in the batch cache equals a plain forward of the
    tokens it holds, though every accepted node was a second child (columns moved)."""
    prompts = [[5, 9, 13, 5, 9, 17, 5, 9], [7, 21, 8, 7], [3, 3, 4, 11, 12, 40, 41, 2, 8]]
    runner = ModelRunner(tiny.model)
    oracle = OracleTrees(tiny)
    loop = BatchLoop(runner, oracle, layout=KVLayout(layout))
    requests = [make_request(tiny, p, max_tokens=n) for p, n in zip(prompts, (20, 14, 9))]
    for r in requests:
        loop.admit(r)
    loop.capture_round()
    accepted = []
    while loop.width:
        out = loop.spec_round(draft(3, TreeShape.parse("2,2,2") if loop.width >= 2 else None))
        accepted += out.verify.accepted if out.verify else []
        for i, row in enumerate(loop.rows):
            if not row.request.finished:
                assert_kv_equal(loop.kv.extract(i), plain_kv(tiny, held_tokens(row.request)))
        loop.reap()
    assert [r.tokens for r in requests] == [run_plain(tiny, p, max_tokens=n) for p, n in zip(prompts, (20, 14, 9))]
    assert max(accepted) == 3 and sum(accepted) >= 10  # deep second-child paths: columns 2, 4, 6 moved


def test_kv_check_catches_a_batch_compaction_that_only_trims(tiny, monkeypatch):
    """The batch KV test can fail: with compaction reduced to a trim, a row's KV differs."""
    import specbatch.kernels.loops.tree as tree_loop

    def trim_only(kv, roots, paths):
        kv.trim_rows([n - (r + len(p) + 1) for n, r, p in zip(kv.lengths(), roots, paths)])
    monkeypatch.setattr(tree_loop, "compact_rows", trim_only)
    runner = ModelRunner(tiny.model)
    loop = BatchLoop(runner, OracleTrees(tiny))
    requests = [make_request(tiny, p, max_tokens=8) for p in ([5, 9, 13, 5], [7, 21, 8, 7, 2])]
    for r in requests:
        loop.admit(r)
    loop.capture_round()
    assert loop.spec_round(draft(2, TreeShape.parse("2,2"))).verify.accepted == [2, 2]
    with pytest.raises(AssertionError):
        assert_kv_equal(loop.kv.extract(0), plain_kv(tiny, held_tokens(requests[0])))


@pytest.mark.parametrize("shape", ["2,2,1", "3,2,1@0.05"])
def test_mtp_batched_trees_equal_each_rows_own_tree(tiny, mtp_head, shape):
    """The MTP head's tree per row, drafted for the whole batch at once, equals the tree the
    row drafts alone (its own context and hidden state), static and dynamic."""
    runner = ModelRunner(tiny.model)
    loop = BatchLoop(runner, MTPDrafter(mtp_head, runner))
    for p in ([5, 9, 13, 5, 9, 17], [7, 21, 8], [3, 3, 4, 11, 12, 40, 41, 2, 8, 9]):
        loop.admit(make_request(tiny, p, max_tokens=20))
    loop.capture_round()
    tree = TreeShape.parse(shape)
    choose = top_chooser(greedy_rows(3), 0)
    prev, pending = mx.array([r.prev for r in loop.rows]), mx.array([r.pending for r in loop.rows])
    together = loop.drafter.draft_trees(prev, pending, tree, choose, context=loop.kv.layers)
    for i, got in enumerate(together):
        alone = MTPDrafter(mtp_head, runner)
        alone.hidden = loop.drafter.hidden[i:i + 1]
        want = alone.draft_tree(prev[i:i + 1], pending[i:i + 1], tree, top_chooser(greedy_rows(1), 0),
                                context=loop.kv.extract(i))
        assert got.layout == want.layout and got.tokens.tolist() == want.tokens.tolist()


@pytest.mark.parametrize("layout", ["dense", "paged"])
@pytest.mark.parametrize("shape", ["2,1,1", "3,2,1@0.02"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_mtp_batched_tree_streams_and_kv_on_tiny_models(tiny, mtp_head, layout, shape, temperature):
    prompts = [[5, 9, 13, 5, 9, 17, 5, 9], [7, 21, 8, 7, 21, 9], [3, 3, 4, 11]]
    params = [dict(max_tokens=n, temperature=temperature, seed=s) for n, s in ((18, 1), (12, 2), (7, 3))]
    checked = []
    with mock.patch.object(round_body, "tree_round", wraps=round_body.tree_round) as spy:
        got, rounds = run_batch(tiny, mtp_head, prompts, 3, params=params, kv_layout=layout,
                                tree=BatchTree(shape, max_width=3), check=check_kv(tiny, checked))
    assert got == [run_plain(tiny, p, **params[i]) for i, p in enumerate(prompts)]
    assert spy.call_count and sum(checked) > 0


def test_batch_tree_config_width_and_temperature_limits(fakes):
    """Trees only at widths 2 .. max_width and while no row is hotter than the limit;
    through the machine (preempt, gate, re-arm unchanged), every stream equals plain."""
    target, _ = fakes
    assert EngineConfig(batch_tree={"shape": "2,1", "max_width": 3}).drafts.batch_tree == BatchTree("2,1", 3)
    assert BatchTree.of(BatchTree("2,1", 3).to_json()) == BatchTree("2,1", 3)
    with pytest.raises(ValueError):
        BatchTree("2,1", max_width=1)
    config = EngineConfig(num_draft_tokens=3, speculative_width_cap=0, rearm_min_remaining=3, fixed_draft=True,
                          batch_tree=BatchTree("2,2", max_width=3, max_temperature=0.5))
    for temps in ([0.0, 0.0], [0.0] * 5, [0.0, 0.9, 0.0], [0.9, 0.0]):
        jobs = [([(7 * i) % 97 + 3, 5, 9, 5, 9], SamplingParams(max_tokens=10 + 3 * i, temperature=t, seed=i,
                                                                ignore_eos=True)) for i, t in enumerate(temps)]
        with mock.patch.object(round_body, "tree_round", wraps=round_body.tree_round) as spy:
            with new_core(target, NGramSource(512), config) as core:
                run, ids = drive(core, {0: jobs[:1], 1: jobs[1:]})
        for call in spy.call_args_list:  # (target, kv, drafter, pending, prev, rows, starts, shape)
            pending, rows = call.args[3], call.args[5]
            assert 2 <= len(pending) <= 3 and max(rows.temperature) <= 0.5, temps
        if temps == [0.0, 0.0]:
            assert spy.call_count > 0
        for (prompt, params), rid in zip(jobs, ids):
            assert run.tokens[rid] == run_plain(target, prompt, max_tokens=params.max_tokens,
                                                temperature=params.temperature, seed=params.seed,
                                                ignore_eos=True), temps


def test_pick_batch_tree_keeps_the_narrow_winner_while_it_wins():
    from specbatch.tools.calibrate_tree import pick_batch_tree

    def row(plain, chain, tree, other=0.0):
        return {"plain": {"tok_s": plain}, "chain k=1": {"tok_s": chain}, "tree 2,1": {"tok_s": tree},
                "tree 3,2,1@0.1": {"tok_s": other}}
    wins = {0.0: row(10, 12, 14), 0.7: row(10, 12, 12.1)}
    assert pick_batch_tree({2: wins, 4: {0.0: row(10, 12, 13)}}, 0.03) == BatchTree("2,1", 4, 0.0)
    assert pick_batch_tree({2: wins, 4: {0.0: row(10, 12, 12, 14)}}, 0.03) == BatchTree("2,1", 2, 0.0)  # another wins at 4
    assert pick_batch_tree({2: {0.0: row(10, 12, 12.2)}, 4: wins}, 0.03) is None  # within the margin at 2
    assert pick_batch_tree({}, 0.03) is None


def test_batch_tree_depth_raises_the_schedule_up_to_its_width_and_load_pair_reads_it(tmp_path, monkeypatch,
                                                                                     model_dir):
    import json

    from specbatch.kernels.calibration import machine_key, pair_key
    from specbatch.kernels.pair import load_pair
    from specbatch.runtime.schedule import Band, DraftSchedule
    from specbatch.tools.calibrate_tree import with_tree_depth
    schedule = DraftSchedule([1, 2, 4, 8], [Band(0.0, [1, 1, 1, 0]), Band(0.7, [0, 1, 1, 0])])
    raised = with_tree_depth(schedule, TreeShape([2, 1, 1]), 0.0, max_width=4)
    assert [b.k for b in raised.bands] == [(3, 3, 3, 0), (0, 1, 1, 0)]
    path = tmp_path / "calibration.json"
    entry = {"k": 1, "cap": 4, "batch_tree": {"shape": "3,2,1@0.1", "max_width": 2, "max_temperature": 0.0}}
    path.write_text(json.dumps({machine_key(): {pair_key(str(model_dir["llama"]), "ngram"): entry}}))
    monkeypatch.setenv("SPECBATCH_CALIBRATION", str(path))
    _, _, config = load_pair(str(model_dir["llama"]), drafter="ngram")
    assert config.drafts.batch_tree == BatchTree("3,2,1@0.1", 2, 0.0) and config.drafts.tree_shape is None


def test_a_tree_winner_must_win_again_on_fresh_prompts(monkeypatch):
    """``confirmed`` measures plain, the chain and the winner once more; the pick stands
    only if the winner still beats both by the margin."""
    import types

    import specbatch.tools.bench.tree as bench_tree
    from specbatch.tools.calibrate_tree import confirmed
    engines = {"plain": None, "chain k=1": None, "tree 2,1": None, "tree 4,1": None}
    seen = {}

    def fake_runs(chosen, prompts, tokens, t, repeats, width):
        seen["systems"], seen["width"] = sorted(chosen), width
        return {name: {"tok_s": speeds[name], "tokens_per_round": 1.0} for name in chosen}
    monkeypatch.setattr(bench_tree, "width_runs", fake_runs)
    args, table = types.SimpleNamespace(tokens=8, repeats=1, margin=0.03), {}
    speeds = {"plain": 10.0, "chain k=1": 12.0, "tree 2,1": 13.0}
    assert confirmed(engines, TreeShape.parse("2,1"), [], args, 2, table)
    assert seen == {"systems": ["chain k=1", "plain", "tree 2,1"], "width": 2} and "confirm T=0.0 width=2" in table
    speeds["tree 2,1"] = 12.1  # within the margin of the chain on the fresh prompts
    assert not confirmed(engines, TreeShape.parse("2,1"), [], args, 2, table)
