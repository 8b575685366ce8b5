"""Engine counters: requests, tokens, rounds, drafted/accepted tokens, transitions."""

from __future__ import annotations

import collections

import attrs


@attrs.define
class EngineStats:
    submitted: int = 0
    finished: int = 0
    finish_reasons: collections.Counter = attrs.field(factory=collections.Counter)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    rounds: int = 0
    spec_rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    spec_emitted: int = 0
    acceptance_histogram: collections.Counter = attrs.field(factory=collections.Counter)
    transitions: collections.Counter = attrs.field(factory=collections.Counter)
    spec_widths: collections.Counter = attrs.field(factory=collections.Counter)  # verify rounds by width

    def record_finish(self, request) -> None:
        self.finished += 1
        self.finish_reasons[request.finish_reason or "cancelled"] += 1
        self.prompt_tokens += len(request.prompt)
        self.generated_tokens += request.emitted

    def record_round(self, requests: list, result) -> None:
        """One verify round (a ``RoundResult``) over ``requests``, row by row."""
        self.spec_rounds += 1
        self.spec_widths[len(requests)] += 1
        for request, accepted, run in zip(requests, result.accepted, result.emitted):
            self.drafted_tokens += result.drafted
            self.accepted_tokens += accepted
            self.spec_emitted += len(run)
            self.acceptance_histogram[accepted] += 1
            request.spec.drafted += result.drafted
            request.spec.accepted += accepted
            request.spec.rounds += 1

    def snapshot(self, scheduler, queue_depth: int) -> dict:
        rows = sum(self.acceptance_histogram.values())
        return {
            "requests_submitted": self.submitted,
            "requests_finished": self.finished,
            "finish_reasons": dict(self.finish_reasons),
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "rounds": self.rounds,
            "spec_rounds": self.spec_rounds,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0,
            "tokens_per_round": (self.accepted_tokens + rows) / rows if rows else 0.0,
            "acceptance_histogram": dict(sorted(self.acceptance_histogram.items())),
            "transitions": dict(self.transitions),
            "spec_widths": dict(sorted(self.spec_widths.items())),
            "queue_depth": queue_depth,
            **scheduler.gauges(),
        }
