"""A tree round: draft a token tree per row, score every row's nodes in one target
forward, walk each row's accepted path, compact each row's KV (vocabulary: ``tree_shape``
and ``verify``). Rows' trees may differ (dynamic shapes): they are padded to the largest.

Every node samples the target with the chain's coupled rule: node ``n`` at depth ``d``
draws with the noise of output position ``e + d`` (``e`` = tokens emitted before the
round), the same noise a plain decode of the path to ``n`` would draw there, so the
emitted run is the target's own stream whatever the tree held. Draft children are the
top ``b`` of the draft logits perturbed with that same noise (Gumbel top-k: the first is
exactly the chain's coupled draft), greedy rows the top ``b`` logits. A batch drafts
greedily, as its chains do; its rows still emit the target's own streams.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import structlog

from ..drafters.base import DraftTree
from ..logprobs import gather, read
from ..runner import draft_states
from ..sampling import RowSampling, perturbed, sample
from ..tree_attention import compact_rows
from ...runtime.tree_shape import TreeShape, walk
from .verify import RoundResult

log = structlog.get_logger(__name__)


def top_chooser(rows: RowSampling, start: int):
    """``choose(logits [M, V], d, b) -> [M, b]``: children at depth ``d``, best first."""
    def choose(logits, d, b):
        M = logits.shape[0]
        pos = mx.full((1, M), start + d - 1, dtype=mx.int32)  # the chain's draft step j = d - 1
        scores = perturbed(logits[None], rows, pos)[0]  # [M, V]
        if b == 1:
            return mx.argmax(scores, axis=-1).astype(mx.int32)[:, None]
        top = mx.argpartition(-scores, b - 1, axis=-1)[:, :b]  # [M, b] unordered
        order = mx.argsort(-mx.take_along_axis(scores, top, -1), axis=-1)
        return mx.take_along_axis(top, order, -1).astype(mx.int32)
    return choose


def tree_capable(drafter, width: int = 1) -> bool:
    """The drafter drafts a tree per row for ``width`` rows."""
    return width <= drafter.tree_width


def greedy_rows(width: int) -> RowSampling:
    """Draft choices of a batch: greedy top-b children (the batch loop drafts greedily)."""
    return RowSampling([0] * width, [0.0] * width, [1.0] * width, [0] * width)


def pack(trees: list[DraftTree]) -> tuple[mx.array, mx.array, mx.array]:
    """Rows' trees padded to the largest: tokens ``[B, N]``, depths ``[B, N]``, visible
    ``[B, N, N]``; a padding node sees only itself and is on no row's path."""
    N = max(t.layout.size for t in trees)
    depths = np.ones((len(trees), N), dtype=np.int32)
    visible = np.zeros((len(trees), N, N), dtype=bool)
    visible[:, np.arange(N), np.arange(N)] = True
    for b, t in enumerate(trees):
        n = t.layout.size
        depths[b, :n] = t.layout.depths
        visible[b, :n, :n] = t.layout.ancestry()
    tokens = mx.stack([mx.pad(t.tokens, (0, N - t.layout.size)) for t in trees])
    return tokens.astype(mx.int32), mx.array(depths), mx.array(visible)


def tree_round(target, kv, drafter, pending: list[int], prev: list[int], rows: RowSampling, starts: list[int],
               shape: TreeShape, coupled: bool = True) -> RoundResult:
    """One round over a ``shape`` tree per row. ``kv``: the loop's cache (a ``SingleKV`` or
    a ``BatchKV``, dense or paged); it ends holding each row's root and accepted path,
    exactly, and the drafter is committed to the paths. Coupled (one row): children by the
    target's own noise; else greedy top-b."""
    B, layers = len(pending), kv.layers
    choose = top_chooser(rows, starts[0]) if coupled and B == 1 else top_chooser(greedy_rows(B), 0)
    trees = drafter.draft_trees(mx.array(prev, dtype=mx.int32), mx.array(pending, dtype=mx.int32), shape, choose,
                                context=layers)
    tokens, depths, visible = pack(trees)  # [B, N], [B, N], [B, N, N]
    roots = kv.lengths()  # the roots' RoPE positions
    logits = target.forward_tree(tokens, layers, mx.array(roots)[:, None] + depths, visible)  # [B, N, V]
    sampled = sample(logits, rows, mx.array(starts)[:, None] + depths)  # [B, N]: the target's token after each node
    toks, lps = read(sampled, gather(logits, sampled, rows.logprobs), tokens)  # the one sync
    drafted = tokens.tolist()
    paths = [walk(t.layout, drafted[b][:t.layout.size], toks[b]) for b, t in enumerate(trees)]
    compact_rows(kv, roots, paths)
    last = [p[-1] if p else 0 for p in paths]
    hidden = draft_states(target)  # [B, N, D] (or the kept layers')
    drafter.commit_trees(paths, hidden=None if hidden is None else hidden[mx.arange(B), mx.array(last)])
    nodes = [[0, *p] for p in paths]
    log.debug("tree_round", rows=B, nodes=[t.layout.size for t in trees], accepted=[len(p) for p in paths])
    return RoundResult([[toks[b][n] for n in ns] for b, ns in enumerate(nodes)], [len(p) for p in paths],
                       max(t.layout.depth for t in trees),
                       [None if lp is None else [lp[n] for n in ns] for lp, ns in zip(lps, nodes)])
