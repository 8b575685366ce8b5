"""``bench --suite prefix_cache``: chat requests sharing a system prompt, with and without
the prefix cache: TTFT, hit rate, and the cache's bytes against its bound.

Each system prompt (the template's default line, and a longer one) serves QUESTIONS as
user turns: half arrive in one burst (the cache warms their shared prefix once), the rest
one by one while those still decode (they reuse the prompts offered at admission).
"""

from __future__ import annotations

import statistics
import threading
import time

from ...runtime.params import SamplingParams
from ..workload import QUESTIONS
from .serving import _timed

LONG_SYSTEM = (
    "You are a careful assistant for a small engineering team. Answer in plain English, "
    "keep answers short, say when you are unsure, and never invent facts, names or numbers. "
    "When a question is about code, prefer the standard library, show the smallest example "
    "that works, and explain what it does in one or two sentences. When a question is about "
    "everyday life, give practical steps in order. ") * 3


def chat_prompts(tokenizer, system: str | None) -> list[list[int]]:
    """One prompt per question in the model's chat template, all with ``system``."""
    out = []
    for q in QUESTIONS:
        turns = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": q}]
        out.append(list(tokenizer.apply_chat_template(turns, add_generation_prompt=True)))
    return out


def _run(engine, prompts: list[list[int]], tokens: int, gap_s: float) -> list[float]:
    """TTFT of each prompt: the first half in one burst, the rest ``gap_s`` apart."""
    half = len(prompts) // 2
    sent, outs, threads = [], [], []
    for i, p in enumerate(prompts):
        if i > half:
            time.sleep(gap_s)
        sent.append(time.perf_counter())
        handle = engine.submit(p, SamplingParams(max_tokens=tokens, ignore_eos=True, seed=i))
        outs.append({})
        threads.append(threading.Thread(target=_timed, args=(handle, outs[-1])))
        threads[-1].start()
    for t in threads:
        t.join()
    return [o["times"][0] - s for o, s in zip(outs, sent)]


def _cache_of(engine):
    """The engine's prompt cache (for its token counters)."""
    return engine.kernels.prompt_cache


def suite_prefix_cache(ctx, tokens: int = 16, gap_s: float = 0.5) -> dict:
    """Interleaved per repeat (off, on, tight), so the machine's load hits each alike."""
    bounds = {"off": 0, "on": 256 << 20, "tight": 1 << 20}
    rows = []
    for label, system in (("default", None), ("long", LONG_SYSTEM)):
        prompts = chat_prompts(ctx.target.tokenizer, system)
        engines = {name: ctx.engine(prompt_cache_bytes=bound, speculation=False) for name, bound in bounds.items()}
        ttft, peak = {name: [] for name in engines}, {name: 0 for name in engines}
        before = {name: _counters(e) for name, e in engines.items()}
        for _ in range(max(1, ctx.repeats)):
            for name, engine in engines.items():
                ttft[name] += _run(engine, prompts, tokens, gap_s)
                if (pc := _cache_of(engine)) is not None:
                    peak[name] = max(peak[name], pc.nbytes)
                    pc.clear()  # each repeat starts cold
        for name, engine in engines.items():
            got = {k: v - before[name][k] for k, v in _counters(engine).items()}
            rows.append({"system": label, "shared_tokens": _shared_prefix(prompts),
                         "prompt_tokens": sum(map(len, prompts)), "cache": name, "bound_mb": bounds[name] / 2**20,
                         "prefilled_tokens": (got["prompt"] - got["reused"] + got["warmed"]) / max(1, ctx.repeats),
                         "hit_rate": got["hits"] / max(1, got["hits"] + got["misses"]),
                         "ttft_p50_s": statistics.median(ttft[name]), "ttft_mean_s": statistics.mean(ttft[name]),
                         "cache_peak_mb": peak[name] / 2**20, "within_bound": peak[name] <= bounds[name]})
    return {"rows": rows}


def _counters(engine) -> dict:
    s, pc = engine.stats(), _cache_of(engine)
    return {"hits": s["prompt_cache_hits"], "misses": s["prompt_cache_misses"], "prompt": s["prompt_tokens"],
            "reused": getattr(pc, "reused_tokens", 0), "warmed": getattr(pc, "warmed_tokens", 0)}


def _shared_prefix(prompts: list[list[int]]) -> int:
    n = min(map(len, prompts))
    for i in range(n):
        if len({p[i] for p in prompts}) > 1:
            return i
    return n


SUITES = {"prefix_cache": suite_prefix_cache}
