"""A deterministic fake model: exact, fast kernels for property tests of the scheduler.

Its logits at a position depend on the current token and the position the cache says it
is at, so a loop that mis-tracks a row's KV offset (a wrong trim, a lost row) emits a
different stream. ``skew`` perturbs a drafter copy so acceptance is partial.
"""

from __future__ import annotations

import attrs
import mlx.core as mx


@attrs.frozen
class FakeArgs:
    vocab_size: int
    max_position_embeddings: int = 4096


class FakeModel:
    """Stands in for an mlx-lm model: ``model(tokens [B, N], cache) -> logits [B, N, V]``."""

    def __init__(self, vocab: int = 512, skew: float = 0.0, salt: int = 0):
        self.args = FakeArgs(vocab)
        self.layers = [None]
        self.model_type = "fake"
        self.skew, self.salt = skew, salt
        self._basis = mx.arange(vocab, dtype=mx.float32)  # [V]
        mx.eval(self._basis)  # lazy arrays belong to their thread's stream: evaluate here

    def make_cache(self):
        from mlx_lm.models.cache import KVCache
        return [KVCache()]

    def __call__(self, tokens: mx.array, cache=None) -> mx.array:
        B, N = tokens.shape
        offset = cache[0].offset if cache else 0
        start = offset[:, None] if isinstance(offset, mx.array) else mx.full((B, 1), offset)
        pos = (start + mx.arange(N)[None]).astype(mx.float32)  # [B, N]
        nodes = getattr(cache[0], "positions", None) if cache else None
        if nodes is not None:  # a tree forward (tree_attention.TreeCache): per-node positions
            pos = nodes.astype(mx.float32)
        if cache:
            zeros = mx.zeros((B, 1, N, 1))
            cache[0].update_and_fetch(zeros, zeros)
        t = tokens.astype(mx.float32)[..., None]  # [B, N, 1]
        v = self._basis[None, None]
        phase = t * 12.9898 + pos[..., None] * 78.233 + v * 37.719
        logits = 4.0 * mx.sin(phase) + 3.0 * mx.cos(v * 0.61 + t * 0.37)  # [B, N, V]
        if self.skew:
            logits = logits + self.skew * mx.sin(phase * 1.7 + self.salt)
        return logits

    def parameters(self):
        return {}
