"""``specbatch calibrate``: measures the draft-length schedule per pair and machine (tokens/s
plain and at each draft length, per width and temperature band, side by side) and stores it
in the calibration file (``kernels.calibration``); the prefill chunk comes from
``calibrate_prefill``."""

from __future__ import annotations

import statistics

import attrs

from ..kernels.calibration import acceptance_bands, acceptance_by_position, derive_prior, lookup, pair_key, store, store_fields, store_key
from ..runtime.schedule import Band, DraftSchedule
from .bench.harness import Context, acceptance, code_prompts, core_tok_s
from .calibrate_cost import cells_from, fit_cost, measure_forwards, timed_rounds
from .calibrate_prefill import calibrate_prefill
from .calibrate_tree import measure_trees, with_tree_depth

TEMPERATURES = (0.0, 0.7, 1.0)
DRAFT_LENGTHS = (1, 2, 3, 4, 6)
CELL_PROMPTS = 4  # prompts a cell decodes per repeat at least: a width-1 cell of one prompt read noise


def best_k(speeds: dict[int, float], margin: float = 0.03) -> int:
    """The draft length with the most tokens/s (``speeds[0]``: plain); it must beat plain
    by ``margin``, else 0 (decode plain)."""
    k = max(speeds, key=speeds.get)
    return k if k and speeds[k] >= speeds[0] * (1 + margin) else 0


def cell_batches(prompts: list, width: int, repeat: int) -> list[list]:
    """The batches of ``width`` prompts that one repeat of a cell decodes in turn: at least
    CELL_PROMPTS prompts in all, another slice of the workload each repeat (the workload
    alternates chat and code, so a width-1 cell sees both)."""
    n = -(-CELL_PROMPTS // width)
    first = repeat * n * width
    return [[prompts[(first + b * width + i) % len(prompts)] for i in range(width)] for b in range(n)]


def measure_schedule(ctx, prompts, args) -> tuple[DraftSchedule, dict]:
    """For each temperature and width: tokens/s plain and at each draft length (side by
    side, medians of ``args.repeats``, each over ``cell_batches``); the schedule takes each
    cell's best k, end to end. Widths past two losing widths in a row are not measured (they
    take the last measured k, 0). The table's ``decode`` holds each cell's rate decoding
    alone (prefill and admission left out), which the cost model is fitted to."""
    widths = [int(w) for w in args.widths.split(",")]
    ks = [int(k) for k in args.draft_lengths.split(",")]
    cores = {0: ctx.core(speculation=False)}
    # the drafter's own rounds: prompt lookup would draft some of them and skew their prices
    cores.update({k: ctx.core(speculative_width_cap=0, num_draft_tokens=k, fixed_draft=True, max_spec_temperature=None,
                              prompt_lookup=0) for k in ks})
    bands, table, decode, cell_acceptance = [], {}, {}, {}
    for t in TEMPERATURES:
        row, losing = [], 0
        for width in widths:
            if losing >= 2:
                break
            key = f"T={t} width={width}"
            speeds, alone, accepted = measure_cell(cores, prompts, width, t, args)
            row.append(best_k(speeds, args.margin))
            losing = losing + 1 if row[-1] == 0 else 0
            table[key] = {str(k): round(v, 2) for k, v in speeds.items()}
            decode[key] = {str(k): round(v, 2) for k, v in alone.items()}
            cell_acceptance[key] = {str(k): round(v, 4) for k, v in accepted.items() if k}
            print(f"T={t:.2f} width {width:3d}: " + ", ".join(f"k={k} {v:.1f}" for k, v in speeds.items())
                  + " tok/s (decoding alone " + ", ".join(f"{v:.1f}" for v in alone.values())
                  + f") -> k={row[-1]}", flush=True)
        row += [0] * (len(widths) - len(row))
        if bands:  # acceptance only falls with temperature: a hotter band never drafts more
            row = [min(k, colder) for k, colder in zip(row, bands[-1].k)]
        bands.append(Band(t, row))
    deepest = cores[max(ks)].stats().get("acceptance_histogram") or {}
    table["acceptance"] = acceptance_by_position(deepest, max(ks))
    table["cell_acceptance"] = cell_acceptance
    table["decode"] = decode
    return DraftSchedule(widths, bands), table


def measure_cell(cores: dict, prompts, width: int, temperature: float, args) -> tuple[dict, dict, dict]:
    """One cell, every core in turn within each repeat (they share each moment's noise):
    medians by k of tokens/s end to end, decoding alone, and acceptance."""
    speeds, alone, accepted = {}, {}, {}
    for r in range(args.repeats):
        for k, core in cores.items():
            before = core.stats()
            runs = [core_tok_s(core, batch, args.tokens, temperature) for batch in cell_batches(prompts, width, r)]
            # every batch decodes width x tokens: the harmonic mean is the cell's tokens over its time
            speeds.setdefault(k, []).append(statistics.harmonic_mean([run.tok_s for run in runs]))
            alone.setdefault(k, []).append(statistics.harmonic_mean([run.decode_tok_s for run in runs]))
            accepted.setdefault(k, []).append(acceptance(before, core.stats()) if k else 0.0)
    return tuple({k: statistics.median(v) for k, v in d.items()} for d in (speeds, alone, accepted))


def run_calibrate(args) -> int:
    """``--measure``: the prefill chunk (target only), the draft-length schedule (and the
    trees after it), the trees alone (on the stored schedule), or all of it."""
    from ..kernels.pair import load_pair

    measure = getattr(args, "measure", "all")
    target, drafter, config = load_pair(args.model, args.draft_model, dtype=args.dtype, drafter=args.drafter,
                                        num_draft_tokens=max(int(k) for k in args.draft_lengths.split(",")),
                                        speculative_width_cap=0,
                                        speculation=measure != "prefill",
                                        tree_shape=None, batch_tree=None)  # the schedule is measured on chains
    if measure in ("all", "prefill"):
        calibrate_prefill(target, args)
        if measure == "prefill":
            return 0
    if drafter is None:
        raise ValueError("calibration needs a drafter")
    if measure == "trees":
        schedule = lookup(target.name, drafter.name, "chain_schedule", DraftSchedule.from_json) or \
            lookup(target.name, drafter.name, "schedule", DraftSchedule.from_json)
        if schedule is None:
            raise ValueError("no stored schedule for this pair: run `specbatch calibrate --measure schedule` first")
        table = None
    else:
        widths = [int(w) for w in args.widths.split(",")]
        ctx = Context(target, drafter, config, widths, args.tokens, args.repeats)
        try:
            schedule, table = measure_schedule(ctx, code_prompts(target.tokenizer, max(widths)), args)
        finally:
            ctx.close()
    chains, extra = schedule, {"chain_schedule": schedule.to_json()}
    if getattr(args, "tree_shapes", ""):
        schedule, trees = calibrate_trees(target, drafter, config, schedule, args)
        extra.update(trees)
    if table is None:  # trees alone: the stored schedule's measurements stay
        path = store_fields(target.name, drafter.name, {"schedule": schedule.to_json(), "cap": schedule.cap(),
                                                        "k": max(1, schedule.max_k()), **extra})
    else:
        extra.update(policy_fields(target, table))
        path = store(target.name, drafter.name, schedule, table, extra)
    print(f"schedule {schedule.to_json()} (chains: {chains.to_json()}), cap = {schedule.cap()}; written to {path} "
          f"for {store_key()} / {pair_key(target.name, drafter.name)}")
    if schedule.max_k() == 0:
        print("speculation does not pay for this pair here: it will decode plain")
    return 0


def policy_fields(target, table: dict) -> dict:
    """The policy's prior from ``measure_schedule``'s table (which keeps its tokens/s end to
    end): the cost model (forwards as timed, rounds decoding alone as timed, the rest
    fitted) and the acceptance by position."""
    by_position, by_cell, decode = table.pop("acceptance"), table.pop("cell_acceptance"), table.pop("decode")
    prior = derive_prior({"measured_tok_s": table}, lookup(target.name, None, "", dict) or {})
    forwards = measure_forwards(target.model)
    cells = cells_from(decode, by_cell)
    cost = fit_cost(cells, forwards) or prior.cost
    cost = attrs.evolve(cost, rounds=timed_rounds(cells))  # what was timed prices itself
    print(f"cost model: {cost.to_json()}")
    return {"cost": cost.to_json(), "acceptance": by_position or list(prior.acceptance), "cell_acceptance": by_cell,
            "acceptance_bands": acceptance_bands(by_cell), "decode_tok_s": decode}


def calibrate_trees(target, drafter, config, schedule: DraftSchedule, args) -> tuple[DraftSchedule, dict]:
    """The measured trees (width 1, batches) and the schedule raised to their depths."""
    shape, hottest, batch, measured = measure_trees(target, drafter, config, schedule, args)
    if shape is not None:
        schedule = with_tree_depth(schedule, shape, hottest)
    if batch is not None:
        schedule = with_tree_depth(schedule, batch.shape, batch.max_temperature, batch.max_width)
    print(f"width-1 tree: {shape or 'chain'}" + (f" up to T={hottest}" if shape else ""))
    print(f"batch tree: {batch.to_json() if batch else 'chains'}")
    return schedule, {"tree": None if shape is None else str(shape), "tree_max_temperature": hottest,
                      "batch_tree": None if batch is None else batch.to_json(), "tree_measured": measured}
