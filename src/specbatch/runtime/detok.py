"""Incremental detokenisation with stop strings.

Text is decoded over a short sliding window of ids and released only when it does not
end in a partial UTF-8 sequence, so streamed pieces concatenate to exactly the final
text. A suffix that could still become a stop string is held back until it cannot.
"""

from __future__ import annotations


class TextStream:
    """Turns one request's token ids into text deltas; finds stop strings."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self._tok = tokenizer
        self._stops = stops
        self._ids: list[int] = []
        self._prefix = 0  # window start: ids before it are fully released
        self._read = 0  # ids up to here have been decoded into released text
        self._held = ""  # decoded text withheld because it may start a stop string
        self.text = ""  # everything released so far
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        """Feed one token; return the newly released text ('' while bytes are partial)."""
        self._ids.append(token)
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if after.endswith("\ufffd"):
            return ""
        delta = after[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        return self._release(delta)

    def finish(self) -> str:
        """Release whatever is left (partial bytes decode with replacement characters)."""
        if self.stopped:
            return ""
        before = self._decode(self._ids[self._prefix:self._read])
        rest = self._decode(self._ids[self._prefix:])[len(before):]
        self._read = len(self._ids)
        out, self._held = self._held + rest, ""
        self.text += out
        return out

    def _release(self, delta: str) -> str:
        buf = self._held + delta
        if not self._stops:
            self._held = ""
            self.text += buf
            return buf
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            out, self._held, self.stopped = buf[:min(hits)], "", True
            self.text += out
            return out
        keep = _longest_stop_prefix(buf, self._stops)
        out, self._held = buf[:len(buf) - keep], buf[len(buf) - keep:]
        self.text += out
        return out


def _longest_stop_prefix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
