"""``make demo``: chat requests on the embedded target, streams and transitions live, then a
summary. It drives an ``EngineCore`` step by step (no thread, no sleeps), so every run
takes every edge of the chart in four acts: one request alone (Idle -> Scalar -> Idle);
staggered arrivals (Scalar -> Batched by preempt, Batched -> Gated over the cap,
Gated -> Batched by re-arm, Batched -> Batched by the capture round, Batched -> Idle); bursts within and over the cap
(Idle -> Batched -> Idle, Idle -> Gated -> Idle)."""

from __future__ import annotations

import sys
import time

QUESTIONS = [
    "What is the capital of Australia?",
    "Write a Python function that checks whether a string is a palindrome.",
    "Give three tips for writing clear emails.",
    "Why is the sky blue? Answer in two sentences.",
    "What does the len() function do in Python?",
    "Name three planets of the solar system.",
    "How do I reverse a list in Python?",
    "What is photosynthesis?",
]


class Printer:
    """Prints each request's text a line at a time, prefixed by its name."""

    def __init__(self) -> None:
        self.pending: dict[str, str] = {}

    def show(self, events) -> None:
        for event in events:
            text = self.pending.get(event.request_id, "") + event.text
            *lines, text = text.split("\n")
            for line in lines:
                print(f"  {event.request_id} | {line}", flush=True)
            self.pending[event.request_id] = text
            if event.finish_reason:
                print(f"  {event.request_id} | {self.pending.pop(event.request_id)}", flush=True)
                print(f"  {event.request_id} finished: {event.finish_reason}", flush=True)


def _chat(core, question: str) -> str:
    from ..kernels.models import chat_prompt
    return chat_prompt(core.tokenizer, question) or question


def _drain(core, printer) -> None:
    while core.has_work():
        printer.show(core.step())


def run_demo(args) -> int:
    from .. import SamplingParams, logs
    from ..kernels.build import new_core
    from ..kernels.pair import load_pair

    logs.configure(getattr(args, "log_format", "console"), "info")
    options = dict(speculation=not args.no_speculation, num_draft_tokens=args.num_draft_tokens,
                   dtype=args.dtype, drafter=args.drafter,
                   speculative_width_cap=args.speculative_width_cap)
    target, drafter, config = load_pair(args.model, args.draft_model, **options)
    config = _showable(config, args)
    core = new_core(target, drafter, config)
    cap, m = core.config.speculative_width_cap, args.max_tokens
    print(f"specbatch demo: target={target.name}\n  drafter={drafter and drafter.name} "
          f"k={core.config.num_draft_tokens} cap={cap} speculation={core.config.speculation}", flush=True)
    printer, start, ids = Printer(), time.perf_counter(), []
    greedy = lambda n, seed=0: SamplingParams(max_tokens=n, temperature=0.0, seed=seed)  # noqa: E731

    print("\n-- one request alone: Idle -> Scalar -> Idle", flush=True)
    ids.append(core.add(_chat(core, QUESTIONS[0]), greedy(m)))
    _drain(core, printer)

    print("\n-- staggered arrivals: preempt, gate, re-arm, drain", flush=True)
    long_id = core.add(_chat(core, QUESTIONS[1]), greedy(4 * m, seed=1))
    ids.append(long_id)
    for _ in range(3):  # it speculates alone for a few rounds before the others arrive
        printer.show(core.step())
    for i in range(max(args.requests - 1, cap + 1)):
        hot = SamplingParams(max_tokens=m // 2 + 4 * i, temperature=0.7, seed=10 + i)
        ids.append(core.add(_chat(core, QUESTIONS[2 + i % (len(QUESTIONS) - 2)]), hot))
    _drain(core, printer)

    if cap != 1:
        print("\n-- a burst within the cap at idle: Idle -> Batched -> Idle", flush=True)
        ids += [core.add(_chat(core, q), greedy(12, seed=200)) for q in QUESTIONS[:2]]
        _drain(core, printer)
    print("\n-- a burst over the cap at idle: Idle -> Gated -> Idle", flush=True)
    ids += [core.add(_chat(core, QUESTIONS[i % len(QUESTIONS)]), greedy(12, seed=300))
            for i in range((cap or 4) + 2)]
    _drain(core, printer)
    return _summary(core, len(ids), time.perf_counter() - start)


def _showable(config, args):
    """A config that takes every edge: where the calibration says speculation does not pay
    for this pair (a schedule of zeros) or caps it at 1, the demo still speculates (k = 4,
    cap = 2) to show the transitions, and says so: its speed is not the calibrated engine's."""
    import attrs
    if not config.speculation or args.speculative_width_cap is not None:
        return config
    plain = config.policy().paying_width(2) < 2  # the policy expects no gain at width 1 or 2
    if plain:
        print("  (calibrated here, this drafter does not pay at widths 1-2: the engine would decode plain; "
              "the demo speculates anyway, k=4, cap=2, to show every transition)")
        return attrs.evolve(config, fixed_draft=True, max_spec_temperature=None, speculative_width_cap=2,
                            num_draft_tokens=args.num_draft_tokens or 4)
    if config.speculative_width_cap == 1:  # a burst within the cap needs a cap of at least 2
        print("  (the calibrated cap is 1; the demo uses 2 so that a burst within it exists)")
        return attrs.evolve(config, speculative_width_cap=2)
    return config


def _summary(core, n: int, elapsed: float) -> int:
    stats = core.stats()
    core.close()
    tokens = stats["generated_tokens"]
    missed = _missed(stats["transitions"])
    print(f"\n=== summary: {n} requests, {tokens} tokens in {elapsed:.2f}s ({tokens / elapsed:.1f} tok/s)\n"
          f"    rounds {stats['rounds']}, verify rounds {stats['spec_rounds']}, drafted {stats['drafted_tokens']}, "
          f"accepted {stats['accepted_tokens']} (acceptance {stats['acceptance_rate']:.2f}, "
          f"{stats['tokens_per_round']:.2f} tokens/verify round)\n"
          f"    transitions {stats['transitions']}\n"
          f"    chart edges not taken: {', '.join(missed) or 'none'}")
    sys.stdout.flush()
    return 1 if missed and core.config.speculation else 0


def _missed(taken: dict) -> list[str]:
    """Edges of the machine's table this run did not take."""
    from ..runtime.machine import TRANSITIONS
    edges = {f"{src}->{dst}" for _, sources, dst, *_ in TRANSITIONS
             for src in ([sources] if isinstance(sources, str) else sources)}
    return sorted(edges - set(taken))
