"""``make demo``: requests on the embedded pair, streams and transitions live, then a
summary. Four acts take every edge of the chart: one request alone (Idle -> Scalar ->
Idle); staggered arrivals (Scalar -> Batched by preempt, Batched -> Gated over the cap,
Gated -> Batched by re-arm, Batched -> Idle); bursts within and over the cap (Idle ->
Batched -> Idle, Idle -> Gated -> Idle)."""

from __future__ import annotations

import sys
import threading
import time

PROMPTS = [
    "def fibonacci(n):",
    "class Stack:\n    def __init__(self):",
    "import os\n\ndef walk_files(root):",
    "def parse_args(argv):\n    parser = argparse.ArgumentParser(",
    "    def __repr__(self):\n        return",
    "def merge_sorted(a, b):\n    result = []",
    "try:\n    import json\nexcept ImportError:",
    "def read_lines(path):\n    with open(path) as f:",
]

_print_lock = threading.Lock()


def _say(line: str) -> None:
    with _print_lock:
        print(line, flush=True)


def _follow(name: str, prompt: str, handle) -> None:
    """Print a request's stream live, a line at a time, prefixed by its name."""
    pending = prompt
    for event in handle:
        pending += event.text
        *lines, pending = pending.split("\n")
        for line in lines:
            _say(f"  {name} | {line}")
        if event.finish_reason:
            _say(f"  {name} | {pending}")
            _say(f"  {name} finished: {event.finish_reason}")


def run_demo(args) -> int:
    from . import SamplingParams, logs
    from .cli import _engine

    logs.configure(getattr(args, "log_format", "console"), "info")
    engine = _engine(args)
    cap = engine.config.speculative_width_cap
    _say(f"specbatch demo: target={engine.target.name}\n  drafter={engine.drafter and engine.drafter.name} "
         f"k={engine.config.num_draft_tokens} cap={cap} speculation={engine.config.speculation}")
    n = max(args.requests, cap + 2)
    start = time.perf_counter()
    _say("\n-- one request alone: Idle -> Scalar -> Idle")
    alone = engine.submit(PROMPTS[0], SamplingParams(max_tokens=args.max_tokens, temperature=0.0, seed=99))
    _follow(alone.request_id, PROMPTS[0], alone)
    _say("\n-- staggered arrivals: preempt, gate, re-arm, drain")
    followers = [(None, alone)]
    for i in range(n):
        # the first outlives the short ones, the last outlives everyone by far: when it is
        # alone (or within the cap) with many tokens left, the gated batch re-arms
        scale = 3 if i == 0 else (6 if i == n - 1 else 1)
        # the last one is greedy: a calibrated pair may speculate only at temperature 0
        params = SamplingParams(max_tokens=args.max_tokens * scale,
                                temperature=0.0 if i % 2 == 0 or i == n - 1 else 0.7, seed=i)
        prompt = PROMPTS[i % len(PROMPTS)]
        handle = engine.submit(prompt, params)
        follower = threading.Thread(target=_follow, args=(handle.request_id, prompt, handle))
        follower.start()
        followers.append((follower, handle))
        time.sleep(0.4 if i == 0 else 0.02)  # the first speculates alone before waiters arrive
    for follower, handle in followers:
        if follower is not None:
            follower.join(600)
    if cap != 1:
        followers += _burst(engine, 2, "a burst within the cap at idle: Idle -> Batched -> Idle")
    followers += _burst(engine, (cap or 4) + 2, "a burst over the cap at idle: Idle -> Gated -> Idle")
    n = len(followers)
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    engine.close()
    tokens = sum(h.result().usage.completion_tokens for _, h in followers)
    _say(f"\n=== summary: {n} requests, {tokens} tokens in {elapsed:.2f}s ({tokens / elapsed:.1f} tok/s)\n"
         f"    rounds {stats['rounds']}, verify rounds {stats['spec_rounds']}, drafted {stats['drafted_tokens']}, "
         f"accepted {stats['accepted_tokens']} (acceptance {stats['acceptance_rate']:.2f}, "
         f"{stats['tokens_per_round']:.2f} tokens/verify round)\n"
         f"    transitions {stats['transitions']}\n"
         f"    chart edges not taken: {_missed(stats['transitions']) or 'none'}")
    sys.stdout.flush()
    return 0


def _burst(engine, n: int, title: str) -> list:
    """``n`` greedy requests arriving together at an idle engine; waits for Idle again."""
    from . import SamplingParams
    _say(f"\n-- {title}")
    burst = engine.submit_many([PROMPTS[i % len(PROMPTS)] for i in range(n)], SamplingParams(max_tokens=8, seed=200))
    for handle in burst:
        handle.result(600)
    while engine.stats()["state"] != "Idle":
        time.sleep(0.01)
    return [(None, h) for h in burst]


def _missed(taken: dict) -> list[str]:
    """Edges of the machine's table this run did not take (timing can skip one)."""
    from .machine import TRANSITIONS
    edges = {f"{src}->{dst}" for _, sources, dst, *_ in TRANSITIONS
             for src in ([sources] if isinstance(sources, str) else sources)}
    return sorted(edges - set(taken))
