"""The policy's cost model from the rounds ``calibrate`` timed.

Each measured cell (a width ``w``, a draft length ``k``, 0 = plain) gives a round's
seconds: its rows emitted ``w * tau`` tokens at the measured tokens/s, where a row emits
``tau = 1 + k * a`` tokens a round at the cell's measured acceptance ``a`` (1 plain). The
policy prices a round as ``forward_s(w, k + 1) + k * draft_s(w)`` (``runtime.policy``):

    seconds = target_fixed + target_token * w * (k + 1) + k * draft_fixed + k * w * draft_row

linear in the four costs, so one least-squares fit over every cell gives them, engine
overhead and sampling included where they fall (a cost fitted below zero is pinned at zero
and the rest refitted). Errors are weighed relative to each round's seconds.

Where the target's forwards were timed directly (``measure_forwards``: one row over 1-48
positions, 2-16 rows of one), their table prices the forward, and the same fit gives what
the rounds spend beyond it: the drafter's steps, ``verify_s``, ``round_s`` and ``round_row_s``
a row. Fit those to rounds decoding alone (``calibrate``'s ``decode`` rates): a cell timed
end to end spreads its rows' prefills over its rounds, which reads as a cost a row that
plain rounds pay more often than speculative ones.
"""

from __future__ import annotations

import attrs
import numpy as np

from ..runtime.policy import CostModel


@attrs.frozen
class Cell:
    width: int
    k: int  # 0: plain
    tok_s: float
    acceptance: float = 0.0  # accepted / drafted in this cell (plain: unused)

    @property
    def round_s(self) -> float:
        tau = 1.0 + self.k * self.acceptance
        return self.width * tau / self.tok_s


def _terms(cell: Cell) -> list[float]:
    w, k = cell.width, cell.k
    return [1.0, w * (k + 1.0), float(k), float(k * w)]


def _overhead_terms(cell: Cell) -> list[float]:
    w, k = cell.width, cell.k
    return [float(k), float(k * w), float(k > 0), 1.0, float(w)]  # draft_fixed, draft_row, verify_s, round_s, round_row_s


def fit_cost(cells: list[Cell], forwards: CostModel | None = None) -> CostModel | None:
    """The costs that best explain ``cells``' round times (with ``forwards``, a model holding
    the measured forward table: what the rounds spend beyond those forwards); None without
    both plain and drafted cells at two widths or more (the fit would be underdetermined)."""
    if len({c.width for c in cells if c.k == 0}) < 2 or len({c.width for c in cells if c.k > 0}) < 2:
        return None
    if forwards is not None and forwards.forward_table:
        rows = np.array([_overhead_terms(c) for c in cells])  # [cells, 4]
        spent = np.array([c.round_s - forwards.forward_s(c.width, c.k + 1) for c in cells])
        costs = _nonnegative_fit(rows, spent, np.array([c.round_s for c in cells]))
        return attrs.evolve(forwards, draft_fixed_s=costs[0], draft_row_s=costs[1], verify_s=costs[2],
                            round_s=costs[3], round_row_s=costs[4])
    target = np.array([c.round_s for c in cells])  # [cells]
    return CostModel(*_nonnegative_fit(np.array([_terms(c) for c in cells]), target, target))


def _nonnegative_fit(rows: np.ndarray, target: np.ndarray, scale: np.ndarray) -> list[float]:
    """Least squares of ``rows @ costs = target`` relative to ``scale`` (each round's seconds:
    a 16-row round does not drown a 1-row one), every cost >= 0."""
    weight = 1.0 / scale
    free = list(range(rows.shape[1]))
    while True:
        solution, *_ = np.linalg.lstsq(rows[:, free] * weight[:, None], target * weight, rcond=None)
        if (solution >= 0).all() or len(free) == 1:
            break
        free.pop(int(np.argmin(solution)))  # the most negative cost is pinned at zero
    costs = np.zeros(rows.shape[1])
    costs[free] = np.maximum(solution, 0.0)
    return [float(c) for c in costs]


def timed_rounds(cells: list[Cell]) -> list[tuple[int, int, float]]:
    """(width, k, seconds) of each timed round shape: the median over the cells (the
    temperature bands) that timed it; a round's seconds hardly depend on temperature."""
    by_shape: dict[tuple[int, int], list[float]] = {}
    for c in cells:
        by_shape.setdefault((c.width, c.k), []).append(c.round_s)
    return [(w, k, float(np.median(s))) for (w, k), s in sorted(by_shape.items())]


TABLE_TOKENS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48)
ROW_WIDTHS = (2, 4, 8, 16)


def measure_forwards(model, repeats: int = 7, passes: int = 3) -> CostModel:
    """The target's forwards timed directly (over a 128-token context): one row's forward by
    positions, and what each row past the first adds at equal tokens. Each shape is timed
    in ``passes`` passes, every shape in turn within each repeat (the least median kept:
    noise only ever adds time), and the table made non-decreasing from above (a forward of
    more tokens never costs less)."""
    from .bench.kernels import forward_times
    shapes = [(1, n) for n in TABLE_TOKENS] + [(w, 1) for w in ROW_WIDTHS]
    best = {shape: float("inf") for shape in shapes}
    for _ in range(passes):
        times = forward_times(model, shapes, repeats, mlx_ops=False)
        for rows, positions in shapes:
            best[rows, positions] = min(best[rows, positions], times[rows, positions, True] / 1e3)
    seconds = [best[1, n] for n in TABLE_TOKENS]
    for i in range(len(seconds) - 2, -1, -1):
        seconds[i] = min(seconds[i], seconds[i + 1])
    forwards = CostModel(forward_table=list(zip(TABLE_TOKENS, seconds)))
    extra = [(best[w, 1] - forwards.tokens_s(w)) / (w - 1) for w in ROW_WIDTHS]
    return attrs.evolve(forwards, row_s=max(0.0, float(np.median(extra))))


def cells_from(table: dict, acceptance: dict) -> list[Cell]:
    """Cells from ``measure_schedule``'s table (``"T=t width=w" -> {k: tok/s}``) and the
    acceptance it measured per cell (same keys -> {k: accepted / drafted})."""
    cells = []
    for key, by_k in table.items():
        if " width=" not in key:
            continue
        width = int(key.partition(" width=")[2])
        for k, tok_s in by_k.items():
            if tok_s:
                cells.append(Cell(width, int(k), float(tok_s), float(acceptance.get(key, {}).get(k, 0.0))))
    return cells
