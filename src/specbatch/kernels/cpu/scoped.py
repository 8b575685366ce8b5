"""A per-thread setting that a ``with`` block changes and restores: the CPU kernels'
switches (``disabled``, ``row_blocks``, ``half.float32_kept``), each seen only by the thread
that set it, so an engine thread and a benchmark's baseline never see each other's."""

from __future__ import annotations

import contextlib
import threading


class Scoped:
    """``get()`` this thread's value (``default`` outside any block); ``within(value)`` sets
    it for a ``with`` block, nesting as blocks do."""

    def __init__(self, default):
        self._local, self._default = threading.local(), default

    def get(self):
        return getattr(self._local, "value", self._default)

    @contextlib.contextmanager
    def within(self, value):
        before = self.get()
        self._local.value = value
        try:
            yield
        finally:
            self._local.value = before
