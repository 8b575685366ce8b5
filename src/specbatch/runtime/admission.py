"""How many waiters the next admission may take (pure): within max_batch rows, the KV
budget, and while rows decode, one prefill chunk of prompt tokens."""

from __future__ import annotations

import itertools


def room(live: list, joining: list, config, kernels) -> int:
    """Waiters (the leading ``joining``) the next admission may take: within max_batch
    rows, the KV budget (each row reserves its prompt, its budget and a verify's lookahead)
    and, while rows decode, one chunk of prompt tokens to prefill (at least one waiter)."""
    n = min(len(joining), config.max_batch - len(live))
    if live and config.prefill.chunked_prefill:  # prefix sums of the prompt tokens to prefill
        costs = itertools.accumulate(kernels.prefill_cost(r) for r in joining)
        n = min(n, max(1, sum(1 for c in costs if c <= config.prefill.prefill_chunk)))
    return len(within_budget(live, joining[:n], config, kernels.token_bytes))


def within_budget(live: list, waiters: list, config, per_token: int) -> list:
    """The leading ``waiters`` whose KV fits the budget beside ``live`` (each row reserves
    its prompt, its budget and a verify's lookahead); an idle engine still takes one.
    Prefill chunks start only for these: a partial prefill holds KV too."""
    budget, k = config.memory.kv_budget_bytes, config.num_draft_tokens
    if not budget or not per_token:
        return waiters
    need = sum(len(r.prompt) + r.params.max_tokens + k + 1 for r in live) * per_token
    for i, r in enumerate(waiters):
        need += (len(r.prompt) + r.params.max_tokens + k + 1) * per_token
        if need > budget:
            return waiters[:max(i, int(not live))]
    return waiters
