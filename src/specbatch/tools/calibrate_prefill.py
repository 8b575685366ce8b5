"""``specbatch calibrate`` for the prefill chunk: time per chunk against chunk size on the
target, and the rule that picks one.

A long arrival prefills one chunk between two of the live rows' rounds, so a live
stream's inter-token gap while it arrives is about one chunk plus one round. The rule: the
*largest* chunk whose forward costs at most ``gap`` decode steps (default 6), measured
where a long prompt's chunks run (appended to a cache already holding ``context`` tokens,
the middle of a 2,000-token prompt). Larger chunks prefill faster (fewer, fuller
forwards) and the arrival's time to first token falls; the bound keeps live streams
within ~``1 + gap`` decode steps per token meanwhile (6: ~0.35 s on the embedded target
here, a few percent of a 2,000-token prompt's solo time to first token, while chunks
of ~100 tokens keep ~90% of the best prefill rate). If no size fits, the smallest. Sizes
within the CPU kernels' rows (32) count only if nothing larger was measured.
Stored per target and machine (the pair key with no drafter); ``load_pair`` reads it
unless ``prefill_chunk`` is set.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx

from ..kernels.cpu import MAX_ROWS
from ..kernels.runner import ModelRunner, prefill, prefill_chunk
from ..kernels.calibration import pair_key, store_fields, store_key

def pick_chunk(times: dict[int, float], decode_s: float, gap: float, floor: int = 0) -> int:
    """The largest size whose chunk takes at most ``gap`` decode steps; else the smallest.
    Sizes up to ``floor`` only where no larger one was measured: ``runner.idle_chunk`` never
    merges a chunk within the CPU kernels' rows, so it keeps a whole idle prefill in
    forwards of its size (measured, 1,440 tokens: chunk 32 5.76 s, 48 4.27 s)."""
    above = {n: t for n, t in times.items() if n > floor} or times
    fits = [n for n, t in above.items() if t <= gap * decode_s]
    return max(fits) if fits else min(above)


def _tokens(n: int, vocab: int, salt: int = 0) -> list[int]:
    return [(salt + 31 * i) % (vocab - 3) + 3 for i in range(n)]


def measure_chunks(runner, sizes, context: int, repeats: int) -> tuple[dict[int, float], float]:
    """Median seconds of one chunk of each size, and of one decode step (one token), each
    appended to a cache holding ``context`` tokens and trimmed back after (round-robin, so
    every size meets each moment's load alike; one warm-up pass first)."""
    cache = runner.make_cache()
    prefill(runner, _tokens(context, runner.vocab_size), cache)
    samples: dict[int, list[float]] = {}
    for rep in range(repeats + 1):
        for n in [1, *sizes]:
            tokens = _tokens(n, runner.vocab_size, salt=rep + 1)
            t0 = time.perf_counter()
            if n == 1:  # a width-1 decode step: the full head on one position
                mx.eval(runner.forward(mx.array([tokens], dtype=mx.int32), cache))
            else:
                prefill_chunk(runner, tokens, cache)
            elapsed = time.perf_counter() - t0
            for c in cache:
                c.trim(n)
            if rep:  # the first pass only warms up
                samples.setdefault(n, []).append(elapsed)
    medians = {n: statistics.median(v) for n, v in samples.items()}
    return {n: medians[n] for n in sizes}, medians[1]


def calibrate_prefill(target, args) -> int:
    """Measure, pick, store and print; returns the chunk."""
    sizes = [int(n) for n in args.prefill_chunks.split(",")]
    runner = ModelRunner(target.model)
    times, decode_s = measure_chunks(runner, sizes, args.prefill_context, max(1, args.repeats))
    chunk = pick_chunk(times, decode_s, args.prefill_gap, floor=MAX_ROWS)  # idle_chunk never merges these
    for n, t in times.items():
        print(f"prefill chunk {n:5d}: {t * 1e3:8.1f} ms ({t / decode_s:5.1f} decode steps, {n / t:6.0f} tok/s)"
              + ("  <- chosen" if n == chunk else ""), flush=True)
    print(f"decode step {decode_s * 1e3:.1f} ms at {args.prefill_context} tokens of context; "
          f"bound {args.prefill_gap} steps a chunk")
    path = store_fields(target.name, None, {
        "prefill_chunk": chunk, "prefill_gap": args.prefill_gap, "prefill_context": args.prefill_context,
        "decode_step_s": round(decode_s, 5), "prefill_chunk_s": {str(n): round(t, 5) for n, t in times.items()}})
    print(f"prefill_chunk = {chunk}; written to {path} for {store_key()} / {pair_key(target.name, None)}")
    return chunk
