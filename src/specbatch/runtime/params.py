"""What a caller asks of a request (``SamplingParams``) and the per-token log-probability
it gets back (``TokenLogprob``): plain data, validated at construction, no MLX."""

from __future__ import annotations

import math
import secrets

import attrs

INT32_MAX = (1 << 31) - 1
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's chat API
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
BIAS_RANGE, PENALTY_RANGE = 100.0, 2.0  # |logit_bias| <= 100, |presence / frequency penalty| <= 2


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


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    """``{token id: bias}`` (ids as ints or decimal strings, as JSON keys) -> sorted pairs."""
    pairs = value.items() if isinstance(value, dict) else (value or ())
    out = []
    for token, bias in pairs:
        if isinstance(token, str) and token.strip().isdigit():
            token = int(token)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise TypeError(f"logit_bias keys must be token ids (non-negative integers), got {token!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -BIAS_RANGE <= bias <= BIAS_RANGE:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r}")
        out.append((token, float(bias)))
    if len(out) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias holds {len(out)} entries; at most {MAX_LOGIT_BIAS}")
    return tuple(sorted(dict(out).items()))


def _penalty(inst, attr, value):
    _number(inst, attr, value)
    if not -PENALTY_RANGE <= value <= PENALTY_RANGE:
        raise ValueError(f"{attr.name} must be in [-2, 2], got {value}")


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
    # OpenAI's logits processors, applied to the target's logits before temperature and
    # top-p at every position (kernels/sampling.py): a bias per token id, and penalties on
    # the tokens this request generated before that position (counts; presence: once).
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_logit_bias)
    presence_penalty: float = attrs.field(default=0.0, validator=_penalty)
    frequency_penalty: float = attrs.field(default=0.0, validator=_penalty)

    def with_seed(self) -> "SamplingParams":
        """A copy with a concrete seed: unseeded requests get one recorded on them."""
        if self.seed is not None:
            return self
        return attrs.evolve(self, seed=secrets.randbits(32))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Its logits depend on the tokens before each position (not only on the model's)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@attrs.frozen
class TokenLogprob:
    """One emitted token: its id, its logprob, and the ``N`` most likely (id, logprob)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # most likely first
