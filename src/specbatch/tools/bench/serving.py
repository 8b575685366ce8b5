"""Bench suites about scheduling and memory: transitions on/off, KV per row, a soak."""

from __future__ import annotations

import gc
import random
import statistics
import threading
import time

from tqdm import tqdm

from ...runtime.params import SamplingParams


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _timed(handle, out: dict) -> None:
    """Consume a handle's events, recording the arrival time of each."""
    out["times"] = [time.perf_counter() for _ in handle]


def staged_workload(engine, prompts, long_tokens: int, short_tokens: int) -> dict:
    """One long request alone, then waiters; TTFT of the waiters, ITLs, and throughput."""
    t0 = time.perf_counter()
    first = engine.submit(prompts[0], SamplingParams(max_tokens=long_tokens, ignore_eos=True, seed=0))
    record = {}
    watcher = threading.Thread(target=_timed, args=(first, record))
    watcher.start()
    time.sleep(0.15)  # the long request is speculating alone by now
    waiters, sent = [], []
    for i, p in enumerate(prompts[1:], 1):
        sent.append(time.perf_counter())
        waiters.append(engine.submit(p, SamplingParams(max_tokens=short_tokens, ignore_eos=True, seed=i)))
    outs = [{} for _ in waiters]
    threads = [threading.Thread(target=_timed, args=(h, o)) for h, o in zip(waiters, outs)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    watcher.join()
    total = long_tokens + short_tokens * len(waiters)
    ttft = [o["times"][0] - s for o, s in zip(outs, sent)]
    gaps = [b - a for o in [record, *outs] for a, b in zip(o["times"], o["times"][1:])]
    return {"ttft": ttft, "gaps": gaps, "tok_s": total / (time.perf_counter() - t0)}


def suite_transitions(ctx) -> dict:
    """Preempt on vs off (waiters' TTFT, throughput); re-arm on vs off (throughput)."""
    from .harness import code_prompts
    cap = max(1, ctx.config.speculative_width_cap)
    prompts = code_prompts(ctx.target.tokenizer, cap + 2)
    runs = {"preempt_on": ctx.engine(preempt=True), "preempt_off": ctx.engine(preempt=False),
            "resume_off": ctx.engine(resume=False)}
    samples = {name: [] for name in runs}
    for _ in tqdm(range(ctx.repeats), desc="transitions", unit="rep"):
        for name, eng in runs.items():
            samples[name].append(staged_workload(eng, prompts, ctx.tokens * 3, ctx.tokens // 2))
    rows = []
    for name, runs_ in samples.items():
        ttft = [t for r in runs_ for t in r["ttft"]]
        gaps = [g for r in runs_ for g in r["gaps"]]
        rows.append({"run": name, "waiter_ttft_p50_s": _pct(ttft, 0.5), "waiter_ttft_p99_s": _pct(ttft, 0.99),
                     "itl_p50_s": _pct(gaps, 0.5), "itl_p99_s": _pct(gaps, 0.99),
                     "tok_s": statistics.median(r["tok_s"] for r in runs_)})
    by = {r["run"]: r for r in rows}
    summary = {"ttft_p50_on_over_off": by["preempt_on"]["waiter_ttft_p50_s"] / by["preempt_off"]["waiter_ttft_p50_s"],
               "throughput_on_over_off": by["preempt_on"]["tok_s"] / by["preempt_off"]["tok_s"],
               "rearm_on_over_off": by["preempt_on"]["tok_s"] / by["resume_off"]["tok_s"]}
    return {"rows": rows, "summary": summary}


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _peak_during(engine, prompts, tokens) -> dict:
    peak = {"kv": 0, "kv_used": 0, "drafter": 0, "rss": 0}
    handles = [engine.submit(p, SamplingParams(max_tokens=tokens, ignore_eos=True, seed=i))
               for i, p in enumerate(prompts)]
    while not all(h.done for h in handles):
        s = engine.stats()
        if s["kv_bytes"] >= peak["kv"]:
            peak.update(kv=s["kv_bytes"], kv_used=s["kv_used_bytes"], drafter=s["drafter_kv_bytes"])
        peak["rss"] = max(peak["rss"], rss_bytes())
        time.sleep(0.002)
    return peak


def suite_memory(ctx) -> dict:
    """KV bytes per row (allocated vs needed) by width, speculation's extra, and a soak."""
    from .harness import code_prompts
    prompts = code_prompts(ctx.target.tokenizer, max(ctx.widths))
    plain, spec = ctx.engine(speculation=False), ctx.engine(**ctx.always(speculative_width_cap=0))
    rows = []
    for width in tqdm(ctx.widths, desc="memory", unit="width"):
        p, s = _peak_during(plain, prompts[:width], ctx.tokens), _peak_during(spec, prompts[:width], ctx.tokens)
        rows.append({"width": width, "kv_bytes_per_row": p["kv"] / width, "kv_needed_per_row": p["kv_used"] / width,
                     "alloc_over_needed": p["kv"] / max(1, p["kv_used"]),
                     "spec_extra_bytes": s["kv"] + s["drafter"] - p["kv"], "peak_rss_mb": max(p["rss"], s["rss"]) / 2**20})
    engine = ctx.engine()
    first = soak(engine, ctx.target.tokenizer)
    second = soak(engine, ctx.target.tokenizer, seed=1)  # steady state: a leak grows again, fragmentation does not
    return {"rows": rows, "soak": first, "soak_again": second}


def soak(engine, tokenizer, n: int = 1000, seed: int = 0) -> dict:
    """Many requests with random lengths and cancellations; memory before and after."""
    import mlx.core as mx

    from ..workload import texts
    PROMPTS = texts(tokenizer, 8)
    rng = random.Random(seed)
    warm = [engine.submit(PROMPTS[i % len(PROMPTS)], SamplingParams(max_tokens=24, seed=i)) for i in range(32)]
    for h in warm:  # the idle level is that of a warm engine (kernels, allocator pools)
        h.result(600)
    _wait_idle(engine)
    gc.collect()
    mx.clear_cache()
    idle = rss_bytes()
    live = []
    for i in tqdm(range(n), desc="soak", unit="req"):
        prompt = PROMPTS[rng.randrange(len(PROMPTS))] * rng.randint(1, 3)
        live.append(engine.submit(prompt, SamplingParams(max_tokens=rng.randint(1, 24), seed=i,
                                                         temperature=rng.choice([0.0, 0.8]))))
        if rng.random() < 0.25:
            engine.cancel(live[rng.randrange(len(live))])
        if len(live) >= 32:
            for h in live:
                h.result(600)
            live = []
    for h in live:
        h.result(600)
    _wait_idle(engine)
    gc.collect()
    mx.clear_cache()
    after = rss_bytes()
    stats = engine.stats()
    return {"requests": n, "rss_idle_mb": idle / 2**20, "rss_after_mb": after / 2**20,
            "growth_mb": (after - idle) / 2**20, "kv_bytes_after": stats["kv_bytes"],
            "finish_reasons": stats["finish_reasons"]}


def _wait_idle(engine) -> None:
    """Until the engine is idle and has released memory (it does so on going idle)."""
    while engine.stats()["state"] != "Idle":
        time.sleep(0.01)
    time.sleep(0.2)


def rearm_cost(target, drafter, width: int, history: int) -> float:
    """Seconds for one capture round plus the drafter's cold start, ``width`` rows."""
    from ...kernels.build import make_drafter
    from ...kernels.loops.batch import BatchLoop
    from ...kernels.runner import ModelRunner
    from ...runtime.request import Request
    runner = ModelRunner(target.model)
    loop = BatchLoop(runner, make_drafter(drafter, runner, batch=True))
    for i in range(width):
        prompt = [(7 * i + j) % 500 + 3 for j in range(history)]
        sp = SamplingParams(max_tokens=64, ignore_eos=True, seed=i)
        loop.admit(Request.create(prompt, sp, target.tokenizer))
    t0 = time.perf_counter()
    loop.capture_round()
    return time.perf_counter() - t0


def suite_drafters(ctx) -> dict:
    """The separate draft model next to the MTP head and prompt lookup, on the same target."""
    import attrs

    from ...kernels.models import ModelNotFound, demo_pair, load, load_mtp_head
    from ...kernels.build import new_engine
    from .harness import acceptance, code_prompts, engine_tok_s
    pair = demo_pair() if ctx.target.name == str(demo_pair()["target"]) else None
    drafters = {}
    try:
        drafters["model"] = ctx.drafter if hasattr(ctx.drafter, "model") else load(pair["drafter"])
    except (ModelNotFound, TypeError) as exc:
        print(f"drafters: no draft model ({exc})")
    for folder in ([pair["mtp"], pair["mtp"].with_name("mtp-candidate")] if pair else [None]):
        try:  # the installed head, else the trained candidate that did not clear the bar
            drafters["mtp"] = load_mtp_head(folder, ctx.target)
            break
        except ModelNotFound as exc:
            print(f"drafters: no MTP head ({exc})")
    from ...kernels.drafters.ngram import NGramSource
    drafters["ngram"] = NGramSource(ctx.target.vocab_size)
    prompts = code_prompts(ctx.target.tokenizer, 4)
    rows = []
    for name, drafter in drafters.items():
        forced = attrs.evolve(ctx.config, speculative_width_cap=0, prompt_cache_bytes=0, fixed_draft=True,
                              max_spec_temperature=None, prompt_lookup=0)  # each drafter speculating, calibrated or not
        engines = {w: new_engine(ctx.target, drafter, forced)
                   for w in (1, 4)}
        for width, engine in engines.items():
            engine_tok_s(engine, prompts[:2], 8)
            before = engine.stats()
            speed = statistics.median(engine_tok_s(engine, prompts[:width], ctx.tokens) for _ in range(ctx.repeats))
            rows.append({"drafter": name, "width": width, "tok_s": speed,
                         "acceptance": acceptance(before, engine.stats()),
                         "rearm_cost_s": rearm_cost(ctx.target, drafter, width, 128)})
            engine.close()
    return {"rows": rows}


SUITES = {"transitions": suite_transitions, "memory": suite_memory}
