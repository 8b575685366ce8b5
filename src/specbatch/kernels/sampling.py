"""The position-keyed sampler (a request's parameters are ``runtime.params``).

The randomness of output position ``p`` of a request is a pure function of
``(seed, p)``: Gumbel noise ``g[p]`` over the vocabulary from the key ``(seed, p)``.
The target's token at ``p`` is ``argmax(filter(logits_p) / T + g[p])`` (``T = 0``:
plain argmax). Every loop samples the target this way, so the emitted stream is the
target's own sampled stream whatever was drafted, by which loop, at which width.
"""

from __future__ import annotations

import attrs
import mlx.core as mx

from ..runtime.params import SamplingParams


def _key_words(seed: int) -> int:
    # Fold a 64-bit seed into 32 bits; the other key word is the position.
    return (seed ^ (seed >> 32)) & 0xFFFFFFFF


def position_noise(seeds: list[int], positions: mx.array, vocab: int) -> mx.array:
    """Gumbel noise keyed by (seed, position): ``[B, N, V]`` for positions ``[B, N]``."""
    B, N = positions.shape
    seed_col = mx.array([_key_words(s) for s in seeds], dtype=mx.uint32)[:, None]  # [B, 1]
    keys = mx.stack([mx.broadcast_to(seed_col, (B, N)), positions.astype(mx.uint32)], -1)
    draw = mx.vmap(lambda k: mx.random.gumbel(shape=(vocab,), key=k))
    return draw(keys.reshape(B * N, 2)).reshape(B, N, vocab)


def filter_logits(logits: mx.array, top_p: mx.array, top_k: mx.array) -> mx.array:
    """Mask logits outside each row's top-k / nucleus with -inf. logits [B, N, V]."""
    order = mx.argsort(-logits, axis=-1)  # [B, N, V]
    ranked = mx.take_along_axis(logits, order, axis=-1)
    probs = mx.softmax(ranked, axis=-1)
    before = mx.cumsum(probs, axis=-1) - probs  # mass strictly above each rank
    rank = mx.arange(logits.shape[-1])
    keep = before < top_p[:, None, None]
    keep = keep & ((top_k[:, None, None] == 0) | (rank < top_k[:, None, None]))
    kept = mx.where(keep, ranked, -mx.inf)
    out = mx.full(logits.shape, -mx.inf, dtype=logits.dtype)
    return mx.put_along_axis(out, order, kept, axis=-1)


@attrs.frozen
class RowSampling:
    """The sampling settings of B rows, as host lists (cheap to rebuild per round)."""

    seeds: list[int]
    temperature: list[float]
    top_p: list[float]
    top_k: list[int]
    logprobs: list[int | None] = attrs.field(factory=list)  # per row; None: not asked

    @classmethod
    def of(cls, params: list[SamplingParams]) -> "RowSampling":
        return cls([p.seed for p in params], [p.temperature for p in params],
                   [p.top_p for p in params], [p.top_k for p in params], [p.logprobs for p in params])

    @property
    def all_greedy(self) -> bool:
        return all(t == 0.0 for t in self.temperature)

    @property
    def filtered(self) -> bool:
        return any(p < 1.0 for p in self.top_p) or any(k > 0 for k in self.top_k)


def perturbed(logits: mx.array, rows: RowSampling, positions: mx.array) -> mx.array:
    """Scores whose argmax is the sampled token: filter(logits)/T + g[p]; [B, N, V].

    Greedy rows return the raw logits (argmax of them is the greedy token).
    """
    logits = logits.astype(mx.float32)
    if rows.all_greedy:
        return logits
    if rows.filtered:
        logits = filter_logits(logits, mx.array(rows.top_p), mx.array(rows.top_k))
    temp = mx.array(rows.temperature, dtype=mx.float32)[:, None, None]  # [B, 1, 1]
    noise = position_noise(rows.seeds, positions, logits.shape[-1])
    scored = logits / mx.maximum(temp, 1e-6) + noise
    return mx.where(temp > 0, scored, logits)


def sample(logits: mx.array, rows: RowSampling, positions: mx.array) -> mx.array:
    """Tokens ``[B, N]`` at output positions ``[B, N]``: a pure function of (logits, seed, p)."""
    return mx.argmax(perturbed(logits, rows, positions), axis=-1).astype(mx.int32)


def positions_from(starts: list[int], width: int) -> mx.array:
    """Output positions ``[B, width]`` starting at each row's next position."""
    return mx.array(starts, dtype=mx.int32)[:, None] + mx.arange(width, dtype=mx.int32)
