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


def test_the_templates_own_system_message_is_read_off_it(llama_ckpt):
    """What a chat without a system message is sent with (SmolLM2's template adds "You are a helpful AI assistant
    named SmolLM, ...": tests/test_real_model.py): the text in the system probe's place, between the same
    markers; none where the template adds nothing, and none from a template that renders no system at all."""
    from engine.tokenizer import default_system

    tok = AutoTokenizer.from_pretrained(llama_ckpt)
    tok.chat_template = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a test model.<|im_end|>\n"
                         "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert default_system(tok) == "You are a test model."
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert default_system(tok) == ""
    tok.chat_template = "{% for m in messages if m['role'] != 'system' %}{{ m['content'] }}{% endfor %}"
    assert default_system(tok) == ""
