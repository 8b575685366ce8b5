"""The host window of a pipelined plain round: while the batch loop's successor computes, the
host thread emits the round's tokens, does the engine's bookkeeping and builds the next graph.
On a machine whose cores the kernel threads all take (two-core Zen 4 here), that host work took
cycles from the compute (pipelined rounds were slower than unpipelined ones); inside the window
the kernels split over one thread fewer, so the host has a core of its own, and every thread
comes back when the host waits. The bits never change (each output is one thread's whole).
"""

from __future__ import annotations

from . import _active

# Bounded, so a window nothing closes costs the kernels after it at most this long on one
# thread fewer.
HOST_WINDOW_US = 2000
# The widest batch whose plain rounds pipeline through the window: two-core Zen 4, plain decode
# toggled in one process, pipelined with the window / unpipelined: widths 1 / 2 / 4 / 8 / 16
# 0.957 / 0.963 / 0.987 / 1.01 / 1.11x the time (pipelined without it at 16: 1.08x).
HOST_WINDOW_WIDTH = 4


def open_host_window() -> None:
    """Kernels evaluated from now on (the successor in flight) leave one core to this thread,
    until ``close_host_window`` or ``HOST_WINDOW_US`` microseconds."""
    ext = _active()
    if ext is None:
        return
    ext.pool_cap(0)  # the pool's whole size, whatever cap was set before
    if ext.threads() > 1:
        ext.pool_cap(ext.threads() - 1, HOST_WINDOW_US)


def close_host_window() -> None:
    """Every thread again (this thread is about to wait on the kernels)."""
    ext = _active()
    if ext is not None:
        ext.pool_cap(0)
