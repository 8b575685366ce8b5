"""OpenAI's two logprobs shapes, from the engine's per-token ``TokenLogprob`` values.

Completions (legacy): ``{"tokens", "token_logprobs", "top_logprobs": [{text: lp}], "text_offset"}``
where each ``top_logprobs`` dict holds the N alternatives and the sampled token (so up to
N + 1 entries, as OpenAI documents). Chat: ``{"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}]}]}`` with exactly the N alternatives.
A token's *bytes* come from its vocabulary piece (byte-level BPE's printable alphabet,
or SentencePiece's ``<0xNN>``); its text is those bytes as UTF-8, or, for a piece of a
multi-byte character, ``bytes:\\xNN..`` (OpenAI's convention), so distinct tokens never
share a key. ``text_offset`` counts characters into the completion's text.
"""

from __future__ import annotations

import functools

FLOOR = -9999.0  # JSON has no -inf; vLLM clamps the same way


class LogprobFormat:
    """Formats one response's logprobs (chat or completions) with the served tokenizer."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat
        self.bytes = functools.lru_cache(maxsize=4096)(self._bytes)

    def _bytes(self, token: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens([token])[0]
        if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:  # SentencePiece byte fallback
            return bytes([int(piece[3:5], 16)])
        text = self.tokenizer.decode([token])
        if piece and all(c in _BYTE_OF for c in piece):  # byte-level BPE: one printable char per byte
            raw = bytes(_BYTE_OF[c] for c in piece)
            if raw.decode("utf-8", "replace") == text:  # not a word of another vocabulary that looks alike
                return raw
        return text.encode("utf-8")  # special tokens, SentencePiece words

    def text(self, token: int) -> str:
        raw = self.bytes(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def __call__(self, entries: list) -> dict:
        """``entries``: (TokenLogprob, text offset) per token, in order."""
        return self._chat(entries) if self.chat else self._legacy(entries)

    def _legacy(self, entries: list) -> dict:
        tops = []
        for lp, _ in entries:
            top = {self.text(t): _lp(v) for t, v in lp.top}
            top.setdefault(self.text(lp.token), _lp(lp.logprob))  # the sampled token is always there
            tops.append(top)
        return {"tokens": [self.text(lp.token) for lp, _ in entries],
                "token_logprobs": [_lp(lp.logprob) for lp, _ in entries],
                "top_logprobs": tops, "text_offset": [offset for _, offset in entries]}

    def _chat(self, entries: list) -> dict:
        return {"content": [dict(self._item(lp.token, lp.logprob),
                                 top_logprobs=[self._item(t, v) for t, v in lp.top]) for lp, _ in entries]}

    def _item(self, token: int, logprob: float) -> dict:
        return {"token": self.text(token), "logprob": _lp(logprob), "bytes": list(self.bytes(token))}


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: printable char -> the byte it stands for."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:  # unprintable bytes map past 255, in order
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _byte_alphabet()


def _lp(value: float) -> float:
    return max(value, FLOOR)


class Offsets:
    """Running text offsets per choice: each token's offset is the text before it.

    A token's logprob goes out with the first event that carries text at or after it, so
    a token whose text is held back (a possible stop string, partial UTF-8) waits. When a
    choice ends with ``stop`` the tokens still waiting produced no text: the end-of-turn
    token, a stop token, the tokens a stop string removed. As OpenAI does, they are left
    out of ``logprobs`` and of ``usage.completion_tokens`` (``dropped``), so the joined
    logprob tokens are the text (but for a token a stop string cut in the middle)."""

    def __init__(self, n: int):
        self.at = [0] * n
        self.held: list[list] = [[] for _ in range(n)]
        self.dropped = [0] * n

    def entry(self, index: int, event) -> list:
        """``[(logprob, offset)]`` this event releases (None logprobs skipped); advances."""
        held = self.held[index]
        if event.token is not None:
            held.append((event.logprob, self.at[index]))
        if not event.text and event.finish_reason == "stop":
            self.dropped[index] += len(held)
            held.clear()
            return []
        if not event.text and not event.finish_reason:
            return []
        self.at[index] += len(event.text)
        out = [(lp, offset) for lp, offset in held if lp is not None]
        held.clear()
        return out
