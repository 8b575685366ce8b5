"""``bench --suite kernels``: the CPU kernels against the machine's physical limit and
against MLX's own ops (what mlx-lm runs), on the same loaded model, in one run.

- the weight-streaming bound: every float32 weight matrix's bytes (the tied head included)
  over the read bandwidth a one-row sgemv probe reaches on a stack of the same shapes;
- forward of ``rows x positions`` tokens over a 128-token context (decode steps at widths
  1-16, verifies of 2-16 positions at width 1), kernels on and off, and what each step
  reaches of the bound;
- time to first token of a ~1,400-token chat prompt: our engine (chunked prefill) against
  mlx-lm's ``stream_generate`` on MLX's ops.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
import numpy as np

from ...kernels import cpu
from ...runtime.params import SamplingParams

CONTEXT = 128
SHAPES = [(1, 1), (1, 2), (1, 4), (1, 8), (1, 16), (4, 1), (8, 1), (16, 1), (4, 5)]  # (rows, positions)


def weight_bytes(model) -> int:
    import mlx.nn as nn
    return sum(m.weight.nbytes for _, m in model.named_modules()
               if isinstance(m, (nn.Linear, nn.Embedding)) and m.weight.dtype == mx.float32)


def sgemv_probe(model, repeats: int = 5) -> float:
    """Read bandwidth (GB/s) of numpy's sgemv over a copy of the model's weight matrices."""
    import mlx.nn as nn
    mats = [np.array(m.weight) for _, m in model.named_modules()
            if isinstance(m, (nn.Linear, nn.Embedding)) and m.weight.dtype == mx.float32]
    xs = {w.shape[1]: np.ones(w.shape[1], np.float32) for w in mats}
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for w in mats:
            w @ xs[w.shape[1]]
        best = min(best, time.perf_counter() - t0)
    return sum(w.nbytes for w in mats) / best / 1e9


def forward_ms(model, rows: int, positions: int, repeats: int) -> float:
    """Median ms of one forward of ``rows x positions`` tokens after CONTEXT tokens of KV."""
    from mlx_lm.models.cache import make_prompt_cache
    cache = make_prompt_cache(model)
    mx.eval(model(mx.full((rows, CONTEXT), 100, dtype=mx.int32), cache=cache))
    step = mx.full((rows, positions), 200, dtype=mx.int32)
    times = []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        mx.eval(model(step, cache=cache))
        times.append(time.perf_counter() - t0)
        for c in cache:
            c.trim(positions)
    return statistics.median(times[2:]) * 1e3


def ttft_s(ctx, prompt: list[int]) -> dict:
    from mlx_lm.generate import stream_generate
    engine = ctx.engine(speculation=False)
    ours, theirs = [], []
    for _ in range(max(1, ctx.repeats)):
        t0 = time.perf_counter()
        handle = engine.submit(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        handle.result(3600)
        ours.append(time.perf_counter() - t0)
        with cpu.disabled():
            t0 = time.perf_counter()
            next(iter(stream_generate(ctx.target.model, ctx.target.tokenizer, prompt, max_tokens=1)))
            theirs.append(time.perf_counter() - t0)
    return {"specbatch_s": statistics.median(ours), "mlx_lm_s": statistics.median(theirs)}


def suite_kernels(ctx) -> dict:
    model = ctx.target.model
    state = cpu.status()
    total = weight_bytes(model)
    probe = sgemv_probe(model)
    bound_ms = total / probe / 1e6
    repeats = max(5, 3 * ctx.repeats)
    rows = []
    base_on = base_off = None
    for r, n in SHAPES:
        on = forward_ms(model, r, n, repeats)
        with cpu.disabled():
            off = forward_ms(model, r, n, repeats)
        if (r, n) == (1, 1):
            base_on, base_off = on, off
        rows.append({"rows": r, "positions": n, "kernels_ms": on, "mlx_ops_ms": off, "speedup": off / on,
                     "kernels_over_step": on / base_on, "mlx_ops_over_step": off / base_off,
                     "bound_ms": bound_ms, "fraction_of_bound": bound_ms / on})
    from .long import long_prompts
    prompt = long_prompts(ctx.target.tokenizer, 1400, 1)[0]
    ttft = ttft_s(ctx, prompt)
    rows.append({"rows": 1, "positions": len(prompt), "ttft_specbatch_s": ttft["specbatch_s"],
                 "ttft_mlx_lm_s": ttft["mlx_lm_s"], "speedup": ttft["mlx_lm_s"] / ttft["specbatch_s"]})
    return {"kernels": {"active": state.active, "isa": state.isa, "why": state.why},
            "weight_bytes": total, "sgemv_probe_gb_s": probe, "bound_ms": bound_ms, "rows": rows}


SUITES = {"kernels": suite_kernels}
