"""``bench --suite kernels``: the CPU kernels against the machine's physical limit and
against MLX's own ops (what mlx-lm runs), on the same loaded model, in one run.

- the weight-streaming bound: the bytes a width-1 step reads of every weight matrix (the tied
  head included; float16 where half-stored, ``kernels.cpu.half``, its quantized blocks where
  decode rows read those, ``kernels.cpu.blocks``) over the read bandwidth a one-row sgemv probe reaches on
  a float32 stack of the same shapes (``bound_ms``), and over the bandwidth every kernel thread
  reaches at once streaming a 256 MB buffer with vector loads (``read_bound_ms``: the physical
  limit; numpy's sgemv reached 15-21 GB/s on a Zen 4 VM where this read 27-35 on 4 KB pages);
  the buffer lies on the pages the blocks' records do (huge pages where the system grants them:
  ``block_pages`` says how many of the records' bytes it did; ``read_probe_4k_pages_gb_s`` is
  the same read on 4 KB pages);
- the compute bound: every weight times every token row (two FLOPs each) over the float32
  FMA peak all kernel threads reach at once (``fma_peak_gflops``); a shape's roofline is the
  larger of its bytes (the quantized blocks at every row count) over the read bandwidth and its
  FLOPs over that peak;
- forward of ``rows x positions`` tokens over a 128-token context (decode steps at widths
  1-16, verifies of 2-16 positions at width 1), kernels on (through the engine's runner, as
  the engine builds a forward) and off (off: MLX's ops on the float32 weights mlx-lm runs),
  every case in turn within each repeat, and what each step reaches of the bound;
- the engine's own width-1 plain decode, steady state (ms a token after the first: the
  forward, its sampling and the host's work between tokens), against the same bound;
- time to first token of a ~1,400-token chat prompt and the width-1 decode after it (48 tokens,
  attention over ~1,450 keys): our engine (chunked prefill) against mlx-lm's ``stream_generate``
  on MLX's ops (float32 weights).
"""

from __future__ import annotations

import contextlib
import statistics
import time

import mlx.core as mx
import numpy as np

from ...kernels import cpu
from ...kernels.cpu.blocks import decode_bytes, reads_blocks
from ...runtime.params import SamplingParams
from .harness import code_prompts

CONTEXT = 128
LONG_DECODE_TOKENS = 48  # decoded after the long prompt, each system
SHAPES = [(1, 1), (1, 2), (1, 3), (1, 4), (1, 8), (1, 16), (4, 1), (8, 1), (16, 1), (4, 5)]  # (rows, positions)


def _modules(model) -> list:
    import mlx.nn as nn
    return [m for _, m in model.named_modules()
            if isinstance(m, (nn.Linear, nn.Embedding)) and m.weight.dtype in (mx.float32, mx.float16)]


def _matrices(model) -> list:
    return [m.weight for m in _modules(model)]


def weight_bytes(model) -> int:
    """What a width-1 decode step must read: every weight matrix's bytes as stored, or its
    quantized blocks' where decode rows read those (``kernels.cpu.blocks``)."""
    return sum(decode_bytes(m) for m in _modules(model))


def sgemv_probe(model, repeats: int = 5) -> float:
    """Read bandwidth (GB/s) of numpy's sgemv over a float32 copy of the model's weight matrices."""
    mats = [np.array(w.astype(mx.float32)) for w in _matrices(model)]
    xs = {w.shape[1]: np.ones(w.shape[1], np.float32) for w in mats}
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for w in mats:
            w @ xs[w.shape[1]]
        best = min(best, time.perf_counter() - t0)
    return sum(w.nbytes for w in mats) / best / 1e9


def forward_times(model, shapes: list[tuple[int, int]], repeats: int, mlx_ops: bool = True, baseline=None) -> dict:
    """Median ms of one forward of ``rows x positions`` tokens after CONTEXT tokens of KV, for
    each shape with the kernels on (and off, MLX's ops on ``baseline`` or ``model``, where
    ``mlx_ops``), keyed ``(rows, positions, on)``.
    Every repeat runs each case once in turn, so the ratios between shapes are taken side by
    side (a noisy VM drifts by 10-30% over the minutes one shape at a time would take)."""
    from mlx_lm.models.cache import make_prompt_cache
    from ...kernels.runner import ModelRunner
    cases = [(r, n, on) for r, n in shapes for on in ((True, False) if mlx_ops else (True,))]
    models = {True: model, False: model if baseline is None else baseline}
    runner = ModelRunner(model)  # the engine's forward: the decoder stack built once (cpu.stack)
    forward = {True: runner.forward, False: lambda tokens, cache: models[False](tokens, cache=cache)}
    caches = {}
    for case in cases:
        caches[case] = make_prompt_cache(models[case[2]])
        with contextlib.nullcontext() if case[2] else cpu.disabled():
            mx.eval(models[case[2]](mx.full((case[0], CONTEXT), 100, dtype=mx.int32), cache=caches[case]))
    times = {case: [] for case in cases}
    for _ in range(repeats + 2):
        for case in cases:
            rows, positions, on = case
            step = mx.full((rows, positions), 200, dtype=mx.int32)
            with contextlib.nullcontext() if on else cpu.disabled():
                t0 = time.perf_counter()
                mx.eval(forward[on](step, caches[case]))
                times[case].append(time.perf_counter() - t0)
            for c in caches[case]:
                c.trim(positions)
    return {case: statistics.median(ts[2:]) * 1e3 for case, ts in times.items()}


def long_prompt(ctx, engine, prompt: list[int], tokens: int = LONG_DECODE_TOKENS) -> dict:
    """Time to first token of ``prompt`` and the decode after it (ms a token past the first,
    end of sequence masked), on ``engine`` (plain) and on mlx-lm's ``stream_generate`` (MLX's ops,
    float32 weights), interleaved per repeat; medians."""
    from mlx_lm.generate import stream_generate
    eos = mx.array(np.isin(np.arange(ctx.target.vocab_size), list(ctx.target.tokenizer.eos_token_ids)))
    no_eos = lambda _, logits: mx.where(eos, -mx.inf, logits)  # noqa: E731
    runs = {"specbatch": [], "mlx_lm": []}
    for _ in range(max(1, ctx.repeats)):
        t0 = time.perf_counter()
        handle = engine.submit(prompt, SamplingParams(max_tokens=1 + tokens, ignore_eos=True))
        runs["specbatch"].append([t0] + [time.perf_counter() for event in handle if event.token is not None])
        with cpu.disabled():
            t0 = time.perf_counter()
            stamps = [time.perf_counter() for _ in stream_generate(ctx.mlx_lm_model, ctx.target.tokenizer, prompt,
                                                                   max_tokens=1 + tokens, logits_processors=[no_eos])]
            runs["mlx_lm"].append([t0] + stamps)
    out = {}
    for system, stamps in runs.items():
        out[f"{system}_ttft_s"] = statistics.median(s[1] - s[0] for s in stamps)
        out[f"{system}_decode_ms"] = statistics.median((s[-1] - s[1]) / (len(s) - 2) * 1e3 for s in stamps)
        out[f"{system}_tokens"] = min(len(s) - 1 for s in stamps)  # every run's whole count: none ended early
    return out


def decode_ms(ctx, engine, prompt: list[int], tokens: int = 96) -> float:
    """``engine``'s width-1 decode, ms a token after the first (median of the repeats)."""
    runs = []
    for _ in range(max(2, ctx.repeats)):
        handle = engine.submit(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
        stamps = [time.perf_counter() for event in handle if event.token is not None]
        runs.append((stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3)
    return statistics.median(runs)


def suite_kernels(ctx) -> dict:
    model = ctx.target.model
    state = cpu.status()
    total = weight_bytes(model)
    probe = sgemv_probe(model)
    bound_ms = total / probe / 1e6
    repeats = max(15, 5 * ctx.repeats)  # ~1 s a repeat; 5-9 left 3 positions above 4 on a noisy VM
    ext = cpu.extension()
    peak = ext.fma_peak_gflops() if ext is not None else 0.0
    read = ext.read_bandwidth_gbs() if ext is not None else probe
    read_small = ext.read_bandwidth_gbs(small_pages=True) if ext is not None else probe  # for comparison
    read_bound_ms = total / read / 1e6
    stored = sum(w.nbytes for w in _matrices(model))
    weights = sum(w.size for w in _matrices(model))
    times = forward_times(model, SHAPES, repeats, baseline=ctx.mlx_lm_model)
    base_on, base_off = times[(1, 1, True)], times[(1, 1, False)]
    rows = []
    for r, n in SHAPES:
        on, off = times[(r, n, True)], times[(r, n, False)]
        read_ms = total / read / 1e6
        compute_ms = 2 * weights * r * n / peak / 1e6 if peak else 0.0
        roofline = max(read_ms, compute_ms)
        rows.append({"rows": r, "positions": n, "kernels_ms": on, "mlx_ops_ms": off, "speedup": off / on,
                     "kernels_over_step": on / base_on, "mlx_ops_over_step": off / base_off,
                     "bound_ms": bound_ms, "fraction_of_bound": bound_ms / on,
                     "read_bound_ms": read_bound_ms, "fraction_of_read_bound": read_bound_ms / on,
                     "roofline_ms": roofline, "fraction_of_roofline": roofline / on})
    engine = ctx.engine(speculation=False)  # plain: the engine's decode and its time to first token
    decode = decode_ms(ctx, engine, code_prompts(ctx.target.tokenizer, 1)[0])
    rows.append({"rows": 1, "positions": 1, "engine_decode_ms": decode, "bound_ms": bound_ms,
                 "fraction_of_bound": bound_ms / decode, "read_bound_ms": read_bound_ms,
                 "fraction_of_read_bound": read_bound_ms / decode})
    from .long import long_prompts
    prompt = long_prompts(ctx.target.tokenizer, 1400, 1)[0]
    long = long_prompt(ctx, engine, prompt)
    rows.append({"rows": 1, "positions": len(prompt), "ttft_specbatch_s": long["specbatch_ttft_s"],
                 "ttft_mlx_lm_s": long["mlx_lm_ttft_s"], "speedup": long["mlx_lm_ttft_s"] / long["specbatch_ttft_s"]})
    rows.append({"rows": 1, "positions": 1, "context": len(prompt), "engine_decode_ms": long["specbatch_decode_ms"],
                 "mlx_lm_decode_ms": long["mlx_lm_decode_ms"],
                 "speedup": long["mlx_lm_decode_ms"] / long["specbatch_decode_ms"]})
    return {"kernels": {"active": state.active, "isa": state.isa, "why": state.why},
            "weight_bytes": total, "weight_bytes_stored": stored,
            "weight_dtypes": sorted({str(w.dtype) for w in _matrices(model)}),
            "block_matrices": sum(1 for m in _modules(model) if reads_blocks(m)),
            "sgemv_probe_gb_s": probe, "bound_ms": bound_ms, "read_probe_gb_s": read,
            "read_probe_4k_pages_gb_s": read_small, "read_bound_ms": read_bound_ms, "fma_peak_gflops": peak,
            "block_pages": ext.blocks_pages() if ext is not None else None, "rows": rows}


SUITES = {"kernels": suite_kernels}
