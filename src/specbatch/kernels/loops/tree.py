"""A tree round for one row: draft a token tree, score every node in one target forward,
walk the accepted path, compact the row's KV (vocabulary: ``tree_shape`` and ``verify``).

Every node samples the target with the chain's coupled rule: node ``n`` at depth ``d``
draws with the noise of output position ``e + d`` (``e`` = tokens emitted before the
round), the same noise a plain decode of the path to ``n`` would draw there, so the
emitted run is the target's own stream whatever the tree held. Draft children are the
top ``b`` of the draft logits perturbed with that same noise (Gumbel top-k: the first is
exactly the chain's coupled draft), greedy rows the top ``b`` logits.
"""

from __future__ import annotations

import mlx.core as mx
import structlog

from ..logprobs import gather, read
from ..sampling import RowSampling, perturbed, sample
from ..tree_attention import compact
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


def tree_capable(target, drafter) -> bool:
    return hasattr(target, "forward_tree") and hasattr(drafter, "draft_tree")


def tree_round(target, cache: list, drafter, pending: int, prev: int, rows: RowSampling, start: int,
               shape: TreeShape) -> RoundResult:
    """One row's round over a ``shape`` tree; ``cache`` (single-sequence) ends holding the
    root and the accepted path, exactly, and the drafter is committed to the path."""
    tree = drafter.draft_tree(mx.array([prev], dtype=mx.int32), mx.array([pending], dtype=mx.int32),
                              shape, top_chooser(rows, start), context=cache)
    layout = tree.layout
    base = cache[0].offset  # the root's column and RoPE position
    depths = mx.array(layout.depths, dtype=mx.int32)[None]  # [1, N]
    visible = mx.array(layout.ancestry())  # [N, N]
    logits = target.forward_tree(tree.tokens[None], cache, base + depths, visible)  # [1, N, V]
    sampled = sample(logits, rows, start + depths)  # [1, N]: the target's token after each node
    [toks], [lps] = read(sampled, gather(logits, sampled, rows.logprobs), tree.tokens)  # the one sync
    path = walk(layout, tree.tokens.tolist(), toks)
    nodes = [0, *path]
    compact(cache, base, path)
    hidden = getattr(target, "hidden", None)  # [1, N, D]
    drafter.commit_tree(path, hidden=None if hidden is None else hidden[:, nodes[-1]])
    log.debug("tree_round", nodes=layout.size, depth=layout.depth, accepted=len(path))
    return RoundResult([[toks[n] for n in nodes]], [len(path)], layout.depth,
                       [None if lps is None else [lps[n] for n in nodes]])
