"""One speculative round, shared by both loops: draft, verify, accept.

Vocabulary, per row of a round:
- *drafted*: the ``k`` tokens the drafter proposed, ``d_1 .. d_k``;
- *target tokens*: ``t_0 .. t_k``, the target's own sample at output positions
  ``e .. e+k`` (``e`` = tokens emitted before the round) from one verify forward of
  ``[pending, d_1 .. d_k]``;
- *accepted* ``a``: the length of the leading run with ``d_{i+1} == t_i``;
- *bonus*: ``t_a``, the first target token beyond the accepted run; the round *emits*
  ``t_0 .. t_a`` (``a + 1`` tokens) and the next round starts from the bonus.

Coupled mode (default) samples drafts and target with the same position-keyed noise, so
the emitted stream is the target's own whatever was drafted. Rejection mode (Leviathan et
al.) accepts ``d`` with probability ``min(1, p/q)`` and resamples the residual: higher
acceptance at temperature, but the output depends on the drafts.
"""

from __future__ import annotations

import contextlib

import attrs
import mlx.core as mx

from ...runtime.params import TokenLogprob
from ..cpu import narrowed
from ..logprobs import gather, read
from ..runner import draft_states
from ..sampling import RowSampling, adjusted, filter_logits, position_noise, positions_from, sample

# Other key streams of a seed for rejection mode, so they never reuse the target's noise.
DRAFT_STREAM, ACCEPT_STREAM, RESIDUAL_STREAM = 0x5EED0001, 0x5EED0002, 0x5EED0003


@attrs.frozen
class RoundResult:
    """Host-side outcome of one round: what each row emits, and its accepted count."""

    emitted: list[list[int]]  # per row: t_0 .. t_a
    accepted: list[int]
    drafted: int
    logprobs: list[list[TokenLogprob] | None] = attrs.field(factory=list)  # per row, as emitted; None: not asked
    lookup: bool = False  # drafted by prompt lookup (drafters/lookup.py), not by the drafter the policy prices

    def row_logprobs(self, i: int) -> list:
        """Row ``i``'s logprobs parallel to its emitted run (Nones where it did not ask)."""
        got = self.logprobs[i] if self.logprobs else None
        return got if got is not None else [None] * len(self.emitted[i])


def greedy_chooser():
    return lambda logits, j: mx.argmax(logits, axis=-1).astype(mx.int32)


def coupled_chooser(rows: RowSampling, starts: list[int]):
    """Draft step j samples with the target's own noise at position start + j."""
    def choose(logits, j):
        pos = positions_from([s + j for s in starts], 1)
        return sample(logits[:, None, :], rows, pos)[:, 0]
    return choose


def rejection_chooser(rows: RowSampling, starts: list[int]):
    """Draft step j samples q with a stream of its own (independent of the target's)."""
    draft_rows = attrs.evolve(rows, seeds=[s ^ DRAFT_STREAM for s in rows.seeds])
    return coupled_chooser(draft_rows, starts)


def _accept_exact(drafts: mx.array, target: mx.array) -> mx.array:
    """Leading-run length of drafts [B, k] matching target [B, k+1]: [B]."""
    k = drafts.shape[1]
    hit = (drafts == target[:, :k]).astype(mx.int32)
    return mx.cumprod(hit, axis=1).sum(axis=1)


def verify_coupled(target_logits, drafts, rows: RowSampling, starts: list[int]):
    """Target tokens [B, k+1] and accepted [B] (lazy) under exact-match verification."""
    k1 = target_logits.shape[1]
    tokens = sample(target_logits, rows, positions_from(starts, k1), drafts)
    return tokens, _accept_exact(drafts, tokens)


def _probs(logits, rows: RowSampling, drafted=None):
    """Sampling distribution per position after bias, penalties, filters and temperature:
    [B, N, V] (drafts were chosen with their row's history alone: ``drafted`` None)."""
    logits = adjusted(logits.astype(mx.float32), rows, drafted)
    if rows.filtered:
        logits = filter_logits(logits, mx.array(rows.top_p), mx.array(rows.top_k))
    temp = mx.maximum(mx.array(rows.temperature, dtype=mx.float32), 1e-6)[:, None, None]
    return mx.softmax(logits / temp, axis=-1)


def verify_rejection(target_logits, draft_logits, drafts, rows: RowSampling, starts: list[int]):
    """Leviathan verification; rows at temperature 0 reduce to exact match."""
    B, k1, V = target_logits.shape
    k = k1 - 1
    p = _probs(target_logits, rows, drafts)  # [B, k+1, V]
    q = _probs(draft_logits, rows)  # [B, k, V]
    pd = mx.take_along_axis(p[:, :k], drafts[..., None], -1)[..., 0]  # [B, k]
    qd = mx.take_along_axis(q, drafts[..., None], -1)[..., 0]
    seeds_u = [s ^ ACCEPT_STREAM for s in rows.seeds]
    u = mx.exp(-mx.exp(-position_noise(seeds_u, positions_from(starts, k), 1)[..., 0]))  # Gumbel CDF: U(0,1)
    ok = (u * qd < pd).astype(mx.int32)
    accepted = mx.cumprod(ok, axis=1).sum(axis=1)  # [B]
    # Residual max(0, p - q) at the first rejection; plain p after a full run.
    q_pad = mx.concatenate([q, mx.zeros((B, 1, V))], axis=1)
    resid = mx.maximum(p - q_pad, 0.0)
    idx = accepted[:, None, None]
    r = mx.take_along_axis(resid, idx, 1)[:, 0]  # [B, V]
    r = mx.where(r.sum(-1, keepdims=True) > 0, r, mx.take_along_axis(p, idx, 1)[:, 0])
    g = position_noise([s ^ RESIDUAL_STREAM for s in rows.seeds], positions_from(starts, 1) + accepted[:, None], V)
    bonus = mx.argmax(mx.log(r) + g[:, 0], axis=-1).astype(mx.int32)  # [B]
    cols = mx.arange(k1)[None]
    drafts_pad = mx.concatenate([drafts, mx.zeros((B, 1), dtype=drafts.dtype)], axis=1)
    tokens = mx.where(cols < idx[:, :, 0], drafts_pad, bonus[:, None])  # [B, k+1]
    greedy = mx.array([t == 0.0 for t in rows.temperature])[:, None]
    exact_tokens, exact_acc = verify_coupled(target_logits, drafts, rows, starts)
    return (mx.where(greedy, exact_tokens, tokens),
            mx.where(greedy[:, 0], exact_acc, accepted))


def read_round(tokens: mx.array, accepted: mx.array, drafted: int, lazy=None) -> RoundResult:
    """The one host sync of a round: emitted runs, accepted counts and (rows that asked)
    logprobs, computed for all ``k+1`` positions and cut to the emitted run here."""
    toks, lps = read(tokens, lazy, accepted)
    acc = accepted.tolist()
    return RoundResult([row[:a + 1] for row, a in zip(toks, acc)], acc, drafted,
                       [None if lp is None else lp[:a + 1] for lp, a in zip(lps, acc)])


def spec_round(target, target_cache: list, drafter, pending: list[int], prev: list[int],
               rows: RowSampling, starts: list[int], k: int, mode: str, coupled: bool) -> RoundResult:
    """Draft ``k`` per row, verify ``[pending, drafts]`` in one target forward, accept.

    The caller rolls both caches back by ``k - accepted`` per row afterwards.
    """
    pend = mx.array(pending, dtype=mx.int32)  # [B]
    rejection = mode == "rejection" and not rows.all_greedy
    if rejection:
        choose = rejection_chooser(rows, starts)
    elif coupled:
        choose = coupled_chooser(rows, starts)
    else:
        choose = greedy_chooser()
    # a drafter that asks computes its drafts on one core while this thread builds the verify
    # (one process, interleaved, the MTP head's rounds at k = 1 / 2: 0.95 / 0.97x the time)
    overlap = getattr(drafter, "draft_on_one_core", False)
    with narrowed() if overlap else contextlib.nullcontext():
        drafts, draft_logits = drafter.draft(mx.array(prev, dtype=mx.int32), pend, k, choose,
                                             context=target_cache)  # [B, k]
        if overlap:
            mx.async_eval(drafts, draft_logits)
        logits = target.forward(mx.concatenate([pend[:, None], drafts], axis=1), target_cache)  # [B, k+1, V]
        if rejection:
            tokens, accepted = verify_rejection(logits, draft_logits, drafts, rows, starts)
        else:
            tokens, accepted = verify_coupled(logits, drafts, rows, starts)
        lazy = gather(logits, tokens, rows.logprobs)  # the target's, never the drafter's
    return read_round(tokens, accepted, k, lazy)


def bonus_hidden(runner, accepted: list[int]) -> mx.array | None:
    """The target state that predicted each row's bonus token: ``[B, D]`` (or the kept
    layers' ``[B, n * D]``, ``draft_states``)."""
    hidden = draft_states(runner)  # [B, k+1, D] from the verify forward
    if hidden is None:
        return None
    return hidden[mx.arange(len(accepted)), mx.array(accepted)]


def last_hidden(runner) -> mx.array | None:
    """``[B, D]`` (or ``[B, n * D]``): the drafter's state at the last position of the runner's latest forward."""
    hidden = draft_states(runner)
    return None if hidden is None else hidden[:, -1]
