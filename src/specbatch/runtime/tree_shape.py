"""Token trees for speculative rounds: their shape, their layout, and the accept walk.

Vocabulary (extends ``loops/verify.py``'s):
- *tree shape* ``[b_1, .., b_k]``: every node at depth ``d - 1`` has ``b_d`` children, so
  depth ``d`` holds ``b_1 * .. * b_d`` nodes; a chain of ``k`` drafts is ``[1] * k``;
- *node*: one token of a round's tree, numbered breadth first; node 0 is the *root*, the
  row's pending token (depth 0); ``parents[n]`` is node ``n``'s parent (-1 for the root);
- *path*: the accepted nodes ``p_1 .. p_a`` (depths 1 .. a), found by the *walk*: from
  the root, step to the child whose token equals the target's own sample at the current
  node, while one does; the round emits the target's samples at ``root, p_1 .. p_a``;
- *dynamic* shape ``[b_1, .., b_k]@s``: the static shape is a bound; a drafter that can
  (the MTP head) keeps a node only when its *path score*, the product of the drafted
  probabilities from the root to it, is at least ``s`` (EAGLE-2's expansion by drafted
  probability: the head's probabilities track acceptance, so ``s`` is the acceptance a
  node must promise to be worth its verify column). Other drafters draft the bound.

No MLX here: the engine's config and the machine read shapes without loading arrays.
"""

from __future__ import annotations

import attrs


def _branching(inst, attr, value) -> None:
    if not value or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in value):
        raise ValueError(f"a tree shape is one or more branchings >= 1, got {list(value)!r}")


def _score(inst, attr, value) -> None:
    if value is not None and not 0.0 < value <= 1.0:
        raise ValueError(f"a tree's minimum path score is in (0, 1], got {value!r}")


@attrs.frozen
class TreeShape:
    """Branching per depth; ``TreeShape.chain(k)`` is the chain of ``k`` drafts;
    ``min_score`` set: a dynamic tree bounded by the branching."""

    branching: tuple[int, ...] = attrs.field(converter=tuple, validator=_branching)
    min_score: float | None = attrs.field(default=None, validator=_score)

    @classmethod
    def chain(cls, k: int) -> "TreeShape":
        return cls((1,) * k)

    @classmethod
    def parse(cls, text: str) -> "TreeShape":
        """``"2,1,1"`` (or ``"[2, 1, 1]"``) to a shape; ``"2,2,1@0.1"`` a dynamic one."""
        bound, _, score = text.partition("@")
        branching = [int(part) for part in bound.strip("[] ").split(",") if part.strip()]
        return cls(branching, float(score) if score.strip() else None)

    @property
    def depth(self) -> int:
        return len(self.branching)

    @property
    def dynamic(self) -> bool:
        return self.min_score is not None

    @property
    def is_chain(self) -> bool:
        """A plain chain of drafts (a dynamic chain stops early: it is a tree round)."""
        return all(b == 1 for b in self.branching) and not self.dynamic

    @property
    def nodes(self) -> int:
        """Nodes including the root: what one verify forward scores (a dynamic tree's bound)."""
        total, width = 1, 1
        for b in self.branching:
            width *= b
            total += width
        return total

    def cut(self, depth: int) -> "TreeShape":
        """The first ``depth`` levels (at least one)."""
        return TreeShape(self.branching[:max(1, depth)], self.min_score)

    def layout(self) -> "TreeLayout":
        parents, depths, frontier = [-1], [0], [0]
        for d, b in enumerate(self.branching, 1):
            nxt = []
            for node in frontier:
                for _ in range(b):
                    nxt.append(len(parents))
                    parents.append(node)
                    depths.append(d)
            frontier = nxt
        return TreeLayout(tuple(parents), tuple(depths))

    def __str__(self) -> str:
        bound = ",".join(map(str, self.branching))
        return bound if self.min_score is None else f"{bound}@{self.min_score:g}"


@attrs.frozen
class TreeLayout:
    """One round's tree structure: ``parents[n]`` and ``depths[n]``, breadth first."""

    parents: tuple[int, ...] = attrs.field(converter=tuple)
    depths: tuple[int, ...] = attrs.field(converter=tuple)

    @classmethod
    def of_parents(cls, parents) -> "TreeLayout":
        depths = []
        for p in parents:
            depths.append(0 if p < 0 else depths[p] + 1)
        return cls(parents, depths)

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        return max(self.depths)

    def ancestry(self) -> list[list[bool]]:
        """``[N, N]``: row ``i`` sees column ``j`` when ``j`` is ``i`` or an ancestor of it."""
        seen = [[False] * self.size for _ in range(self.size)]
        for i in range(self.size):
            j = i
            while j >= 0:
                seen[i][j] = True
                j = self.parents[j]
        return seen

    def children(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in range(self.size)]
        for n, p in enumerate(self.parents):
            if p >= 0:
                out[p].append(n)
        return out


def walk(layout: TreeLayout, drafted: list[int], target: list[int]) -> list[int]:
    """The accepted path ``p_1 .. p_a``: from the root, the first child whose drafted token
    equals the target's sample at the current node, until none does."""
    kids, path, node = layout.children(), [], 0
    while True:
        nxt = next((c for c in kids[node] if drafted[c] == target[node]), None)
        if nxt is None:
            return path
        path.append(nxt)
        node = nxt


def _tree(value) -> TreeShape:
    return value if isinstance(value, TreeShape) else TreeShape.parse(str(value))


@attrs.frozen
class BatchTree:
    """Where batches draft a token tree per row instead of a chain: ``shape`` at widths 2 ..
    ``max_width``, while no row is hotter than ``max_temperature`` (None: any); calibrated."""

    shape: TreeShape = attrs.field(converter=_tree)
    max_width: int = attrs.field(validator=attrs.validators.ge(2))
    max_temperature: float | None = None

    @classmethod
    def of(cls, value) -> "BatchTree | None":
        """None, a ``BatchTree`` or its JSON form ``{"shape": "3,2,1@0.1", "max_width": 4, ...}``."""
        if value is None or isinstance(value, BatchTree):
            return value
        return cls(**value)

    def to_json(self) -> dict:
        return {"shape": str(self.shape), "max_width": self.max_width, "max_temperature": self.max_temperature}
