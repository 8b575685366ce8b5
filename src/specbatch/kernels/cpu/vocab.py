"""A reduced vocabulary's logits over the whole vocabulary: an FR-Spec head projects onto its
kept rows of the output layer, and the samplers read full-vocabulary logits."""

from __future__ import annotations

import mlx.core as mx

from . import _active


def spread(values: mx.array, ids: mx.array, vocab: int) -> mx.array:
    """``[B, vocab]``: ``values`` ``[B, n]`` at columns ``ids`` ``[n]`` (distinct), -inf
    elsewhere. One kernel op on the CPU (MLX's scatter cost more than the linear that made the
    values); MLX's scatter elsewhere, with the same values."""
    ext = _active()
    if ext is not None and values.dtype == mx.float32 and values.ndim == 2 and ids.dtype == mx.int32:
        return ext.spread(values, ids, vocab)
    full = mx.full((values.shape[0], vocab), -mx.inf, dtype=values.dtype)
    full[:, ids] = values
    return full
