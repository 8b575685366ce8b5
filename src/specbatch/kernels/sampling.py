"""The position-keyed sampler (a request's parameters are ``runtime.params``).

The randomness of output position ``p`` of a request is a pure function of
``(seed, p)``: Gumbel noise ``g[p]`` over the vocabulary from the key ``(seed, p)``.
The target's token at ``p`` is ``argmax(filter(logits_p) / T + g[p])`` (``T = 0``:
plain argmax). Every loop samples the target this way, so the emitted stream is the
target's own sampled stream whatever was drafted, by which loop, at which width.

``logit_bias`` and the presence / frequency penalties (OpenAI's) change the logits first,
the same way at every position: ``l + bias - f * c - p * (c > 0)`` where ``c`` counts the
tokens the request generated before that position. A verify block's position ``j``
counts the row's emitted tokens plus the first ``j`` drafts (the ones it follows), so a
speculative stream still equals plain decoding.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np

from ..runtime.params import SamplingParams
from . import cpu


def _key_words(seed: int) -> int:
    # Fold a 64-bit seed into 32 bits; the other key word is the position.
    return (seed ^ (seed >> 32)) & 0xFFFFFFFF


def _seed_words(seeds: list[int | None]) -> mx.array:
    # a greedy row may carry no seed: its noise is never read
    return mx.array([_key_words(s or 0) for s in seeds], dtype=mx.uint32)  # [B]


def position_noise(seeds: list[int], positions: mx.array, vocab: int) -> mx.array:
    """Gumbel noise keyed by (seed, position): ``[B, N, V]`` for positions ``[B, N]``; each
    element a pure function of (seed, position, token) (``cpu.gumbel``'s hash)."""
    return cpu.gumbel(_seed_words(seeds), positions.astype(mx.int32), vocab)


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
    bias: list[tuple] = attrs.field(factory=list)  # per row: (token id, bias) pairs
    presence: list[float] = attrs.field(factory=list)
    frequency: list[float] = attrs.field(factory=list)
    # per row: its emitted tokens, the request's own live list (read when a block is
    # sampled, so a RowSampling cached across rounds stays current)
    history: list[list[int]] = attrs.field(factory=list)

    @classmethod
    def of(cls, params: list[SamplingParams], history: list[list[int]] | None = None) -> "RowSampling":
        return cls([p.seed for p in params], [p.temperature for p in params],
                   [p.top_p for p in params], [p.top_k for p in params], [p.logprobs for p in params],
                   [p.logit_bias for p in params], [p.presence_penalty for p in params],
                   [p.frequency_penalty for p in params], history or [[] for _ in params])

    @property
    def penalized(self) -> bool:
        return any(self.presence) or any(self.frequency)

    @property
    def all_greedy(self) -> bool:
        return all(t == 0.0 for t in self.temperature)

    @property
    def filtered(self) -> bool:
        return any(p < 1.0 for p in self.top_p) or any(k > 0 for k in self.top_k)


def _counts(rows: RowSampling, drafted: mx.array | None, n: int, vocab: int) -> mx.array:
    """Tokens generated before each of a block's ``n`` positions, per id: ``[B, n, V]``.
    ``drafted [B, D]``: tokens past each row's history, the block's last position after
    all of them (a verify block: position j follows the first j drafts)."""
    host = np.zeros((len(rows.history), vocab), dtype=np.float32)
    for b, tokens in enumerate(rows.history):
        if tokens:
            host[b] = np.bincount(np.asarray(tokens), minlength=vocab)[:vocab]
    counts = mx.array(host)[:, None, :]  # [B, 1, V]
    if drafted is None or drafted.shape[1] == 0:
        return counts
    d = drafted.shape[1]
    onehot = (drafted[..., None] == mx.arange(vocab)).astype(mx.float32)  # [B, D, V]
    run = mx.concatenate([mx.zeros_like(onehot[:, :1]), mx.cumsum(onehot, axis=1)], axis=1)  # [B, D+1, V]
    seen = mx.array([min(max(j + d - n + 1, 0), d) for j in range(n)])  # drafts before position j
    return counts + run[:, seen]


def adjusted(logits: mx.array, rows: RowSampling, drafted: mx.array | None = None) -> mx.array:
    """``logits [B, N, V]`` with each row's logit bias and penalties (a no-op without any)."""
    if not rows.penalized and not any(rows.bias):
        return logits
    B, N, V = logits.shape
    if any(rows.bias):
        host = np.zeros((B, V), dtype=np.float32)
        for b, pairs in enumerate(rows.bias):
            for token, value in pairs:
                if token < V:
                    host[b, token] = value
        logits = logits + mx.array(host)[:, None, :]
    if rows.penalized:
        counts = _counts(rows, drafted, N, V)  # [B, N, V]
        freq = mx.array(rows.frequency, dtype=mx.float32)[:, None, None]
        pres = mx.array(rows.presence, dtype=mx.float32)[:, None, None]
        logits = logits - freq * counts - pres * (counts > 0).astype(mx.float32)
    return logits


def _prepared(logits: mx.array, rows: RowSampling, drafted: mx.array | None) -> mx.array:
    """The logits the noise is added to: adjusted, then filtered (sampled rows only)."""
    logits = adjusted(logits.astype(mx.float32), rows, drafted)
    if rows.filtered and not rows.all_greedy:
        logits = filter_logits(logits, mx.array(rows.top_p), mx.array(rows.top_k))
    return logits


def perturbed(logits: mx.array, rows: RowSampling, positions: mx.array,
              drafted: mx.array | None = None) -> mx.array:
    """Scores whose argmax is the sampled token: filter(adjusted logits)/T + g[p]; [B, N, V].

    Greedy rows return the adjusted logits (argmax of them is the greedy token).
    """
    return _scores(_prepared(logits, rows, drafted), rows, positions)


def _scores(logits: mx.array, rows: RowSampling, positions: mx.array) -> mx.array:
    if rows.all_greedy:
        return logits
    temp = mx.array(rows.temperature, dtype=mx.float32)[:, None, None]  # [B, 1, 1]
    noise = position_noise(rows.seeds, positions, logits.shape[-1])
    scored = logits / mx.maximum(temp, 1e-6) + noise
    return mx.where(temp > 0, scored, logits)


def sample(logits: mx.array, rows: RowSampling, positions: mx.array,
           drafted: mx.array | None = None) -> mx.array:
    """Tokens ``[B, N]`` at output positions ``[B, N]``: a pure function of (logits, seed, p)
    (and, with penalties, of the tokens before p: ``drafted``, see ``_counts``). On the CPU
    kernels one op (``cpu.sample_tokens``: the same tokens as the argmax of ``perturbed``,
    without its three ``[B, N, V]`` arrays)."""
    prepared = _prepared(logits, rows, drafted)
    temps = mx.array(rows.temperature, dtype=mx.float32)  # [B]
    fast = cpu.sample_tokens(prepared, temps, _seed_words(rows.seeds), positions.astype(mx.int32))
    if fast is not None:
        return fast
    return mx.argmax(_scores(prepared, rows, positions), axis=-1).astype(mx.int32)


def positions_from(starts: list[int], width: int) -> mx.array:
    """Output positions ``[B, width]`` starting at each row's next position."""
    return mx.array(starts, dtype=mx.int32)[:, None] + mx.arange(width, dtype=mx.int32)
