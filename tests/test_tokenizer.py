"""Streaming detokenization: whole characters only, stop strings held back until they resolve."""

from __future__ import annotations

from transformers import AutoTokenizer

from engine.tokenizer import IncrementalDetokenizer


def stream(tok, ids, stop=None):
    detok = IncrementalDetokenizer(tok, stop)
    pieces = []
    for i in ids:
        detok.add(i)
        pieces.append(detok.take(final=False))
        if detok.stopped:
            break
    pieces.append(detok.take(final=True))
    return detok, pieces


def test_multibyte_characters_never_split(llama_ckpt):
    tok = AutoTokenizer.from_pretrained(llama_ckpt)
    text = "naïve café, 日本語のテキスト and 🦜 parrots"
    ids = tok.encode(text)
    assert len(ids) > len(text) // 3
    detok, pieces = stream(tok, ids)
    assert "".join(pieces) == text == detok.text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_prefix_is_held_back(llama_ckpt):
    tok = AutoTokenizer.from_pretrained(llama_ckpt)
    text = "To be, or not to be, that is the question."
    detok, pieces = stream(tok, tok.encode(text), stop=["that is"])
    assert detok.stopped
    assert "".join(pieces) == "To be, or not to be, "
    assert not any("that" in p for p in pieces)
