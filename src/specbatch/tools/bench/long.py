"""``bench --suite long_prompts``: live streams while long prompts arrive, with and without
chunked prefill, in each state the live streams can be in.

Live chat streams decode (one speculating stream: Scalar; two speculating: Batched; two
plain: Gated); once they are under way, ``--long-prompt-tokens``-token prompts (2,000 by
default: about 8 s of prefill on the embedded target here) arrive ``STAGGER_S`` apart.
Reported per state and prefill mode: the live streams' inter-token gaps while the
arrivals are prefilled (from the first arrival to the last arrival's first token: p50,
p99, the worst), the arrivals' time to first token, and one such prompt's time to first
token alone on an idle engine (the worst gap over it is the figure the old pair's trial
reported: 0.10). Engines are interleaved per repeat; the prefix cache is off.
"""

from __future__ import annotations

import inspect
import statistics
import threading
import time

from tqdm import tqdm

from ...runtime.params import SamplingParams
from .serving import _pct

STAGGER_S = 1.0  # between arrivals
ARRIVAL_TOKENS = 8  # each arrival decodes this many tokens
LIVE_WARM_TOKENS = 4  # tokens each live stream has out before the arrivals come


def long_prompts(tokenizer, n_tokens: int, count: int) -> list[list[int]]:
    """``count`` chat prompts of about ``n_tokens`` tokens: different stretches of a stdlib
    module's source, each to be summarised (real text; no two share a prefix past the template)."""
    import argparse

    from ...kernels.models import chat_prompt
    source = inspect.getsource(argparse)  # ~100 KB of real text
    chars = 8 * n_tokens  # a window with room for n_tokens (a token is ~3-4 characters of code)
    out = []
    for i in range(count):
        start = (i * 7919) % max(1, len(source) - chars)
        body = list(tokenizer.encode(source[start:start + chars]))[:n_tokens]
        text = "Summarise what this code does:\n\n" + tokenizer.decode(body)
        out.append(list(tokenizer.encode(chat_prompt(tokenizer, text) or text)))
    return out


def _stamp(handle, times: list[float]) -> None:
    """Append the arrival time of each token event (live: readable while it runs)."""
    for event in handle:
        if event.token is not None:
            times.append(time.perf_counter())


def _watch(handle) -> tuple[list[float], threading.Thread]:
    times: list[float] = []
    thread = threading.Thread(target=_stamp, args=(handle, times), daemon=True)
    thread.start()
    return times, thread


def _wait(cond, timeout: float = 3600.0) -> None:
    end = time.perf_counter() + timeout
    while not cond():
        if time.perf_counter() > end:
            raise TimeoutError("long_prompts: a stream stalled")
        time.sleep(0.002)


def long_run(engine, live_prompts, arrivals) -> dict:
    """Live streams decode; arrivals come; gaps of the live streams while they prefill."""
    live = [engine.submit(p, SamplingParams(max_tokens=100_000, ignore_eos=True, seed=i))
            for i, p in enumerate(live_prompts)]
    live_times = [_watch(h) for h in live]
    _wait(lambda: all(len(t) >= LIVE_WARM_TOKENS for t, _ in live_times))
    state = engine.stats()["state"]
    sent, got = [], []
    for i, p in enumerate(arrivals):
        if i:
            time.sleep(STAGGER_S)
        sent.append(time.perf_counter())
        got.append(_watch(engine.submit(p, SamplingParams(max_tokens=ARRIVAL_TOKENS, ignore_eos=True, seed=100 + i))))
    _wait(lambda: all(t or not thread.is_alive() for t, thread in got))
    if not all(t for t, _ in got):
        raise RuntimeError("long_prompts: an arrival ended without a token")
    start, end = sent[0], max(t[0] for t, _ in got)
    for _, thread in got:
        thread.join()
    for handle in live:
        engine.cancel(handle)
    for _, thread in live_times:
        thread.join()
    gaps = [b - a for times, _ in live_times for a, b in zip(times, times[1:]) if start < b <= end]
    during = sum(1 for times, _ in live_times for t in times if start < t <= end)
    return {"state": state, "gaps": gaps, "ttft": [t[0] - s for (t, _), s in zip(got, sent)],
            "live_tok_s": during / (end - start)}


def solo_ttft(engine, prompt) -> float:
    t0 = time.perf_counter()
    times, thread = _watch(engine.submit(prompt, SamplingParams(max_tokens=1, seed=0)))
    thread.join()
    return times[0] - t0


def _setups(ctx) -> dict:
    """State name -> (live streams, engine overrides)."""
    forced = dict(max_spec_temperature=None, fixed_draft=True, prompt_lookup=0)  # speculate whatever the calibration says
    setups = {"Gated": (2, dict(speculation=False))}
    if ctx.drafter is not None:
        setups = {"Scalar": (1, dict(speculative_width_cap=1, **forced)),
                  "Batched": (2, dict(speculative_width_cap=0, **forced)), **setups}
    return setups


def suite_long_prompts(ctx) -> dict:
    tokenizer = ctx.target.tokenizer
    from .harness import code_prompts
    live_prompts = code_prompts(tokenizer, 2)
    arrivals = long_prompts(tokenizer, ctx.long_prompt_tokens, ctx.long_arrivals)
    rows = []
    for state, (n_live, overrides) in tqdm(_setups(ctx).items(), desc="long_prompts", unit="state"):
        engines = {mode: ctx.engine(chunked_prefill=mode == "chunked", **overrides) for mode in ("chunked", "whole")}
        runs, solo = {mode: [] for mode in engines}, []
        for _ in range(max(1, ctx.repeats)):
            for mode, engine in engines.items():
                runs[mode].append(long_run(engine, live_prompts[:n_live], arrivals))
            solo.append(solo_ttft(engines["whole"], arrivals[0]))
        solo_s = statistics.median(solo)
        for mode, got in runs.items():
            gaps = [g for r in got for g in r["gaps"]]
            ttft = [t for r in got for t in r["ttft"]]
            rows.append({"state": state, "seen_state": "/".join(sorted({r["state"] for r in got})),
                         "prefill": mode, "chunk": engines[mode].config.prefill.prefill_chunk if mode == "chunked" else None,
                         "live": n_live, "arrivals": len(arrivals), "prompt_tokens": len(arrivals[0]),
                         "itl_p50_s": _pct(gaps, 0.5), "itl_p99_s": _pct(gaps, 0.99), "itl_max_s": max(gaps, default=0.0),
                         "live_tok_s": statistics.median(r["live_tok_s"] for r in got),
                         "arrival_ttft_p50_s": _pct(ttft, 0.5), "arrival_ttft_max_s": max(ttft),
                         "solo_ttft_s": solo_s, "worst_gap_over_solo_ttft": max(gaps, default=0.0) / solo_s})
        for engine in engines.values():
            engine.close()
    return {"rows": rows}


SUITES = {"long_prompts": suite_long_prompts}
