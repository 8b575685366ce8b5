"""Scoring a token tree in one forward of an unmodified mlx-lm model, and compacting its KV.

Two things differ from a causal forward of ``N`` new tokens:
- positions: node ``n`` sits at RoPE position ``base + depth(n)``, not ``base + n``.
  ``NodeRoPE`` stands in for each attention layer's ``rope`` during the forward: it moves
  the ``N`` nodes into the batch axis (``[B, H, N, D] -> [B*N, H, 1, D]``) so that
  ``mx.fast.rope``'s per-row offsets give every node its own position;
- the mask: ``TreeCache`` wraps a layer's cache for the forward; its ``make_mask`` lets a
  node see the row's committed KV and, among the tree's columns, itself and its ancestors.

The nodes' keys/values are appended to the real cache as usual (columns ``base .. base +
N - 1``); after the walk, ``compact`` moves the accepted path's columns to consecutive
positions and trims the rest, so the cache holds what a plain decode of the same tokens
would have written.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache


def _rows(cache) -> tuple[list[int], list[int]]:
    """Per-row ``[start, end)`` of a single-sequence ``KVCache`` or a ragged cache."""
    if isinstance(cache, KVCache):
        return [0], [cache.offset]
    return list(cache.starts), list(cache.ends)


def tree_mask(starts: list[int], ends: list[int], n: int, visible: mx.array) -> mx.array:
    """``[B, 1, n, C]`` for ``n`` new columns per row after ``ends`` (C = max end + n).

    ``visible`` ``[n, W]`` or, one tree per row, ``[B, n, W]`` (bool): which of the row's
    last ``W`` columns after the update (the tree's region, ``W >= n``) each new query
    sees; every column before the region, from the row's start, is committed and seen."""
    B, W = len(ends), visible.shape[-1]
    C = max(ends) + n
    cols = mx.arange(C)[None]  # [1, C]
    region = mx.array([e + n - W for e in ends])[:, None]  # [B, 1]
    rel = cols - region  # [B, C]
    committed = (cols >= mx.array(starts)[:, None]) & (rel < 0)  # [B, C]
    in_tree = (rel >= 0) & (rel < W)
    per_row = mx.broadcast_to(visible, (B, n, W))
    idx = mx.broadcast_to(mx.clip(rel, 0, W - 1)[:, None], (B, n, C))
    seen = mx.take_along_axis(per_row, idx, axis=2) & in_tree[:, None]  # [B, n, C]
    return (committed[:, None] | seen)[:, None]


class TreeCache:
    """A layer's cache during one tree forward: appends as the cache does, masks as a tree."""

    def __init__(self, inner, visible: mx.array, positions: mx.array):
        self.inner, self.visible = inner, visible
        self.positions = positions  # [B, N]: each node's RoPE position (the fake model reads it)

    @property
    def offset(self):
        return self.inner.offset

    @property
    def keys(self):
        return self.inner.keys

    def update_and_fetch(self, keys, values):
        return self.inner.update_and_fetch(keys, values)

    def paged_view(self):
        view = getattr(self.inner, "paged_view", None)  # a paged cache is read in place here too
        return view() if view is not None else None

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **_):
        if window_size is not None:
            raise NotImplementedError("tree verification does not support sliding windows")
        starts, ends = _rows(self.inner)
        return tree_mask(starts, ends, N, self.visible)


class NodeRoPE(nn.Module):
    """A layer's RoPE at explicit per-node positions ``[B, N]`` (the offset is ignored)."""

    def __init__(self, inner, positions: mx.array):
        super().__init__()
        self.inner, self.positions = inner, positions

    def __call__(self, x, offset=0):
        at = getattr(self.inner, "rope_at", None)  # the CPU kernel takes [B, N] positions as they are
        out = at(x, self.positions.astype(mx.int32)) if at is not None else None
        if out is not None:
            return out
        B, H, N, D = x.shape  # [B, H, N, D]
        flat = x.transpose(0, 2, 1, 3).reshape(B * N, H, 1, D)  # nodes into the batch axis
        out = self.inner(flat, offset=self.positions.reshape(-1).astype(mx.int32))
        return out.reshape(B, N, H, D).transpose(0, 2, 1, 3)


@contextlib.contextmanager
def node_positions(model, positions: mx.array):
    """Every attention layer of ``model`` ropes at ``positions`` ``[B, N]`` inside."""
    attns = [getattr(layer, "self_attn", None) for layer in getattr(model, "layers", [])]
    attns = [a for a in attns if a is not None and hasattr(a, "rope")]
    saved = [a.rope for a in attns]
    for attn in attns:
        attn.rope = NodeRoPE(attn.rope, positions)
    try:
        yield
    finally:
        for attn, rope in zip(attns, saved):
            attn.rope = rope


def tree_call(call, model, tokens: mx.array, cache: list, positions: mx.array, visible: mx.array):
    """``call(tokens, wrapped caches)`` under node positions and the tree mask.

    tokens, positions: ``[B, N]``; visible: ``[N, W]`` bool (see ``tree_mask``)."""
    wrapped = [TreeCache(c, visible, positions) for c in cache]
    with node_positions(model, positions):
        return call(tokens, wrapped)


def path_moves(roots: list[int], paths: list[list[int]]) -> tuple[list[int], list[int], list[int]]:
    """(row, from, to) token positions of the accepted nodes that move: row b's node ``p``
    at depth ``i`` of its path goes from ``roots[b] + p`` to ``roots[b] + i``."""
    moves = [(b, root + p, root + i) for b, (root, path) in enumerate(zip(roots, paths))
             for i, p in enumerate(path, 1) if p != i]
    return [m[0] for m in moves], [m[1] for m in moves], [m[2] for m in moves]


def compact_rows(kv, roots: list[int], paths: list[list[int]]) -> None:
    """``compact`` for a batch cache (``BatchKV``, dense or paged) after a tree forward of
    the same ``N`` columns per row: row b keeps its root (token position ``roots[b]``) and
    its path, moved to follow the root, and ends at ``roots[b] + len(paths[b]) + 1``."""
    rows, src, dst = path_moves(roots, paths)
    if rows:
        kv.move_tokens(rows, src, dst)
    kv.trim_rows([n - (root + len(path) + 1) for n, root, path in zip(kv.lengths(), roots, paths)])


def compact(cache: list, root: int, path: list[int]) -> None:
    """Keep columns ``root`` and ``root + p`` for ``p`` in ``path``, moved to ``root + 1 ..``,
    and trim the single-sequence ``cache`` to ``root + len(path) + 1`` columns."""
    a = len(path)
    moved = [p for i, p in enumerate(path, 1) if p != i]
    for c in cache:
        if moved and c.keys is not None and c.keys.ndim == 4:
            idx = mx.array([root + p for p in path])  # [a]
            k_path, v_path = c.keys[..., idx, :], c.values[..., idx, :]
            c.keys[..., root + 1:root + 1 + a, :] = k_path
            c.values[..., root + 1:root + 1 + a, :] = v_path
        c.offset = root + a + 1
