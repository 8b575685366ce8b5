"""The paged KV cache's kernels: attention over its pools read in place, a forward's tokens
written into a pool in place, and a pool grown with headroom that costs no memory until written."""

from __future__ import annotations

import mlx.core as mx

from . import _NO_MASK, _active


def paged_attention(queries: mx.array, view, scale: float, mask, merge_heads: bool = False) -> mx.array | None:
    """:func:`attention` over a paged cache read in place: ``view`` is (key pool, value pool
    ``[P, Hkv * D]``, slots int32 ``[B, T]``). None where the kernel does not apply (the
    caller attends over the gathered view instead)."""
    ext = _active()
    k_pool, v_pool, slots = view
    kind = "" if mask is None else mask if isinstance(mask, str) else "array"
    if (ext is None or queries.dtype != mx.float32 or k_pool.dtype != mx.float32 or queries.ndim != 4
            or queries.shape[-1] > 256 or kind not in ("", "causal", "array")
            or (kind == "array" and (mask.dtype != mx.bool_ or mask.ndim != 4 or mask.shape[1] != 1))):
        return None
    if kind == "array" and mask.shape[2:] != (queries.shape[2], slots.shape[1]):
        mask = mx.broadcast_to(mask, (mask.shape[0], 1, queries.shape[2], slots.shape[1]))
    return ext.paged_attention(queries, k_pool, v_pool, slots, scale, kind, mask if kind == "array" else _NO_MASK,
                               merge_heads)


def paged_write(pool: mx.array, slots: mx.array, rows: mx.array, blocked: bool = False) -> mx.array | None:
    """The pool ``[H, P, D]`` with ``rows`` ``[B, H, N, D]`` stored at ``slots`` int32
    ``[B * N]`` (``blocked``: a key pool's 16-slot blocks, ``kv_pool``), as one op writing in
    place once the caller drops its old pool; None where the kernel does not apply (the caller
    scatters with MLX's ops: the same bits)."""
    ext = _active()
    if (ext is None or rows.ndim != 4 or slots.dtype != mx.int32 or pool.dtype != mx.float32
            or rows.dtype != mx.float32):
        return None
    return ext.paged_write(pool, slots, rows, blocked)


def pool_reserve(pool: mx.array, axis: int, slots: int, keep: int) -> mx.array | None:
    """``pool`` with ``slots`` along its slot axis ``axis``: each outer index's first ``keep``
    slots copied, the rest zero pages that take memory only once written (``reserve.h``);
    None where the kernel does not apply (the caller pads with MLX's zeros)."""
    ext = _active()
    if ext is None:
        return None
    return ext.pool_reserve(mx.contiguous(pool), axis, slots, keep)
