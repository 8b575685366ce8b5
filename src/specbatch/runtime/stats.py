"""Engine counters: requests, tokens, rounds, drafted/accepted tokens, transitions."""

from __future__ import annotations

import collections

import attrs

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@attrs.define
class Histogram:
    """Cumulative-bucket latency histogram (Prometheus style), seconds."""

    counts: list[int] = attrs.field(factory=lambda: [0] * (len(BUCKETS) + 1))
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        i = next((j for j, b in enumerate(BUCKETS) if value <= b), len(BUCKETS))
        self.counts[i] += 1
        self.total += value
        self.n += 1

    def snapshot(self) -> dict:
        cumulative, running = [], 0
        for c in self.counts:
            running += c
            cumulative.append(running)
        return {"buckets": dict(zip([*map(str, BUCKETS), "+Inf"], cumulative)), "sum": self.total, "count": self.n}


@attrs.define
class EngineStats:
    submitted: int = 0
    finished: int = 0
    finish_reasons: collections.Counter = attrs.field(factory=collections.Counter)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    rounds: int = 0
    spec_rounds: int = 0
    lookup_rounds: int = 0  # of the spec rounds, those drafted by prompt lookup
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    spec_emitted: int = 0
    acceptance_histogram: collections.Counter = attrs.field(factory=collections.Counter)
    transitions: collections.Counter = attrs.field(factory=collections.Counter)
    spec_widths: collections.Counter = attrs.field(factory=collections.Counter)  # verify rounds by width
    ttft: Histogram = attrs.field(factory=Histogram)
    itl: Histogram = attrs.field(factory=Histogram)

    def record_finish(self, request) -> None:
        self.finished += 1
        self.finish_reasons[request.finish_reason or "cancelled"] += 1
        self.prompt_tokens += len(request.prompt)
        self.generated_tokens += request.emitted
        if request.first_token_at is not None:
            self.ttft.observe(request.first_token_at - request.submitted_at)
        for gap in request.gaps:
            self.itl.observe(gap)

    def record_round(self, requests: list, result) -> None:
        """One verify round (a ``RoundResult``) over ``requests``, row by row."""
        self.spec_rounds += 1
        self.spec_widths[len(requests)] += 1
        if result.lookup:
            self.lookup_rounds += 1
            self.lookup_drafted += result.drafted * len(requests)
            self.lookup_accepted += sum(result.accepted)
        for request, accepted, run in zip(requests, result.accepted, result.emitted):
            self.drafted_tokens += result.drafted
            self.accepted_tokens += accepted
            self.spec_emitted += len(run)
            self.acceptance_histogram[accepted] += 1
            request.spec.drafted += result.drafted
            request.spec.accepted += accepted
            request.spec.rounds += 1

    def snapshot(self, gauges: dict, queue_depth: int, admitting: list = (), **live) -> dict:
        """``admitting``: requests being prefilled at admission (see :func:`admitting`); they
        count as ``prefilling`` beside the arrivals the gauges show prefilling between rounds."""
        rows = sum(self.acceptance_histogram.values())
        out = {
            "requests_submitted": self.submitted,
            "requests_finished": self.finished,
            "finish_reasons": dict(self.finish_reasons),
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "rounds": self.rounds,
            "spec_rounds": self.spec_rounds,
            "lookup_rounds": self.lookup_rounds,
            "lookup_acceptance_rate": self.lookup_accepted / self.lookup_drafted if self.lookup_drafted else 0.0,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0,
            "tokens_per_round": (self.accepted_tokens + rows) / rows if rows else 0.0,
            "acceptance_histogram": dict(sorted(self.acceptance_histogram.items())),
            "transitions": dict(self.transitions),
            "spec_widths": dict(sorted(self.spec_widths.items())),
            "queue_depth": queue_depth,
            "ttft_seconds": self.ttft.snapshot(),
            "itl_seconds": self.itl.snapshot(),
            **live,
            **gauges,
        }
        out["prefilling"] = gauges.get("prefilling", 0) + len(admitting)
        out["admitting"] = len(admitting)
        out["admitting_prompt_tokens"] = sum(len(r.prompt) for r in admitting)
        return out


def admitting(live, waiting) -> list:
    """Of the engine's requests (``live``), those out of the queue with no token yet: their
    prompts are being prefilled at admission, a long one whole in one step (safe from any
    thread: reads copies and each request's own fields)."""
    queued = {id(r) for r in waiting}
    return [r for r in list(live) if id(r) not in queued and r.first_token_at is None and not r.finished]
