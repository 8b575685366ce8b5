"""Half-stored weights: half the bytes a decode step streams, the same bits out.

A float32 weight matrix whose every value is a float16 value loses nothing stored as
float16. F16 checkpoints are such, and so are quantized ones dequantized by mlx-lm (two
rounded float16 operations, ``q * scale``, then ``+ bias``, before the cast to float32): the
embedded target's 4-bit linears and 8-bit embedding where the block kernel does not run
(``blocks``: where it does, they hold float32 values and are read as their blocks).
The small-M kernels widen float16 weights to float32 as they read them (F16C's conversion is
exact) and then do the same float32 arithmetic in the same order, so every sum, and every
row's bits, are the float32 matrix's, while a decode step, which streams every weight once,
reads half the bytes.

Only a matrix the check finds exact is stored so (``store_half``); any other stays float32,
and ``SPECBATCH_HALF_WEIGHTS=0`` keeps every one float32. MLX's own ops (the fallback, a
prefill on the BLAS) widen the weight first: float16 promotes to float32 exactly too.

Vocabulary: *exact* means ``float32(float16(w)) == w`` for every element.
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx
import structlog
from mlx.utils import tree_flatten

from .scoped import Scoped

log = structlog.get_logger(__name__)

ENV = "SPECBATCH_HALF_WEIGHTS"
_kept = Scoped(False)  # inside `float32_kept()` on this thread


@functools.lru_cache(maxsize=None)
def supported(ext) -> bool:
    """Whether ``ext``'s linears take float16 weights on this CPU (F16C)."""
    return ext is not None and bool(ext.half_weights())


def weight_ok(ext, weight: mx.array) -> bool:
    """Whether the kernels take ``weight``: float32, or float16 where the CPU widens it."""
    return weight.dtype == mx.float32 or (weight.dtype == mx.float16 and supported(ext))


def widened(weight: mx.array) -> mx.array:
    """``weight`` as float32 (itself where it already is): what MLX's ops should multiply."""
    return weight if weight.dtype == mx.float32 else weight.astype(mx.float32)


def exact_half(weight: mx.array) -> mx.array | None:
    """``weight`` stored as float16 where every value survives the round trip, else None."""
    if weight.dtype != mx.float32:
        return None
    half = weight.astype(mx.float16)
    if not mx.array_equal(half.astype(mx.float32), weight).item():
        return None
    mx.eval(half)
    return half


def enabled(ext) -> bool:
    return os.environ.get(ENV, "1") != "0" and not _kept.get() and supported(ext)


def float32_kept():
    """Models loaded inside this block keep float32 weights (a baseline run on MLX's own ops,
    which would widen a float16 weight again at every call)."""
    return _kept.within(True)


def half_stored(model) -> bool:
    """Whether ``model`` holds float16 weights beside float32 ones (what ``store_half`` leaves)."""
    dtypes = {p.dtype for _, p in tree_flatten(model.parameters())}
    return mx.float16 in dtypes and mx.float32 in dtypes


def store_half(ext, modules) -> int:
    """Give each of ``modules`` (swapped linears and embeddings) its weight as float16 where
    that is exact; returns how many were changed (none where ``enabled`` says no)."""
    if not enabled(ext):
        return 0
    changed = saved = 0
    for module in modules:
        half = exact_half(module["weight"])
        if half is None:
            continue
        saved += half.nbytes
        module["weight"] = half
        changed += 1
    if changed:
        log.info("half_weights", matrices=changed, of=len(modules), saved_mb=round(saved / 2**20, 1))
    return changed
