"""Prompt lookup beside a head drafter: where the stream's last ``min_match`` tokens occurred
before, the round drafts what followed them there instead of asking the head.

A long suffix match is rare in chat answers but nearly certain when it happens (held-out
chat, greedy: a match of 6+ tokens at 6% of positions, its next token right 0.92 of the
time, against the MTP head's ~0.37), and it costs no forward, so such a round drafts
several tokens where the head's rounds draft one; the policy prices it (``Decision.lookup``:
how many, 0 where it does not pay). The head's rounds go on everywhere else.

Only a drafter whose state between rounds is the target's own (``target_state_only``: the
MTP head keeps just the target's hidden state) can sit out a round like this: its rollback
after the verify sets it from the bonus token's state, whatever was drafted.
"""

from __future__ import annotations

import array

import mlx.core as mx

from .base import Chooser, fixed_logits


class History:
    """One stream's tokens (prompt, then generated), searchable for a repeated suffix: kept
    as int32 bytes, so a search is one ``bytes.rfind`` whatever the length."""

    def __init__(self, tokens: list[int] = ()):
        self._bytes = bytearray()
        self._count = 0
        self.extend(tokens)

    def __len__(self) -> int:
        return self._count

    def extend(self, tokens) -> None:
        self._bytes += array.array("i", tokens).tobytes()
        self._count += len(tokens)

    def sync(self, tokens: list[int], base: int) -> None:
        """Append what ``tokens`` (the stream past its first ``base``) holds beyond what is here."""
        if len(self) < base + len(tokens):
            self.extend(tokens[len(self) - base:])

    def proposal(self, min_match: int, want: int) -> list[int]:
        """Up to ``want`` tokens that followed the latest earlier occurrence of the last
        ``min_match`` tokens; empty where there is none."""
        n = min_match
        if want < 1 or n < 1 or self._count <= n:
            return []
        data, width = self._bytes, 4
        suffix = bytes(data[-n * width:])
        end = len(data) - width  # a match must end before the last token: something follows it
        while True:
            at = data.rfind(suffix, 0, end)
            if at < 0:
                return []
            if at % width == 0:  # whole tokens, not bytes straddling two
                start = at // width + n
                return array.array("i", data[start * width:(start + want) * width]).tolist()
            end = at + len(suffix) - 1


class Proposed:
    """A one-round drafter proposing fixed ``tokens`` (``[k]``) for a one-row batch (one-hot
    logits, ``fixed_logits``); the round's rollback goes to ``inner``, the drafter it stands in for."""

    tree_width = 0

    def __init__(self, inner, tokens: list[int], vocab_size: int):
        if not getattr(inner, "target_state_only", False):
            raise TypeError(f"{type(inner).__name__} keeps drafted state: a lookup round cannot stand in for it")
        self.inner, self.tokens, self.vocab_size = inner, tokens, vocab_size

    def draft(self, prev: mx.array, pending: mx.array, k: int, choose: Chooser, context=None):
        if k != len(self.tokens) or pending.shape[0] != 1:
            raise ValueError(f"a lookup round proposes its {len(self.tokens)} tokens for one row, asked {k}")
        tokens = mx.array([self.tokens], dtype=mx.int32)  # [1, k]
        return tokens, fixed_logits(tokens, self.vocab_size)

    def rollback(self, counts: list[int], hidden: mx.array | None = None) -> None:
        self.inner.rollback(counts, hidden)
