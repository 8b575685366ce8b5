"""Streamed text pieces concatenate to the final text; stop strings end the stream."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from specbatch.runtime.detok import TextStream


def run(tok, ids, stops=()):
    stream = TextStream(tok, stops)
    pieces = []
    for t in ids:
        pieces.append(stream.add(t))
        if stream.stopped:
            break
    pieces.append(stream.finish())
    return pieces, stream


@given(text=st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=40))
def test_pieces_concatenate_to_the_text(tiny, text):
    tok = tiny.tokenizer
    ids = tok.encode(text)
    pieces, stream = run(tok, ids)
    assert "".join(pieces) == stream.text == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces[:-1]) or "\ufffd" in text


def test_multibyte_characters_are_never_split(tiny):
    tok = tiny.tokenizer
    ids = tok.encode("héllo → 世界 🎉 done")
    pieces, stream = run(tok, ids)
    assert stream.text == "héllo → 世界 🎉 done"
    assert not any("\ufffd" in p for p in pieces)


def test_stop_string_ends_text_before_it(tiny):
    tok = tiny.tokenizer
    ids = tok.encode("alpha beta\ngamma delta")
    pieces, stream = run(tok, ids, stops=("\ngam",))
    assert stream.stopped and stream.text == "alpha beta"
    assert "".join(pieces) == "alpha beta"


def test_a_near_miss_is_released(tiny):
    tok = tiny.tokenizer
    ids = tok.encode("return x\nreturn y")
    pieces, stream = run(tok, ids, stops=("\nraise",))
    assert not stream.stopped and "".join(pieces) == "return x\nreturn y"
