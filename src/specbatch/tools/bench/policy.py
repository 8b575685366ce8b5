"""``bench --suite policy``: does the speculation policy earn its keep?

A mixed workload the calibration never saw (held-out chat questions and code completions
together, rows alternating temperature 0 and 0.7) at each width (narrower than four: four
rows, ``width`` at a time), decoded by: plain, every
fixed chain length k = 1..6 speculating at every width (no gate), and the engine as
shipped (the policy over the stored calibration). Per width: each choice's tokens/s side
by side, the best fixed choice in hindsight, and the policy against it, against plain and
against the chain the stored schedule names for the batch's hottest temperature (what
the engine decoded before the policy).
"""

from __future__ import annotations

import statistics
import time

from tqdm import tqdm

from ...runtime.params import SamplingParams
from .. import workload

FIXED_K = (1, 2, 3, 4, 5, 6)
TEMPERATURES = (0.0, 0.7)  # row i decodes at TEMPERATURES[i % 2]


def held_out_prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` prompts from the questions calibration does not measure (the second dozen)
    and the code completions, alternating."""
    return workload.prompts(tokenizer, n, workload.QUESTIONS[12:])


ROWS_PER_WIDTH = 4  # narrow widths decode this many rows, a batch of ``width`` after another


def mixed_tok_s(engine, prompts: list[list[int]], width: int, tokens: int) -> float:
    """Tokens/s of ``engine`` decoding ``tokens`` per prompt, ``width`` rows at a time (one
    batch after another), rows at mixed temperatures. A width-1 figure over one prompt at
    one temperature said more about that prompt than about the policy."""
    t0, total = time.perf_counter(), 0
    for start in range(0, len(prompts), width):
        handles = [engine.submit(p, SamplingParams(max_tokens=tokens, ignore_eos=True, seed=i,
                                                   temperature=TEMPERATURES[i % len(TEMPERATURES)]))
                   for i, p in enumerate(prompts[start:start + width], start)]
        total += sum(h.result(timeout=3600).usage.completion_tokens for h in handles)
    return total / (time.perf_counter() - t0)


def _engines(ctx) -> dict:
    widest = max(ctx.widths)
    engines = {"plain": ctx.engine(speculation=False)}
    for k in FIXED_K:  # speculating at every width: the gate's cap above the widest
        engines[f"k={k}"] = ctx.engine(**ctx.always(num_draft_tokens=k, speculative_width_cap=widest))
    engines["policy"] = ctx.engine()
    return engines


def _schedule_choice(ctx, width: int) -> str | None:
    """The fixed choice the stored schedule makes at ``width`` for these rows, if stored."""
    from ...kernels.calibration import lookup
    from ...runtime.schedule import DraftSchedule
    drafter = getattr(ctx.drafter, "name", None)
    schedule = lookup(ctx.target.name, drafter, "schedule", DraftSchedule.from_json) if drafter else None
    if schedule is None:
        return None
    k = schedule.draft_length(width, max(TEMPERATURES))
    return "plain" if k == 0 else f"k={k}" if k in FIXED_K else None


def suite_policy(ctx) -> dict:
    engines = _engines(ctx)
    prompts = held_out_prompts(ctx.target.tokenizer, max(max(ctx.widths), ROWS_PER_WIDTH))
    rows = []
    for width in tqdm(ctx.widths, desc="policy", unit="width"):
        samples = {name: [] for name in engines}
        batch = prompts[:max(width, ROWS_PER_WIDTH)]
        for _ in range(ctx.repeats):  # round-robin: the choices share each moment's noise
            for name, engine in engines.items():
                samples[name].append(mixed_tok_s(engine, batch, width, ctx.tokens))
        tok_s = {name: statistics.median(v) for name, v in samples.items()}
        fixed = {name: v for name, v in tok_s.items() if name != "policy"}
        best = max(fixed, key=fixed.get)
        row = {"width": width, **{f"{name}_tok_s": v for name, v in tok_s.items()},
               "best_fixed": best, "policy_vs_best": tok_s["policy"] / fixed[best],
               "policy_vs_plain": tok_s["policy"] / tok_s["plain"]}
        scheduled = _schedule_choice(ctx, width)
        if scheduled is not None:
            row.update(schedule_choice=scheduled, policy_vs_schedule=tok_s["policy"] / fixed[scheduled])
        rows.append(row)
    return {"temperatures": list(TEMPERATURES), "rows": rows}


SUITES = {"policy": suite_policy}
