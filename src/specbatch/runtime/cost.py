"""What a round costs, in seconds: the policy's ``CostModel`` (``specbatch calibrate``
measures it and stores it with the pair).

A target forward over ``rows x positions`` tokens costs what calibrate timed for that many
tokens of one row (``forward_table``: measured forwards, interpolated), plus ``row_s`` for
each row past the first (each row attends over its own KV). On this CPU a forward reads
every weight once whatever its token count, so up to ~8 tokens it costs nearly what one
costs; a line through every width's rounds (``target_fixed_s + target_token_s * tokens``,
the model where no table was measured) priced a width-1 verify of 2 positions at 1.3x a
step where it takes 1.05x. A drafter step over ``rows`` costs ``draft_fixed_s + draft_row_s
* rows``; every round adds ``round_s`` (the host sync) and ``round_row_s`` a row (sampling,
delivery), and a speculative one ``verify_s`` more (accept, rollback, every position sampled).

Where calibrate timed whole rounds (``rounds``: width, k, seconds decoding alone), those
price the rounds and the model only fills the gaps: its ~5-10% misfit at some widths (the
draft overlapping the verify's build at width 1, the 4-bit kernel's few-row tiles) was as large
as the margins the policy decides on (width 2: speculation 6% ahead measured, 2% modelled).
"""

from __future__ import annotations

import functools

import attrs


def _points(value) -> tuple[tuple[int, float], ...]:
    """(tokens, seconds) pairs sorted by tokens, from any sequence of pairs (JSON lists)."""
    return tuple(sorted((int(t), float(s)) for t, s in value))


def _rounds(value) -> tuple[tuple[int, int, float], ...]:
    """(width, k, seconds) triples sorted, from any sequence of triples (JSON lists)."""
    return tuple(sorted((int(w), int(k), float(s)) for w, k, s in value))


@attrs.frozen(cache_hash=True)  # hashed once: a round's price is memoized per model (round_seconds)
class CostModel:
    target_fixed_s: float = 1.0
    target_token_s: float = 0.02
    draft_fixed_s: float = 0.1
    draft_row_s: float = 0.01
    forward_table: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_points)
    row_s: float = 0.0
    verify_s: float = 0.0
    round_s: float = 0.0
    round_row_s: float = 0.0
    rounds: tuple[tuple[int, int, float], ...] = attrs.field(default=(), converter=_rounds)

    def forward_s(self, rows: int, positions: int) -> float:
        tokens = rows * positions
        if not self.forward_table:
            return self.target_fixed_s + self.target_token_s * tokens
        return self.tokens_s(tokens) + self.row_s * (rows - 1)

    def tokens_s(self, tokens: int) -> float:
        """One row's forward of ``tokens`` positions from the table: linear between measured
        points, the first point's below them, the last two points' slope past them."""
        table = self.forward_table
        if tokens <= table[0][0] or len(table) == 1:
            return table[0][1] if tokens <= table[0][0] else table[0][1] * tokens / table[0][0]
        for (t0, s0), (t1, s1) in zip(table, table[1:]):
            if tokens <= t1:
                return s0 + (s1 - s0) * (tokens - t0) / (t1 - t0)
        (t0, s0), (t1, s1) = table[-2], table[-1]
        return s1 + (s1 - s0) * (tokens - t1) / (t1 - t0)

    def draft_s(self, rows: int) -> float:
        return self.draft_fixed_s + self.draft_row_s * rows

    def overhead_s(self, rows: int) -> float:
        """What every round of ``rows`` spends beyond its forward and drafts."""
        return self.round_s + self.round_row_s * rows

    def plain_s(self, rows: int) -> float:
        """A plain round of ``rows``: one forward of a position each."""
        return self.round_seconds(rows, 0)

    def chain_s(self, rows: int, k: int) -> float:
        """A chain of ``k``: k drafter steps, one forward over ``k + 1`` positions a row."""
        return self.round_seconds(rows, k)

    def lookup_s(self, k: int) -> float:
        """A lone row's round of ``k`` prompt-lookup drafts: a chain's, less its drafter steps."""
        return self.chain_s(1, k) - k * self.draft_s(1)

    def round_seconds(self, rows: int, k: int) -> float:
        """A round of ``rows`` and ``k`` drafts (0: plain): as calibrate timed it decoding alone
        where it did (``rounds``; linear between timed widths), and elsewhere the model
        scaled to agree with the nearest timed round (the widest width, the nearest k).
        Memoized: the policy prices ~10 rounds every step, and pricing them anew was a quarter
        of a width-1 step's ~90 us decision."""
        return _priced(self, rows, k)

    def _round_seconds(self, rows: int, k: int) -> float:
        ks = {kk for _, kk, _ in self.rounds}
        if not ks:
            return self.modelled_s(rows, k)
        if k not in ks:  # scaled from the nearest timed k, so that k's prices stay consistent
            near = min(ks, key=lambda kk: (abs(kk - k), -kk))
            return self.round_seconds(rows, near) * self.modelled_s(rows, k) / self.modelled_s(rows, near)
        timed = [(w, s) for w, kk, s in self.rounds if kk == k]
        for (w0, s0), (w1, s1) in zip(timed, timed[1:]):
            if w0 <= rows <= w1:
                return s0 + (s1 - s0) * (rows - w0) / (w1 - w0)
        w, s = timed[-1] if rows >= timed[-1][0] else timed[0]
        return s * self.modelled_s(rows, k) / self.modelled_s(w, k)

    def modelled_s(self, rows: int, k: int) -> float:
        """The model's round: k drafter steps, one forward over ``k + 1`` positions a row,
        the overheads (a plain round: one position, no drafts, no verify)."""
        seconds = k * self.draft_s(rows) + self.forward_s(rows, k + 1) + self.overhead_s(rows)
        return seconds + (self.verify_s if k else 0.0)

    def to_json(self) -> dict:
        data = attrs.asdict(self)
        data["forward_table"] = [list(p) for p in self.forward_table]
        data["rounds"] = [list(r) for r in self.rounds]
        return data

    @classmethod
    def from_json(cls, data: dict) -> "CostModel":
        """Every field present in ``data`` (a calibration file from before a field existed
        keeps that field's default)."""
        known = {f.name for f in attrs.fields(cls)}
        return cls(**{k: (v if k in ("forward_table", "rounds") else float(v)) for k, v in data.items() if k in known})


@functools.lru_cache(maxsize=4096)
def _priced(cost: CostModel, rows: int, k: int) -> float:
    return cost._round_seconds(rows, k)
