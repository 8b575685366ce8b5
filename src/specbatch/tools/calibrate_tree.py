"""Choosing tree shapes by measurement (``specbatch calibrate``, after the
draft-length schedule).

At width 1 plain decoding, the schedule's chain and each candidate tree decode the same
held-out chat prompts side by side (``bench_tree``), at each temperature. A tree is kept
only if it has the most tokens/s at temperature 0 and beats both plain and the chain by
``margin``; it serves requests up to the hottest temperature (in order) where it still
does. Batches of 2 and 4 (where the schedule speculates) are measured the same way, a
tree per row against chains: a tree that wins at the narrowest serves batches up to the
widest width where it still wins (``BatchTree``); elsewhere batches draft chains. A
winner is kept only if it wins again on fresh prompts against plain and the chain.
"""

from __future__ import annotations

import attrs

from ..runtime.schedule import Band, DraftSchedule
from ..runtime.tree_shape import BatchTree, TreeShape

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


def pick_batch_tree(by_width: dict, margin: float) -> BatchTree | None:
    """``by_width[w]``: ``pick_tree``'s results at batch width ``w``. The tree that wins at
    the narrowest width, kept up to the widest consecutive width where it still wins."""
    widths = sorted(by_width)
    shape, hottest = pick_tree(by_width[widths[0]], margin) if widths else (None, None)
    if shape is None:
        return None
    top = widths[0]
    for w in widths[1:]:
        if pick_tree(by_width[w], margin)[0] != shape:
            break
        top = w
    return BatchTree(shape, max_width=top, max_temperature=hottest)


def with_tree_depth(schedule: DraftSchedule, shape: TreeShape, max_temperature: float,
                    max_width: int = 1) -> DraftSchedule:
    """The schedule with widths up to ``max_width`` drafting at least the tree's depth in
    every band up to ``max_temperature`` (the engine cuts a tree to the round's draft length)."""
    bands = []
    for band in schedule.bands:
        k = list(band.k)
        if band.max_temperature <= max_temperature + 1e-9:
            k = [max(kw, shape.depth) if w <= max_width else kw for w, kw in zip(schedule.widths, k)]
        bands.append(Band(band.max_temperature, k))
    return attrs.evolve(schedule, bands=bands)


def measure_trees(target, drafter, config, schedule: DraftSchedule, args) -> tuple:
    """Plain, the schedule's width-1 chain and each candidate tree, at width 1 and at each
    batch width where the schedule speculates (a tree per row, for drafters that draft
    one). Returns (width-1 shape or None, its hottest temperature, a ``BatchTree`` or
    None, the table of what was measured)."""
    from ..kernels.drafters.mtp import MTPHead
    from ..kernels.drafters.ngram import NGramSource
    from .bench.tree import BATCH_WIDTHS, chat_prompts, systems, width_runs
    k = schedule.draft_length(1, 0.0) or max(int(k) for k in args.draft_lengths.split(","))
    engines = systems(target, drafter, config, k, candidates(args.tree_shapes, isinstance(drafter, MTPHead)))
    batched = isinstance(drafter, (MTPHead, NGramSource))
    widths = [1] + [w for w in BATCH_WIDTHS if batched and schedule.draft_length(w, 0.0) > 0]
    n = max(args.tree_prompts, *widths)
    prompts = chat_prompts(target.tokenizer, 2 * n)  # the second half confirms a winner
    results, table = {w: {} for w in widths}, {}
    try:
        for w in widths:
            for t in TEMPERATURES:
                got = results[w][t] = width_runs(engines, prompts[:n], args.tokens, t, args.repeats, w)
                table[f"T={t} width={w}"] = _rounded(got)
                _show(f"T={t:.2f} width {w}", got)
        shape, hottest = pick_tree(results[1], args.margin)
        batch = pick_batch_tree({w: r for w, r in results.items() if w > 1}, args.margin)
        if shape is not None and not confirmed(engines, shape, prompts[n:], args, 1, table):
            shape = hottest = None
        if batch is not None and not confirmed(engines, batch.shape, prompts[n:], args, min(widths[1:]), table):
            batch = None
    finally:
        for engine in engines.values():
            engine.close()
    return shape, hottest, batch, table


def confirmed(engines: dict, shape: TreeShape, prompts, args, width: int, table: dict) -> bool:
    """The winner measured again on fresh prompts against plain and the chain (T = 0): a
    pick among many candidates is biased upward (a 4-prompt pick lost on 20 others)."""
    from .bench.tree import width_runs
    names = ["plain", *[name for name in engines if name.startswith("chain ")], f"tree {shape}"]
    got = width_runs({name: engines[name] for name in names}, prompts, args.tokens, 0.0, args.repeats, width)
    table[f"confirm T=0.0 width={width}"] = _rounded(got)
    _show(f"confirm width {width}", got)
    return pick_tree({0.0: got}, args.margin)[0] == shape


def _rounded(got: dict) -> dict:
    return {name: {key: round(v, 3) for key, v in m.items()} for name, m in got.items()}


def _show(title: str, got: dict) -> None:
    print(f"{title}: " + ", ".join(f"{name} {m['tok_s']:.1f} ({m['tokens_per_round']:.2f}/round)"
                                  for name, m in got.items()), flush=True)
