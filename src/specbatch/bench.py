"""``specbatch bench``: seeded workloads measured side by side, interleaved in one run.

The machines are shared and noisy, so every suite interleaves the systems it compares
(round-robin per repeat) and reports medians and their ratios, never one-off timings.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

from tqdm import tqdm

PROMPT_LEN = 32


def _prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    import random
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(PROMPT_LEN)] for _ in range(n)]


def _code_prompts(tokenizer, n: int) -> list[list[int]]:
    from .demo import PROMPTS
    return [list(tokenizer.encode(PROMPTS[i % len(PROMPTS)])) for i in range(n)]


def run_engine(engine, prompts, tokens: int, **params) -> float:
    """Tokens/s of ``engine`` decoding ``tokens`` per prompt, all submitted at once."""
    from . import SamplingParams
    sp = SamplingParams(max_tokens=tokens, ignore_eos=True, seed=0, **params)
    t0 = time.perf_counter()
    handles = [engine.submit(p, sp) for p in prompts]
    total = sum(h.result(timeout=3600).usage.completion_tokens for h in handles)
    return total / (time.perf_counter() - t0)


def run_mlx_lm_batch(model, prompts, tokens: int) -> float:
    """Tokens/s of mlx-lm's own ``BatchGenerator`` on the same prompts (greedy)."""
    from mlx_lm.generate import BatchGenerator
    gen = BatchGenerator(model, max_tokens=tokens, stop_tokens=[], completion_batch_size=max(32, len(prompts)),
                         prefill_batch_size=max(8, len(prompts)))
    t0 = time.perf_counter()
    gen.insert(prompts, [tokens] * len(prompts))
    total = 0
    while responses := gen.next_generated():
        total += sum(1 for r in responses if r.finish_reason != "stop")
    gen.close()
    return total / (time.perf_counter() - t0)


def plain_sweep(target, widths, tokens, repeats) -> dict:
    """Plain decode tokens/s at each width: our batch loop vs mlx-lm's BatchGenerator."""
    from .config import EngineConfig
    from .engine import Engine
    engine = Engine(target, None, EngineConfig(speculation=False))
    prompts = _code_prompts(target.tokenizer, max(widths))
    rows = []
    run_engine(engine, prompts[:2], 8)  # warm up both paths
    run_mlx_lm_batch(target.model, prompts[:2], 8)
    for width in tqdm(widths, desc="plain sweep", unit="width"):
        ours, theirs = [], []
        for _ in range(repeats):
            ours.append(run_engine(engine, prompts[:width], tokens))
            theirs.append(run_mlx_lm_batch(target.model, prompts[:width], tokens))
        o, t = statistics.median(ours), statistics.median(theirs)
        rows.append({"width": width, "specbatch_tok_s": o, "mlx_lm_tok_s": t, "ratio": o / t})
    engine.close()
    return {"suite": "plain", "tokens_per_request": tokens, "repeats": repeats, "rows": rows}


def machine() -> dict:
    import os

    import mlx.core as mx

    from .blas import active_blas
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "device": str(mx.default_device()),
            "blas": active_blas(), "mlx": mx.__version__}


def _print_table(result: dict) -> None:
    rows = result["rows"]
    keys = list(rows[0].keys())
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(f"{row[k]:.2f}" if isinstance(row[k], float) else str(row[k]) for k in keys))


def run_bench(args) -> int:
    from .config import load_pair
    target, drafter, config = load_pair(args.model, args.draft_model, dtype=args.dtype)
    widths = [int(w) for w in args.widths.split(",")]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"machine": machine(), "target": target.name, "drafter": drafter and drafter.name}
    for suite in args.suite.split(","):
        if suite == "plain":
            result = plain_sweep(target, widths, args.tokens, args.repeats)
        else:
            raise ValueError(f"unknown bench suite {suite!r}")
        results[suite] = result
        print(f"\n== {suite} ({target.name})")
        _print_table(result)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"bench-{stamp}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"\nresults: {path}")
    return 0
