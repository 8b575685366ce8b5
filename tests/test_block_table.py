"""The paged cache's block table: blocks handed out in token order, growth that copies rarely."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from specbatch.kernels import block_table
from specbatch.kernels.block_table import BLOCK, BlockTable


def decode(table: BlockTable, lengths: list[int], steps: int) -> int:
    """Grow every row one token a step; the number of times the pools' capacity grew (each
    growth copies every layer's pools)."""
    grows, capacity = 0, table.capacity
    for _ in range(steps):
        lengths = [n + 1 for n in lengths]
        table.ensure(lengths)
        grows += table.capacity != capacity
        capacity = table.capacity
        assert all(len(row) * BLOCK >= n for row, n in zip(table.rows, lengths))
    return grows


def test_growth_copies_once_per_two_boundaries_a_row(monkeypatch):
    """8 rows decoding 96 tokens cross 48 block boundaries between them: the pools grow at
    most once per two boundaries a row crosses (growing by 1/16 of the pool alone grew 22
    times here), and what is held stays within two spare blocks a row of what is used."""
    rng = random.Random(0)
    lengths = [rng.randrange(10, 60) for _ in range(8)]
    table = BlockTable([[] for _ in lengths])
    table.ensure(lengths)
    grows = decode(table, lengths, 96)
    assert grows <= 96 // (2 * BLOCK) + 1, grows
    assert table.capacity - table.used() <= len(lengths) * block_table.ROW_SPARE
    monkeypatch.setattr(block_table, "ROW_SPARE", 0)  # the old rule, for contrast: a copy at nearly every boundary
    old = BlockTable([[] for _ in lengths])
    old.ensure(lengths)
    assert decode(old, lengths, 96) > 4 * grows


def test_rows_keep_their_blocks_in_token_order_and_release_their_tails():
    table = BlockTable([[], []])
    table.ensure([40, 5])
    assert [len(r) for r in table.rows] == [3, 1]
    assert table.rows == [[0, 1, 2], [3]]  # low ids first, each row's in token order
    slots = table.slots([38, 4], 3).tolist()  # row 0 tokens 38..40, row 1 tokens 4..6
    assert slots == [2 * BLOCK + 6, 2 * BLOCK + 7, 2 * BLOCK + 8, 3 * BLOCK + 4, 3 * BLOCK + 5, 3 * BLOCK + 6]
    table.release_tail([16, 5])
    assert table.rows == [[0], [3]] and sorted(table.free) == [1, 2]


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(st.integers(0, 200), max_size=6), min_size=1, max_size=5),
       data=st.data(), n=st.integers(1, 80))
def test_write_slots_are_the_tables_slots_at_every_size(rows, data, n):
    """A step's write slots (plain Python up to SMALL slots, numpy beyond) are the token's
    block * BLOCK + offset, and past a row's blocks the same clamped slots either way."""
    table = BlockTable(rows=[list(r) for r in rows])
    lengths = data.draw(st.lists(st.integers(0, 7 * BLOCK), min_size=len(rows), max_size=len(rows)))
    got = table.slots(lengths, n).tolist()
    assert got == table._slots_at(np.asarray(lengths)[:, None] + np.arange(n)).reshape(-1).tolist()
    assert table.slots(lengths, n).tolist() == got  # memoised
