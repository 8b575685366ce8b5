"""The drafter lives on the driver; followers verify the drafts it relays.

``RelayDrafter`` wraps the driver's real drafter and broadcasts each round's drafted
tokens ``[B, k]`` (and, under rejection verification, the draft logits ``[B, k, V]``, which
Leviathan acceptance reads). ``EchoDrafter`` is the followers' side: it receives them and
tracks only the row count, so a follower holds no drafter weights and no drafter KV.
"""

from __future__ import annotations

import mlx.core as mx

from ...kernels.drafters.base import Capture, Chooser
from .peers import Peers


class RelayDrafter:
    """Driver side: draft with ``inner``, then broadcast what the followers need."""

    tree_width = 0  # the drafts relayed are chains

    def __init__(self, inner, peers: Peers, send_logits: bool):
        self.inner, self.peers, self.send_logits = inner, peers, send_logits

    @property
    def width(self) -> int:
        return self.inner.width

    def draft(self, prev: mx.array, pending: mx.array, k: int, choose: Chooser, context=None):
        tokens, logits = self.inner.draft(prev, pending, k, choose, context=context)
        tokens = self.peers.broadcast(tokens, tokens.shape, mx.int32)  # [B, k]
        mx.eval(tokens)  # one collective at a time: followers evaluate in the same order
        if self.send_logits:
            logits = self.peers.broadcast(logits, logits.shape, mx.float32)  # [B, k, V]
            mx.eval(logits)
        return tokens, logits

    def rollback(self, counts, hidden=None) -> None:
        self.inner.rollback(counts, hidden=hidden)

    def advance(self, tokens, hidden=None) -> None:
        self.inner.advance(tokens, hidden=hidden)

    def add_rows(self, histories, hidden=None) -> None:
        self.inner.add_rows(histories, hidden=hidden)

    def filter(self, keep) -> None:
        self.inner.filter(keep)

    def reset(self) -> None:
        self.inner.reset()

    def cold_start(self, capture: Capture) -> None:
        self.inner.cold_start(capture)

    def nbytes(self) -> int:
        return self.inner.nbytes()


class EchoDrafter:
    """Follower side: the driver's drafts, as if drafted here."""

    tree_width = 0

    def __init__(self, peers: Peers, vocab: int, send_logits: bool):
        self.peers, self.vocab, self.send_logits = peers, vocab, send_logits
        self._width = 0

    @property
    def width(self) -> int:
        return self._width

    def draft(self, prev: mx.array, pending: mx.array, k: int, choose: Chooser, context=None):
        B = pending.shape[0]
        tokens = self.peers.broadcast(None, (B, k), mx.int32)
        mx.eval(tokens)
        if self.send_logits:
            logits = self.peers.broadcast(None, (B, k, self.vocab), mx.float32)
            mx.eval(logits)
        else:  # coupled verification never reads draft logits
            logits = mx.zeros((B, k, self.vocab))
        return tokens, logits

    def rollback(self, counts, hidden=None) -> None:
        pass

    def advance(self, tokens, hidden=None) -> None:
        pass

    def add_rows(self, histories, hidden=None) -> None:
        self._width += len(histories)

    def filter(self, keep) -> None:
        self._width = len(keep)

    def reset(self) -> None:
        self._width = 0

    def cold_start(self, capture: Capture) -> None:
        self._width = len(capture.histories)

    def nbytes(self) -> int:
        return 0
