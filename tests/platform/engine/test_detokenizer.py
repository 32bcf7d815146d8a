"""Streaming text never shows half a character and adds up to the whole text."""

from __future__ import annotations

from loraplex.platform.tokenizer.detokenizer import IncrementalDetokenizer


def test_incremental_decode_never_splits_multibyte(llm):
    tok = llm.tokenizer
    text = " café 🦊 naïve 日本語のテキスト 👨‍👩‍👧 done"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("Hello:", add_special_tokens=False))
    pieces = []
    for token in ids:
        detok.add_tokens([token])
        piece = detok.take_delta(final=False)
        assert "\ufffd" not in piece
        pieces.append(piece)
    pieces.append(detok.take_delta(final=True))
    assert "".join(pieces) == text
    assert len(ids) > len(text.split())  # multi-byte characters did span several tokens


def test_stop_string_never_streamed(llm):
    tok = llm.tokenizer
    ids = tok.encode(" alpha beta STOP gamma", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=("STOP",))
    streamed = ""
    hit = None
    for token in ids:
        hit = detok.add_tokens([token])
        streamed += detok.take_delta(final=hit is not None)
        if hit:
            break
    assert hit == "STOP"
    assert streamed == " alpha beta "
