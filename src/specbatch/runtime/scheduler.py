"""What the engine asks of a scheduler, and what the machine asks of its kernels.

These Protocols are the machine's whole view of the kernels: the machine decides, the
objects behind them run rounds. Nothing here imports MLX, so the machine (and the chart
tool) load without it; ``kernels/build.py`` builds the real objects and hands them in.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .output import RoundOutput
    from .policy import Decision
    from .request import Request


class Scheduler(Protocol):
    state: str  # "Idle", "Scalar", "Batched" or "Gated"

    @property
    def busy(self) -> bool: ...

    def step(self, waiting: collections.deque, more_coming: bool) -> list[Request]:
        """Admit from ``waiting`` as policy allows, run one round; return removed requests."""
        ...

    def recover(self) -> list[Request]:
        """After a failed round: drop all rows; return their requests."""
        ...

    def requests(self) -> list[Request]: ...

    def gauges(self) -> dict: ...

    def shutdown(self) -> None: ...


class ScalarRounds(Protocol):
    """The scalar loop as the machine drives it (``loops/scalar.py``)."""

    request: Request
    buffered: int  # tokens of the last round not yet delivered (the next steps run no forward)

    def step(self, decision: Decision) -> RoundOutput:
        """Deliver one token, running the round ``decision`` says when none is buffered."""
        ...

    def close(self):
        """Stop here and return a ``Handoff`` the batch loop rebuilds from."""
        ...

    def memory(self) -> dict: ...


class BatchRounds(Protocol):
    """The batch loop as the machine drives it (``loops/batch.py``)."""

    rows: list
    armed: bool

    @property
    def width(self) -> int: ...

    @property
    def settled(self) -> bool: ...

    def settle(self) -> RoundOutput: ...

    def reap(self) -> list[Request]: ...

    def rebuild(self, handoff) -> RoundOutput: ...

    def capture_round(self) -> RoundOutput: ...

    def disarm(self) -> None: ...

    def spec_round(self, decision: Decision) -> RoundOutput: ...

    def plain_round(self, successor: bool = True) -> RoundOutput: ...

    def memory(self) -> dict: ...


class Kernels(Protocol):
    """Builds loops and owns what outlives them (the target runner, the prompt cache)."""

    target: object  # the loaded target: ``name``, ``vocab_size``, ``context_length``
    drafter: object | None  # the drafter's source (None: plain)
    speculative: bool  # a drafter exists and speculation is on
    token_bytes: int  # target KV bytes per token (0: unknown), for the KV budget
    drafter_name: str | None
    # the host thread builds graphs on a core the compute leaves free (a GPU computes, or the
    # CPU kernels' threads leave one): only there does a plain round gain by dispatching its successor
    spare_core: bool

    def scalar(self, request: Request) -> tuple[ScalarRounds, RoundOutput]:
        """A started scalar loop (prefilled, first token out); each step is told its round."""
        ...

    def batch(self, speculative: bool) -> BatchRounds: ...

    def admit(self, loop: BatchRounds, requests: list[Request]) -> RoundOutput:
        """Prefill ``requests`` into ``loop``; first tokens out, failures and ends in ``done``."""
        ...

    def retire(self, loop: ScalarRounds) -> None:
        """A finished scalar loop offers its KV to the prompt cache."""
        ...

    def ready(self, request: Request) -> bool:
        """It may join while rows decode: its prompt fits one chunk, or its chunks are done."""
        ...

    def prefill_cost(self, request: Request) -> int:
        """Prompt tokens its admission would still prefill."""
        ...

    def prefill_step(self, waiting: list) -> RoundOutput:
        """One chunk of the oldest of ``waiting`` not ready (between rounds; the machine passes
        the waiters within the KV budget); failures in ``done``."""
        ...

    def forget(self, waiting) -> None:
        """Drop partial prefills of requests no longer in ``waiting``."""
        ...

    def gauges(self) -> dict: ...

    def release_memory(self) -> None:
        """The engine went idle: hand freed memory back to the OS."""
        ...

    def end_thread(self) -> None:
        """The thread that ran the rounds is ending (per-thread cleanup)."""
        ...


def take(waiting: collections.deque, joining: list[Request]) -> list[Request]:
    """Remove ``joining`` (waiters, in arrival order) from ``waiting``; return them."""
    if all(a is b for a, b in zip(joining, waiting)):  # a prefix: the common case
        for _ in joining:
            waiting.popleft()
    else:
        for request in joining:
            waiting.remove(request)
    return joining
