"""``bench --suite memory_layout``: what the KV layout costs per round next to what it saves.

Layout rows: at each width, rows of mixed lengths hold random KV (the speed of a round
does not depend on the values), and one plain step ``[B, 1]`` and one verify ``[B, k+1]``
with a per-row rollback run on the dense ragged cache, the paged cache and the 8-bit
paged cache, interleaved per repeat; allocated / needed bytes after the rounds.
kv_bits rows: the engine decoding a concurrent chat workload greedily with fp and 8-bit
batch KV: tok/s, acceptance, and how many streams equal the fp streams (8-bit KV changes
the logits a little, so streams may diverge; rollback stays exact either way).
"""

from __future__ import annotations

import random
import statistics
import time

import mlx.core as mx
import structlog
from mlx_lm.models.cache import KVCache

from ...kernels.kv import BatchKV
from ...kernels.paged_kv import batch_kv
from ...runtime.params import SamplingParams
from .. import workload

log = structlog.get_logger(__name__)

LAYOUTS = {"dense": dict(layout="dense"), "paged": dict(layout="paged"), "paged8": dict(layout="paged", kv_bits=8)}


def mixed_lengths(width: int, seed: int, lo: int = 128, hi: int = 1536) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(lo, hi) for _ in range(width)]


def random_kv(model, lengths: list[int]) -> BatchKV:
    """A dense ragged batch whose rows hold ``lengths`` tokens of random KV."""
    layer = model.layers[0].self_attn
    H, D = layer.n_kv_heads, model.args.hidden_size // model.args.num_attention_heads
    D = getattr(model.args, "head_dim", None) or D
    kv = batch_kv(len(model.layers), layout="dense")
    for n in lengths:
        singles = []
        for _ in model.layers:
            single = KVCache()
            single.keys = mx.random.normal((1, H, n, D))  # [1, H, n, D]
            single.values = mx.random.normal((1, H, n, D))
            single.offset = n
            singles.append(single)
        kv.extend(BatchKV.from_singles(singles))
        mx.eval(kv.arrays())
    return kv


def _round(model, kv: BatchKV, n: int, rng: random.Random) -> float:
    """One forward of ``n`` positions per row, then a per-row rollback of n-1 at most."""
    tokens = mx.array([[rng.randrange(3, 1000) for _ in range(n)] for _ in range(kv.width)])  # [B, n]
    t0 = time.perf_counter()
    logits = model(tokens, cache=kv.layers)  # [B, n, V]
    mx.eval(logits[:, -1].argmax(-1))
    kv.trim_rows([rng.randrange(0, n) if n > 1 else 0 for _ in range(kv.width)])
    return time.perf_counter() - t0


def _kv_side(kv: BatchKV, heads: int, n: int, rng: random.Random) -> float:
    """The part of a round the layout changes: every layer's append, fetch and attention
    of ``n`` positions per row (no weight matmuls), then a per-row rollback."""
    B = kv.width
    H, D = kv.layers[0].keys.shape[1], kv.layers[0].keys.shape[3]
    new = mx.random.normal((B, H, n, D))  # [B, H, n, D]
    q = mx.random.normal((B, heads, n, D))  # [B, Hq, n, D]
    mx.eval(new, q)
    t0 = time.perf_counter()
    mask = kv.layers[0].make_mask(n)
    outs = []
    for layer in kv.layers:
        keys, values = layer.update_and_fetch(new, new)
        outs.append(mx.fast.scaled_dot_product_attention(q, keys, values, scale=D ** -0.5, mask=mask).sum())
    mx.eval(outs)
    kv.trim_rows([rng.randrange(0, n) if n > 1 else 0 for _ in range(B)])
    return time.perf_counter() - t0


def layout_rows(model, widths=(1, 4, 16), k: int = 4, repeats: int = 5) -> list[dict]:
    rows = []
    for width in widths:
        base = random_kv(model, mixed_lengths(width, seed=width))
        caches = {}
        for name, options in LAYOUTS.items():
            caches[name] = batch_kv(len(model.layers), **options)
            caches[name].extend(base)
            mx.eval(caches[name].arrays())
        del base
        times = {(name, n): [] for name in caches for n in (1, k + 1)}
        side = {(name, n): [] for name in caches for n in (1, k + 1)}
        rng = random.Random(0)
        heads = model.args.num_attention_heads
        for _ in range(repeats):  # interleaved: the machine's noise hits every layout alike
            for (name, n), got in times.items():
                got.append(_round(model, caches[name], n, rng))
            for _ in range(3):
                for (name, n), got in side.items():
                    got.append(_kv_side(caches[name], heads, n, rng))
        for name, kv in caches.items():
            rows.append({"width": width, "layout": name, "tokens": sum(kv.lengths()),
                         "step_ms": 1e3 * statistics.median(times[(name, 1)]),
                         "verify_ms": 1e3 * statistics.median(times[(name, k + 1)]),
                         "step_min_ms": 1e3 * min(times[(name, 1)]), "verify_min_ms": 1e3 * min(times[(name, k + 1)]),
                         "kv_step_ms": 1e3 * min(side[(name, 1)]), "kv_verify_ms": 1e3 * min(side[(name, k + 1)]),
                         "alloc_mb": kv.nbytes / 2**20, "need_fp32_mb": _fp32_need(model, kv) / 2**20,
                         "alloc_over_need": kv.nbytes / _fp32_need(model, kv)})
            log.info("layout_row", **rows[-1])
    return rows


def _fp32_need(model, kv: BatchKV) -> int:
    """Bytes the held tokens need at fp32 (the yardstick for every layout)."""
    layer = model.layers[0].self_attn
    D = getattr(model.args, "head_dim", None) or model.args.hidden_size // model.args.num_attention_heads
    return 2 * 4 * layer.n_kv_heads * D * len(model.layers) * sum(kv.lengths())


def kv_bits_rows(ctx, width: int = 4, tokens: int = 48) -> list[dict]:
    """fp vs 8-bit batch KV on one greedy concurrent chat workload (interleaved)."""
    prompts = workload.prompts(ctx.target.tokenizer, width)
    engines = {bits: ctx.engine(kv_bits=bits) for bits in (None, 8)}
    out = {bits: {"tok_s": [], "streams": None} for bits in engines}
    for _ in range(max(1, ctx.repeats)):
        for bits, engine in engines.items():
            t0 = time.perf_counter()
            handles = [engine.submit(p, SamplingParams(max_tokens=tokens, seed=i)) for i, p in enumerate(prompts)]
            streams = [h.result(timeout=3600).token_ids for h in handles]
            out[bits]["tok_s"].append(sum(map(len, streams)) / (time.perf_counter() - t0))
            out[bits]["streams"] = streams
    rows = []
    for bits, engine in engines.items():
        s = engine.stats()
        same = sum(a == b for a, b in zip(out[bits]["streams"], out[None]["streams"]))
        rows.append({"kv": f"{bits}-bit" if bits else "fp32", "width": width, "tok_s": statistics.median(out[bits]["tok_s"]),
                     "acceptance": s["acceptance_rate"], "tokens_per_round": s["tokens_per_round"],
                     "streams_equal_fp32": f"{same}/{len(prompts)}"})
    return rows


def suite_memory_layout(ctx) -> dict:
    rows = layout_rows(ctx.target.model, k=ctx.k or 4, repeats=max(3, ctx.repeats))
    return {"rows": rows + kv_bits_rows(ctx)}


SUITES = {"memory_layout": suite_memory_layout}
