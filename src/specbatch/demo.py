"""``make demo``: staggered concurrent requests on the embedded pair, transitions live."""

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


def run_demo(args) -> int:
    from . import SamplingParams, logs
    from .cli import _engine

    logs.configure("console", "info")
    engine = _engine(args)
    print(f"specbatch demo: target={engine.target.name} drafter={engine.drafter and engine.drafter.name} "
          f"k={engine.config.num_draft_tokens} cap={engine.config.speculative_width_cap}", flush=True)
    handles, lock = [], threading.Lock()
    start = time.perf_counter()
    for i in range(args.requests):
        prompt = PROMPTS[i % len(PROMPTS)]
        budget = args.max_tokens if i % 3 else args.max_tokens * 2
        params = SamplingParams(max_tokens=budget, temperature=0.0 if i % 2 == 0 else 0.7, seed=i)
        handles.append((prompt, engine.submit(prompt, params)))
        time.sleep(0.15 if i == 0 else 0.05)
    for prompt, handle in handles:
        done = handle.result(timeout=600)
        with lock:
            print(f"\n--- {done.request_id} ({done.finish_reason}, {done.usage.completion_tokens} tokens)"
                  f"\n{prompt}{done.text}", flush=True)
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    engine.close()
    tokens = stats["generated_tokens"]
    print(f"\n=== summary: {len(handles)} requests, {tokens} tokens in {elapsed:.2f}s "
          f"({tokens / elapsed:.1f} tok/s); rounds {stats['rounds']}, verify rounds "
          f"{stats['spec_rounds']}, acceptance {stats['acceptance_rate']:.2f}, "
          f"tokens/round {stats['tokens_per_round']:.2f}; transitions {stats['transitions']}")
    sys.stdout.flush()
    return 0
