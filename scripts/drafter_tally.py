"""Chain acceptance from per-start outcomes (numpy only: the CPU measurement and the GPU job
share it, and the accelerator machine has no MLX)."""

from __future__ import annotations

import numpy as np


def summarize(ok: np.ndarray, kinds) -> dict:
    """ok [P, K]: draft j of start p right (the chain continuing on the target's greedy tokens);
    kinds [P]: "chat" or "code". Per part: starts, acceptance per draft position (conditional
    on the earlier ones) and tokens per round tau(k) = 1 + E[accepted], k = 1..K."""
    kinds, K = np.asarray(kinds), ok.shape[1]
    out = {}
    for name, sel in [("all", np.ones(len(kinds), bool)), ("chat", kinds == "chat"), ("code", kinds == "code")]:
        run = np.cumprod(ok[sel], axis=1)
        cond = [float(run[:, j].sum() / max(1, (run[:, j - 1] if j else np.ones(len(run))).sum())) for j in range(K)]
        out[name] = {"starts": int(sel.sum()), "accept_by_position": [round(c, 3) for c in cond],
                     "tau_by_k": [round(1 + float(run[:, :k].sum(1).mean()), 3) for k in range(1, K + 1)]}
    return out
