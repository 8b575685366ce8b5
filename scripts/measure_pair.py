"""Measure a target/drafter pair: step times (median of many) and their ratio.

Target decode step (1 row, 1 token), verify forward of 5 positions, drafter step; with
the context at 256 tokens. Writes JSON next to the pair when --out is given.
``--grid``: the target's forward of N positions per row at batch widths B, over its
single-position step at the same width (what a tree of N nodes per row costs in a batch).

    python -m specbatch.blas scripts/measure_pair.py --out src/specbatch/demo_models/speed.json
    python -m specbatch.blas scripts/measure_pair.py --grid --widths 1,2,4 --positions 1,2,3,5,8,12
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

from specbatch.kernels.models import demo_pair, load


def step_ms(model, n: int, context: int = 256, reps: int = 60, width: int = 1) -> float:
    cache = model.make_cache()
    mx.eval(model(mx.zeros((width, context), dtype=mx.int32) + 7, cache=cache))
    x = mx.zeros((width, n), dtype=mx.int32) + 11
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(model(x, cache=cache))
        times.append((time.perf_counter() - t0) * 1e3)
        for c in cache:
            c.trim(n)
    return statistics.median(times)


def grid(model, widths: list[int], positions: list[int], reps: int) -> dict:
    """``{width: {positions: ms, ...}}`` and each over the width's one-position step."""
    out = {}
    for w in widths:
        ms = {n: step_ms(model, n, reps=reps, width=w) for n in positions}
        out[w] = {"ms": ms, "over_step": {n: round(t / ms[positions[0]], 3) for n, t in ms.items()}}
        print(f"width {w}: " + ", ".join(f"N={n} {t:.1f} ms ({t / ms[positions[0]]:.2f}x)" for n, t in ms.items()),
              flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", action="store_true", help="positions x widths for the target only")
    ap.add_argument("--widths", default="1,2,4")
    ap.add_argument("--positions", default="1,2,3,5,8,12")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--target", default=None)
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    pair = demo_pair()
    if args.grid:
        out = grid(load(args.target or pair["target"]).model, [int(w) for w in args.widths.split(",")],
                   [int(n) for n in args.positions.split(",")], args.reps)
        if args.out:
            args.out.write_text(json.dumps(out, indent=1))
        return
    target, drafter = load(args.target or pair["target"]), load(args.drafter or pair["drafter"])
    count = lambda m: sum(v.size for _, v in __import__("mlx.utils").utils.tree_flatten(m.parameters()))  # noqa: E731
    out = {"target_params": count(target.model), "drafter_params": count(drafter.model),
           "target_step_ms": step_ms(target.model, 1), "target_verify5_ms": step_ms(target.model, 5),
           "drafter_step_ms": step_ms(drafter.model, 1)}
    out["cost_ratio"] = out["target_step_ms"] / out["drafter_step_ms"]
    out["verify5_over_step"] = out["target_verify5_ms"] / out["target_step_ms"]
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
