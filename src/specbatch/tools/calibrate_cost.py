"""The policy's cost model from the rounds ``calibrate`` timed.

Each measured cell (a width ``w``, a draft length ``k``, 0 = plain) gives a round's
seconds: its rows emitted ``w * tau`` tokens at the measured tokens/s, where a row emits
``tau = 1 + k * a`` tokens a round at the cell's measured acceptance ``a`` (1 plain). The
policy prices a round as ``forward_s(w, k + 1) + k * draft_s(w)`` (``runtime.policy``):

    seconds = target_fixed + target_token * w * (k + 1) + k * draft_fixed + k * w * draft_row

linear in the four costs, so one least-squares fit over every cell gives them, engine
overhead and sampling included where they fall (a cost fitted below zero is pinned at zero
and the rest refitted). Errors are weighed relative to each round's seconds.
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


def fit_cost(cells: list[Cell]) -> CostModel | None:
    """The four costs that best explain ``cells``' round times; None without both plain and
    drafted cells at two widths or more (the fit would be underdetermined)."""
    if len({c.width for c in cells if c.k == 0}) < 2 or len({c.width for c in cells if c.k > 0}) < 2:
        return None
    rows = np.array([_terms(c) for c in cells])  # [cells, 4]
    target = np.array([c.round_s for c in cells])  # [cells]
    weight = 1.0 / target  # relative errors: a 16-row round does not drown a 1-row one
    free = [0, 1, 2, 3]
    while True:
        solution, *_ = np.linalg.lstsq(rows[:, free] * weight[:, None], target * weight, rcond=None)
        if (solution >= 0).all() or len(free) == 1:
            break
        free.pop(int(np.argmin(solution)))  # the most negative cost is pinned at zero
    costs = np.zeros(4)
    costs[free] = np.maximum(solution, 0.0)
    return CostModel(*[float(c) for c in costs])


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
