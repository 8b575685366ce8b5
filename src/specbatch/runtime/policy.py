"""The speculation policy: each round's decision (plain, a chain of k, or a tree) for the
batch as it is, from a cost model and each live row's acceptance by draft position.

Vocabulary: a row's *acceptance* at position i is the chance the target accepts draft i
given it accepted drafts 1..i-1 (conditional, per position); a chain of k then emits
``1 + sum_i prod_{j<=i} a_j`` tokens per row and costs ``k`` drafter steps plus one target
forward over ``rows x (k + 1)`` positions. The policy picks the candidate with the most
expected emitted tokens per second; plain is one forward over ``rows x 1`` for one token a
row. The acceptance book (``book.py``) tracks acceptance online; ``SpecPolicy.decide`` is
pure: the same rows, the same decision. The draft length is decided here and nowhere else,
a lone row's prompt-lookup drafts' too (``Decision.lookup``).
"""

from __future__ import annotations

from typing import Sequence

import attrs

from .cost import CostModel
from .tree_shape import BatchTree, TreeShape

__all__ = ["CostModel", "Decision", "Prior", "RowState", "SpecPolicy", "PLAIN"]

SIBLING = 0.5  # a sibling candidate accepts at this fraction of the one before it (the model of a tree)
MARGIN = 0.02  # the better mode must beat the one the last round ran by this much to switch (unmodelled overheads)
PRIOR_ACCEPTANCE = 0.6  # per position, where no calibration says otherwise
# per position, a prompt-lookup draft after a suffix match of 4+ tokens, before a row's own
# rounds say more: greedy and sampled (held-out code and chat answers, 4 drafts a round: 3.3-3.7
# tokens a round at T = 0; code 3.3 at 0.7 and 2.9 at 1.0, chat 1.85 at 0.7, so each row
# learns its own, quickly)
LOOKUP_ACCEPTANCE, LOOKUP_SAMPLED = 0.75, 0.55


def _bands(value) -> tuple[tuple[float, tuple[float, ...]], ...]:
    """(max temperature, acceptance by position) pairs, coldest first (JSON lists too)."""
    return tuple(sorted((float(t), tuple(float(a) for a in acc)) for t, acc in value))


@attrs.frozen
class Prior:
    """What calibration knows before any round: the costs and the acceptance by position,
    pooled over every temperature (``acceptance``) and, where calibrate measured them, per
    temperature band (``bands``: a row starts from its band's)."""

    cost: CostModel = attrs.field(factory=CostModel)
    acceptance: tuple[float, ...] = attrs.field(default=(PRIOR_ACCEPTANCE,), converter=tuple)
    bands: tuple[tuple[float, tuple[float, ...]], ...] = attrs.field(default=(), converter=_bands)

    def at(self, position: int, temperature: float | None = None) -> float:
        """Acceptance at ``position`` (1-based; past the measured ones, the deepest measured),
        for a row at ``temperature`` where a band holds it, else pooled."""
        acceptance = next((acc for t, acc in self.bands if temperature is not None and temperature <= t and acc),
                          self.acceptance)
        return acceptance[min(position, len(acceptance)) - 1]


def to_prior(value) -> Prior:
    """A ``Prior``, or its ``attrs.asdict`` form (a config sent over the wire)."""
    if isinstance(value, dict):
        return Prior(CostModel.from_json(value["cost"]), value["acceptance"], value.get("bands", ()))
    return value


@attrs.frozen
class Decision:
    """One round: ``k`` drafts a chain (0: plain), or ``tree`` (its depth is ``k``)."""

    k: int = 0
    tree: TreeShape | None = None
    # a lone row whose stream repeats itself drafts up to this many prompt-lookup tokens
    # instead (kernels/drafters/lookup.py), whatever k says (0: never)
    lookup: int = 0

    @property
    def plain(self) -> bool:
        return self.k < 1

    def within(self, room: int) -> "Decision":
        """Cut to ``room`` drafts (a row's budget left after the bonus token)."""
        lookup = min(self.lookup, max(room, 0))
        if room >= self.k:
            return self if lookup == self.lookup else attrs.evolve(self, lookup=lookup)
        shape = None if self.tree is None else self.tree.cut(max(room, 1))
        return Decision(max(room, 0), None if shape is None or shape.is_chain or room < 1 else shape, lookup)


PLAIN = Decision()


@attrs.frozen
class RowState:
    """A live row as the policy sees it: acceptance by position (1-based) and temperature."""

    acceptance: tuple[float, ...] = attrs.field(converter=tuple)
    temperature: float = 0.0
    lookup: tuple[float, ...] = attrs.field(default=(LOOKUP_ACCEPTANCE,), converter=tuple)  # prompt lookup's

    def at(self, position: int) -> float:
        return self.acceptance[min(position, len(self.acceptance)) - 1] if self.acceptance else 0.0

    def looked_up(self) -> "RowState":
        """This row as its prompt-lookup drafts accept."""
        return RowState(self.lookup, self.temperature, self.lookup)


def lookup_prior(temperature: float) -> float:
    return LOOKUP_ACCEPTANCE if temperature == 0.0 else LOOKUP_SAMPLED


def chain_tokens(row: RowState, k: int) -> float:
    """Expected emitted tokens of one row for a chain of ``k`` (the bonus token included)."""
    return chain_totals(row, k)[k]


def chain_totals(row: RowState, k: int) -> list[float]:
    """``chain_tokens`` for every chain of 0..k in one pass (the policy weighs them all)."""
    totals, reach = [1.0], 1.0
    for i in range(1, k + 1):
        reach *= row.at(i)
        totals.append(totals[-1] + reach)
    return totals


def tree_tokens(row: RowState, shape: TreeShape) -> float:
    """Expected emitted tokens of one row for ``shape``: at each depth, the chance that one of
    its ``b`` candidates is accepted, each sibling at ``SIBLING`` times the one before."""
    total, reach = 1.0, 1.0
    for depth, b in enumerate(shape.branching, start=1):
        a, miss = row.at(depth), 1.0
        for c in range(b):
            miss *= 1.0 - a * SIBLING ** c
        reach *= 1.0 - miss
        total += reach
    return total


def tree_seconds(cost: CostModel, rows: int, shape: TreeShape) -> float:
    """One drafter step per depth over every node at that depth, one forward over all nodes."""
    level, draft = 1, 0.0
    for b in shape.branching:
        level *= b
        draft += cost.draft_s(rows * level)
    return draft + cost.forward_s(rows, shape.nodes)  # nodes counts the root


@attrs.frozen(kw_only=True)
class SpecPolicy:
    """Decides each round from the cost model and the rows' acceptance (pure).

    ``max_k``: the longest chain considered. ``fixed``: every speculating round drafts
    ``max_k`` (or ``tree``), whatever it costs (the A/B override). ``tree``: a lone row's
    candidate tree (None: chains; ``tree_max_temperature``: hotter rows draft chains);
    ``batch_tree``: the batch's, up to its width and temperature. ``cap``: the gate's key,
    the widest batch that speculates (0: uncapped); ``max_temperature``: a row hotter than
    this gates the batch. ``trees``: the verify mode scores trees (coupled)."""

    prior: Prior = attrs.field(factory=Prior)
    max_k: int = 4
    speculation: bool = True
    fixed: bool = False
    cap: int = 0
    max_temperature: float | None = None
    tree: TreeShape | None = None
    tree_max_temperature: float | None = None
    batch_tree: BatchTree | None = None
    trees: bool = True
    lookup_k: int = 0  # a lone row's prompt-lookup drafts a round (0: none)

    # -- the gate ---------------------------------------------------------------------
    def within_cap(self, width: int) -> bool:
        """The cap is inclusive: width == cap still speculates; 0 means uncapped."""
        return self.speculation and (self.cap == 0 or width <= self.cap)

    def speculates(self, temperatures: Sequence[float]) -> bool:
        """Rows at these temperatures decoding together may speculate (the gate's guard)."""
        hot = self.max_temperature is not None and max(temperatures, default=0.0) > self.max_temperature
        return bool(temperatures) and self.within_cap(len(temperatures)) and not hot

    # -- the round --------------------------------------------------------------------
    def decide(self, rows: Sequence[RowState], previous: Decision = PLAIN) -> Decision:
        """The round with the most expected emitted tokens per second. Switching costs: a
        batch that speculated in its ``previous`` round goes plain only where plain beats
        every draft by ``MARGIN``, one that decoded plain drafts only where a draft beats
        plain by it (a batch near the break-even flipped modes on each wobble of its rows'
        acceptance; keeping the mode measured level to 4% faster: width 4, 382 vs 366 tok/s)."""
        if not self.speculates([r.temperature for r in rows]):
            return PLAIN
        decision = self._drafted(rows, previous)
        lookup = self._lookup(rows, decision)
        return Decision(decision.k, decision.tree, lookup) if lookup else decision

    def _lookup(self, rows: Sequence[RowState], decision: Decision) -> int:
        """How many prompt-lookup drafts a lone row's round takes where its stream repeats:
        the most expected tokens a second at the row's lookup acceptance (no drafter steps),
        if that beats the round decided; 0 otherwise."""
        if not self.lookup_k or len(rows) != 1:
            return 0
        totals, cost = chain_totals(rows[0].looked_up(), self.lookup_k), self.prior.cost
        rates = {k: totals[k] / cost.lookup_s(k) for k in range(1, self.lookup_k + 1)}
        best = max(rates, key=rates.__getitem__)
        return best if rates[best] > self.rate(rows, decision) else 0

    def _drafted(self, rows: Sequence[RowState], previous: Decision) -> Decision:
        tree = self._tree_for(rows)
        if self.fixed:
            return Decision(tree.depth, tree) if tree is not None else Decision(self.max_k)
        candidates = [Decision(k) for k in range(1, self.max_k + 1)]
        # every chain's rate from one pass over each row (what rate() gives each, summed alike)
        totals = [sum(tokens) for tokens in zip(*(chain_totals(r, self.max_k) for r in rows))]
        rates = [totals[c.k] / self.prior.cost.chain_s(len(rows), c.k) for c in candidates]
        if tree is not None:
            candidates.append(Decision(tree.depth, tree))
            rates.append(self.rate(rows, candidates[-1]))
        best = max(range(len(candidates)), key=rates.__getitem__)
        plain = self.rate(rows, PLAIN)
        drafting = rates[best] > plain * (1.0 + MARGIN) if previous.plain else plain <= rates[best] * (1.0 + MARGIN)
        return candidates[best] if drafting else PLAIN

    def rate(self, rows: Sequence[RowState], decision: Decision) -> float:
        """Expected emitted tokens per second of ``rows`` under ``decision``."""
        cost, width = self.prior.cost, len(rows)
        if decision.plain:
            return width / cost.plain_s(width)
        if decision.tree is not None:
            tokens = sum(tree_tokens(r, decision.tree) for r in rows)
            return tokens / (tree_seconds(cost, width, decision.tree) + cost.overhead_s(width) + cost.verify_s)
        k = decision.k
        return sum(chain_tokens(r, k) for r in rows) / cost.chain_s(width, k)

    def _tree_for(self, rows: Sequence[RowState]) -> TreeShape | None:
        hottest = max(r.temperature for r in rows)
        if not self.trees:
            return None
        if len(rows) == 1:
            hot = self.tree_max_temperature is not None and hottest > self.tree_max_temperature
            shape = None if hot or self.tree is None else self.tree.cut(self.max_k)
        else:
            t = self.batch_tree
            fits = t is not None and len(rows) <= t.max_width
            hot = fits and t.max_temperature is not None and hottest > t.max_temperature
            shape = t.shape.cut(self.max_k) if fits and not hot else None
        return None if shape is None or shape.is_chain else shape

    def paying_width(self, widest: int = 64) -> int:
        """The widest width at which speculation is expected to pay on the prior (0: none)."""
        row = RowState(self.prior.acceptance)
        paying = [w for w in range(1, widest + 1) if not attrs.evolve(self, cap=0).decide([row] * w).plain]
        return max(paying, default=0)
