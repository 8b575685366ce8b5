"""Sampling parameters and the position-keyed sampler.

The randomness of output position ``p`` of a request is a pure function of
``(seed, p)``: Gumbel noise ``g[p]`` over the vocabulary from the key ``(seed, p)``.
The target's token at ``p`` is ``argmax(filter(logits_p) / T + g[p])`` (``T = 0``:
plain argmax). Every loop samples the target this way, so the emitted stream is the
target's own sampled stream whatever was drafted, by which loop, at which width.
"""

from __future__ import annotations

import math
import secrets

import attrs
import mlx.core as mx


INT32_MAX = (1 << 31) - 1
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's chat API


def _non_negative(inst, attr, value):
    if value < 0:
        raise ValueError(f"{attr.name} must be >= 0, got {value}")


def _int_like(inst, attr, value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise TypeError(f"{attr.name} must be an integer, got {value!r}")


def _top_p_range(inst, attr, value):
    if not 0.0 < value <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {value}")


def _max_tokens(inst, attr, value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"max_tokens must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"max_tokens must be >= 1, got {value}")


def _number(inst, attr, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{attr.name} must be a number, got {value!r}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int past float range
        finite = False
    if not finite:  # NaN passes every range check; a NaN temperature decoded greedily
        raise ValueError(f"{attr.name} must be a finite number, got {value!r}")


def _int32(inst, attr, value):
    if value is not None and value > INT32_MAX:  # it reaches mx.array: past int32 the row dtypes clash
        raise ValueError(f"{attr.name} must be <= {INT32_MAX}, got {value}")


def _logprobs(inst, attr, value):
    if value is None:
        return
    _int_like(inst, attr, value)
    if not 0 <= value <= MAX_LOGPROBS:
        raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {value}")


def _stops(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    out = tuple(value)
    if not all(isinstance(s, str) and s for s in out):
        raise TypeError("stop must be a non-empty string or a list of non-empty strings")
    return out


def _stop_ids(value) -> tuple[int, ...]:
    out = tuple(value or ())
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in out):
        raise TypeError("stop_token_ids must be a list of non-negative integers")
    return out


@attrs.frozen(kw_only=True)
class SamplingParams:
    """What one request asks for; validated at construction (bad input fails here)."""

    max_tokens: int = attrs.field(default=256, validator=_max_tokens)
    temperature: float = attrs.field(default=0.0, validator=[_number, _non_negative])
    top_p: float = attrs.field(default=1.0, validator=[_number, _top_p_range])
    top_k: int = attrs.field(default=0, validator=[_int_like, _non_negative, _int32])
    seed: int | None = attrs.field(default=None, validator=_int_like)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stops)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_stop_ids)
    ignore_eos: bool = False  # benchmarks: decode exactly max_tokens
    # None: off. N: each emitted token's logprob and the N most likely alternatives, from
    # the target's raw logits (log_softmax before temperature / top-p / top-k, as vLLM's
    # default "raw" mode) at that position; see logprobs.py.
    logprobs: int | None = attrs.field(default=None, validator=_logprobs)

    def with_seed(self) -> "SamplingParams":
        """A copy with a concrete seed: unseeded requests get one recorded on them."""
        if self.seed is not None:
            return self
        return attrs.evolve(self, seed=secrets.randbits(32))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
