"""A count of the writes to the swapped modules' items (their parameters and children).

``Module.update``, ``load_weights`` and assigning an array or a module as an attribute all write
a module's items, so while the count stands, a stack that checked its modules and read their
weights at that count may reuse what it read (``stack.Stack``): reading the 270 weights and the
360 module links of the embedded target again cost ~0.25 ms of a width-1 step's graph build,
cold after each step's weight stream.
"""

from __future__ import annotations

_count = [0]


def count() -> int:
    return _count[0]


class Tracked:
    """Mixed into each swapped module class: its item writes and deletes move the count."""

    __slots__ = ()

    def __setitem__(self, key, value):
        _count[0] += 1
        super().__setitem__(key, value)

    def __delitem__(self, key):
        _count[0] += 1
        super().__delitem__(key)
