"""``specbatch bench``: the suites by name, run in one process, results and report written."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from ...kernels.pair import load_pair
from . import basic, http, kernels, long, memory, policy, prefix, serving, sharded, tree
from .harness import Context

SUITES = {"plain": basic.suite_plain, "scalar": basic.suite_scalar, "widths": basic.suite_widths,
          **serving.SUITES, **http.SUITES, "drafters": serving.suite_drafters, **sharded.SUITES,
          **memory.SUITES, **prefix.SUITES, **long.SUITES, **tree.SUITES, **kernels.SUITES, **policy.SUITES}


def machine() -> dict:
    import mlx.core as mx

    from ...blas import active_blas, blas_core
    from ...kernels import cpu
    kernels = cpu.status()
    return {"cpu_kernels": kernels.isa if kernels.active else f"off: {kernels.why}", "platform": platform.platform(), "cpus": os.cpu_count(), "device": str(mx.default_device()),
            "blas": active_blas(), "blas_core": blas_core(), "mlx": mx.__version__, "python": platform.python_version()}


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n== {title}")
    keys = list(dict.fromkeys(k for row in rows for k in row))
    print(" | ".join(keys))
    for row in rows:
        cells = (row.get(k, "") for k in keys)
        print(" | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in cells))


def chain_k(target, drafter) -> int | None:
    """The longest chain the pair's calibrated schedule drafts (trees raise the stored k to
    their depth; "always speculate" baselines draft chains of this)."""
    from ...kernels.calibration import lookup
    from ...runtime.schedule import DraftSchedule
    chains = lookup(target.name, drafter.name, "chain_schedule", DraftSchedule.from_json) if drafter else None
    return max(1, chains.max_k()) if chains is not None else None


def run_bench(args) -> int:
    if getattr(args, "report_from", None):
        from .report import merge, write_report
        paths = [Path(p) for p in args.report_from.split(",")]
        write_report(merge(paths), ", ".join(f"bench/results/{p.name}" for p in paths))
        return 0
    suites = SUITES
    target, drafter, config = load_pair(args.model, args.draft_model, dtype=args.dtype,
                                        speculative_width_cap=args.speculative_width_cap,
                                        num_draft_tokens=args.num_draft_tokens, drafter=args.drafter,
                                        prefill_chunk=getattr(args, "prefill_chunk", None),
                                        chunked_prefill=getattr(args, "chunked_prefill", True),
                                        **({"tree_shape": args.tree_shape} if getattr(args, "tree_shape", None) else {}))
    ctx = Context(target, drafter, config, [int(w) for w in args.widths.split(",")], args.tokens, args.repeats,
                  k=args.num_draft_tokens or chain_k(target, drafter))
    ctx.long_prompt_tokens, ctx.long_arrivals = args.long_prompt_tokens, args.long_arrivals
    results = {"machine": machine(), "target": target.name, "drafter": getattr(drafter, "name", None),
               "k": config.num_draft_tokens, "cap": config.speculative_width_cap, "suites": {}}
    try:
        for name in args.suite.split(","):
            if name not in suites:
                raise ValueError(f"unknown bench suite {name!r}; choose from {sorted(suites)}")
            try:
                results["suites"][name] = suites[name](ctx)
            except Exception as exc:  # one failing suite must not lose the others' results
                print(f"\n== {name} failed: {exc!r}")
                results.setdefault("failed", {})[name] = repr(exc)
                continue
            print_table(name, results["suites"][name]["rows"])
    finally:
        ctx.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"\nresults: {path}")
    if args.report:
        from .report import write_report
        write_report(results, path)
    return 0
