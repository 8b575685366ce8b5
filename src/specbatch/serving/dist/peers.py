"""The ranks of a sharded target: one MLX distributed group, a broadcast, and a watchdog.

Rank 0 is the *driver*; every other rank is a *follower*. All messages are broadcasts
from the driver, made of ``all_sum`` with zeros from the followers, so they work on every
backend MLX ships (ring, MPI, NCCL). A *plan* message goes out before every step and at
least every half second while idle, which doubles as the heartbeat the watchdog watches.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

import mlx.core as mx
import numpy as np
import structlog

log = structlog.get_logger(__name__)

SMALL = 4096  # bytes a message carries in its first broadcast; longer ones take a second
HANG_EXIT = 75  # exit status after a peer stopped answering (EX_TEMPFAIL)


class PeerLost(RuntimeError):
    """A rank died, stopped answering, or disagrees about the state of the machine."""


def is_peer_failure(exc: BaseException) -> bool:
    """Errors no rank can recover from: a collective that failed, or our own PeerLost."""
    text = str(exc)
    return isinstance(exc, PeerLost) or "[ring]" in text or "[mpi]" in text or "[nccl]" in text


class Peers:
    """The group, seen from one rank."""

    def __init__(self, group, timeout_s: float = 60.0):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.timeout_s = timeout_s
        self._last_heard = time.monotonic()
        self._watch: threading.Thread | None = None
        self._stopped = threading.Event()

    @classmethod
    def init(cls, backend: str = "ring", timeout_s: float = 60.0) -> "Peers":
        """Join the group ``mlx.launch`` set up (``MLX_RANK``, ``MLX_HOSTFILE``)."""
        if not mx.distributed.is_available():
            raise RuntimeError("this MLX build has no distributed backend")
        group = mx.distributed.init(strict=True, backend=backend)
        if group.size() < 2:
            raise RuntimeError("--distributed needs at least 2 ranks; start it with mlx.launch -n 2 ...")
        return cls(group, timeout_s)

    @property
    def driver(self) -> bool:
        return self.rank == 0

    # -- broadcasts ------------------------------------------------------------------------
    def broadcast(self, value: mx.array | None, shape: tuple, dtype) -> mx.array:
        """The driver's ``value`` on every rank (lazy); followers pass ``None``."""
        x = value.astype(dtype) if self.driver else mx.zeros(shape, dtype=dtype)
        return mx.distributed.all_sum(x, group=self.group)

    def send_bytes(self, payload: bytes | None) -> bytes:
        """Driver: send ``payload``; followers: pass None and get it."""
        head = np.zeros(SMALL + 8, dtype=np.uint8)
        if self.driver:
            head[:8] = np.frombuffer(len(payload).to_bytes(8, "little"), dtype=np.uint8)
            head[8:8 + min(len(payload), SMALL)] = np.frombuffer(payload[:SMALL], dtype=np.uint8)
        got = np.array(self._sum(head))
        n = int.from_bytes(got[:8].tobytes(), "little")
        if n <= SMALL:
            data = got[8:8 + n].tobytes()
        else:
            rest = np.frombuffer(payload, dtype=np.uint8) if self.driver else np.zeros(n, dtype=np.uint8)
            data = np.array(self._sum(rest)).tobytes()
        self._last_heard = time.monotonic()
        return data

    def _sum(self, x: np.ndarray) -> mx.array:
        out = mx.distributed.all_sum(mx.array(x), group=self.group)
        mx.eval(out)
        return out

    # -- the watchdog ------------------------------------------------------------------------
    def watch(self, on_hang: Callable[[str], None], grace_s: float = 2.0) -> None:
        """If no message passes for ``timeout_s``, a peer (or this rank's collective) is
        stuck: report, give ``on_hang`` ``grace_s`` to fail requests, then exit the process,
        since a thread blocked in a collective cannot be woken."""
        def run():
            while not self._stopped.wait(min(1.0, self.timeout_s / 4)):
                quiet = time.monotonic() - self._last_heard
                if quiet > self.timeout_s:
                    error = (f"rank {self.rank}: no message from the other ranks for {quiet:.0f}s "
                             f"(timeout {self.timeout_s:.0f}s); a peer died or stopped answering")
                    log.error("peer_timeout", rank=self.rank, quiet_s=round(quiet, 1))
                    try:
                        on_hang(error)
                        time.sleep(grace_s)
                    finally:  # whatever on_hang did, this process must not hang on
                        print(f"specbatch: {error}", file=sys.stderr, flush=True)
                        os._exit(HANG_EXIT)
        self._last_heard = time.monotonic()
        self._watch = threading.Thread(target=run, name="specbatch-peer-watchdog", daemon=True)
        self._watch.start()

    def stop(self) -> None:
        self._stopped.set()

    def expect_loss(self, within_s: float = 5.0) -> None:
        """A signal says a peer is going (mlx.launch terminates every rank when one fails):
        stop waiting for the full timeout."""
        self.timeout_s = min(self.timeout_s, within_s)
