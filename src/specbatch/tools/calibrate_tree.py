"""Choosing the width-1 tree shape by measurement (``specbatch calibrate``, after the
draft-length schedule).

At width 1 plain decoding, the schedule's chain and each candidate tree decode the same
held-out chat prompts side by side (``bench_tree``), at each temperature. A tree is kept
only if it has the most tokens/s at temperature 0 and beats both plain and the chain by
``margin``; it serves requests up to the hottest temperature (in order) where it still
does. Wider batches keep chains: the batch loop verifies chains only.
"""

from __future__ import annotations

import attrs

from ..runtime.schedule import Band, DraftSchedule
from ..runtime.tree_shape import TreeShape

# static trees, and dynamic ones (``@s``: nodes whose drafted path score reaches s, within the bound)
CANDIDATES = "2,1;4,1;2,1,1;3,2,1@0.08;3,2,1@0.15;2,2,2@0.1;2,1,1,1@0.2"
TEMPERATURES = (0.0, 0.7)


def candidates(text: str, dynamic: bool = True) -> list[TreeShape]:
    """``"2,1,1;4,1"`` to shapes (chains dropped: the schedule measures those; dynamic
    shapes dropped unless the drafter prunes them, else it would draft the whole bound)."""
    shapes = [TreeShape.parse(part) for part in text.split(";") if part.strip()]
    return [s for s in shapes if not s.is_chain and (dynamic or not s.dynamic)]


def pick_tree(results: dict, margin: float) -> tuple[TreeShape | None, float | None]:
    """``results[T][system]["tok_s"]`` (systems ``plain``, ``chain k=..``, ``tree ..``) to
    (the winning shape or None, the hottest temperature it wins at)."""
    temps = sorted(results)
    if not temps:
        return None, None

    def wins(system: str, t: float) -> bool:
        got = results[t]
        rivals = [m["tok_s"] for name, m in got.items() if not name.startswith("tree ")]
        return got[system]["tok_s"] >= max(rivals) * (1 + margin)

    cold = results[temps[0]]
    best = max(cold, key=lambda name: cold[name]["tok_s"])
    if not best.startswith("tree ") or not wins(best, temps[0]):
        return None, None
    hottest = temps[0]
    for t in temps[1:]:
        if not wins(best, t):
            break
        hottest = t
    return TreeShape.parse(best[len("tree "):]), hottest


def with_tree_depth(schedule: DraftSchedule, shape: TreeShape, max_temperature: float) -> DraftSchedule:
    """The schedule with width 1 drafting at least the tree's depth in every band up to
    ``max_temperature`` (the engine cuts a tree to the round's draft length)."""
    bands = []
    for band in schedule.bands:
        k = list(band.k)
        if band.max_temperature <= max_temperature + 1e-9:
            k[0] = max(k[0], shape.depth)
        bands.append(Band(band.max_temperature, k))
    return attrs.evolve(schedule, bands=bands)


def measure_trees(target, drafter, config, schedule: DraftSchedule, args) -> tuple[TreeShape | None, float | None, dict]:
    """Measure plain, the schedule's width-1 chain and each candidate tree at width 1."""
    from .bench.tree import chat_prompts, systems, width1_runs
    k = schedule.draft_length(1, 0.0) or max(int(k) for k in args.draft_lengths.split(","))
    from ..kernels.drafters.mtp import MTPHead
    engines = systems(target, drafter, config, k, candidates(args.tree_shapes, isinstance(drafter, MTPHead)))
    prompts = chat_prompts(target.tokenizer, args.tree_prompts)
    results, table = {}, {}
    try:
        for t in TEMPERATURES:
            results[t] = width1_runs(engines, prompts, args.tokens, t, args.repeats)
            table[f"T={t} width=1"] = {name: {key: round(v, 3) for key, v in m.items()}
                                       for name, m in results[t].items()}
            print(f"T={t:.2f} width 1: " + ", ".join(f"{name} {m['tok_s']:.1f} ({m['tokens_per_round']:.2f}/round)"
                                                    for name, m in results[t].items()), flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    shape, hottest = pick_tree(results, args.margin)
    return shape, hottest, table
