"""The target runner: the kernel every loop calls for target forwards.

A ``TargetRunner`` turns tokens ``[B, N]`` plus per-layer caches into logits
``[B, N, V]``. ``ModelRunner`` wraps any mlx-lm model; a test or another server can pass
its own object with the same two members.
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx
import mlx.nn as nn

PREFILL_CHUNK = 512  # bounds prefill activation memory on long prompts


class TargetRunner(Protocol):
    n_layers: int
    vocab_size: int

    def forward(self, tokens: mx.array, cache: list) -> mx.array:
        """Logits ``[B, N, V]`` for tokens ``[B, N]``; appends their KV to ``cache``."""
        ...

    def make_cache(self) -> list:
        """Fresh single-sequence caches, one per layer (mlx-lm ``KVCache``)."""
        ...


class ModelRunner:
    """``TargetRunner`` over an mlx-lm model."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.n_layers = len(model.layers)
        self.vocab_size = int(model.args.vocab_size)

    def forward(self, tokens: mx.array, cache: list) -> mx.array:
        return self.model(tokens, cache=cache)

    def make_cache(self) -> list:
        from mlx_lm.models.cache import KVCache
        return [KVCache() for _ in range(self.n_layers)]


def prefill(runner: TargetRunner, tokens: list[int], cache: list) -> mx.array:
    """Run ``tokens`` through the model in chunks; logits ``[1, V]`` of the last one."""
    logits = None
    for i in range(0, len(tokens), PREFILL_CHUNK):
        chunk = mx.array(tokens[i:i + PREFILL_CHUNK], dtype=mx.int32)[None]  # [1, n]
        logits = runner.forward(chunk, cache)[:, -1, :]
        mx.eval(logits, [c.keys for c in cache if getattr(c, "keys", None) is not None])
    return logits
