"""The round body both loops share: the first token after a prefill, and an armed round
(a chain or a tree per row) with its rollback or compaction.

The loops differ only in what they hand in: the scalar loop its ``SingleKV`` and coupled
(sampled) drafts, the batch loop its ``BatchKV`` and greedy drafts; per-row rollback and
compaction are the cache's own row edits either way. Afterwards every row's target KV
and drafter state hold its sequence but the new pending token (the bonus), as before the
round (vocabulary: ``verify``); a plain round's loop keeps the drafter there with
``follow_plain``.
"""

from __future__ import annotations

from ...runtime.policy import Decision
from ...runtime.request import Request
from ..runner import TargetRunner, prefill
from ..logprobs import sample_read
from ..sampling import RowSampling, positions_from
from .tree import tree_capable, tree_round
from .verify import RoundResult, bonus_hidden, last_hidden, spec_round


def first_token(target: TargetRunner, request: Request, cache: list, rows: RowSampling, logits=None, hidden=None):
    """Prefill ``request``'s prompt past what ``cache`` holds (nothing when ``logits`` ``[1, V]``
    says it is all in) and sample its first token: (token, its logprob or None, the target's
    hidden state at the last prompt token or None)."""
    if logits is None:
        have = cache[0].offset if cache[0].keys is not None else 0
        logits = prefill(target, request.prompt[have:], cache)  # [1, V]
        hidden = last_hidden(target)
    [[first]], [lps] = sample_read(logits[:, None, :], rows, positions_from([0], 1))
    return first, lps and lps[0], hidden


def speculate(target: TargetRunner, kv, drafter, pending: list[int], prev: list[int], rows: RowSampling,
              starts: list[int], decision: Decision, verify: str, coupled: bool) -> RoundResult:
    """One armed round over every row of ``kv`` as ``decision`` says (not plain): a tree per
    row where the drafter drafts them at this width and no row is penalized (a tree's node
    paths are not counted by penalties), else a chain of ``decision.k``."""
    if decision.tree is not None and tree_capable(drafter, len(pending)) and not rows.penalized:
        return tree_round(target, kv, drafter, pending, prev, rows, starts, decision.tree, coupled=coupled)
    k = decision.k
    result = spec_round(target, kv.layers, drafter, pending, prev, rows, starts, k, verify, coupled=coupled)
    back = [k - a for a in result.accepted]  # [B] rejected drafts per row
    kv.trim_rows(back)
    drafter.rollback(back, hidden=bonus_hidden(target, result.accepted))
    return result


def follow_plain(target: TargetRunner, drafter, passed: list[int]) -> None:
    """After a plain round (a token a row, nothing drafted) the drafter keeps the invariant
    too: it takes each row's ``passed`` token (its prev before the round) and the target
    state that predicted the new pending one."""
    drafter.advance(passed, hidden=last_hidden(target))


def advance(prev: int, pending: int, run: list[int]) -> tuple[int, int]:
    """A row's (prev, pending) after emitting ``run`` (t_0 .. t_a): the bonus is pending."""
    return (run[-2] if len(run) > 1 else pending), run[-1]
