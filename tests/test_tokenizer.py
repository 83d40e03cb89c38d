"""Tokenizer on the real model file: llama.cpp's ids, round trips, special tokens, chat."""
import time

import pytest
from hypothesis import given, settings, strategies as st

from magnitude.errors import ConfigError, ModelError
from magnitude.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(model_file):
    return Tokenizer.from_model(model_file)


@pytest.mark.parametrize("text, ids", [
    # Ids from llama.cpp on this file.
    ("The capital of France is", [504, 3575, 282, 4649, 314]),
    ("Hello world! 123", [19556, 905, 17, 216, 33, 34, 35]),
])
def test_matches_llama_cpp(tok, text, ids):
    assert tok.encode(text) == ids


def test_digits_are_split_one_by_one(tok):
    ids = tok.encode("2024")
    assert len(ids) == 4
    assert [tok.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_special_ids(tok):
    assert tok.n_vocab == 49152
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    assert tok.token_text(1) == "<|im_start|>" and tok.token_text(2) == "<|im_end|>"
    assert tok.eot_ids == frozenset({0, 2})  # <|endoftext|> and <|im_end|>
    assert not tok.add_bos  # the file says add_bos_token = false
    assert tok.is_special(1) and not tok.is_special(504)


def test_special_tokens_in_text_are_one_token(tok):
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "<|im_start|>user\nHi<|im_end|>"
    assert tok.decode(ids, skip_special=True) == "user\nHi"
    # Text that only resembles a special token is ordinary text.
    assert 1 not in tok.encode("<|im_start |>")


@pytest.mark.parametrize("text", [
    "", " ", "   leading and trailing   ", "tabs\tand\n\nnewlines\r\n",
    "héllo wörld — naïve café", "日本語のテキスト", "emoji 🎉👍🏽 mixed",
    "def f(x):\n    return x ** 2  # square\n", "x = [1, 22, 333, 4444]",
    "3.14159 and -42 and 1e-9", "Ġ literal byte-level chars Ċ",
])
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


# The SmolLM2 vocabulary lacks six control bytes and the UTF-8 lead bytes 0xF1/0xF2 (planes
# 4-11, unassigned): text using them cannot round-trip (llama.cpp drops them too).
MISSING_CONTROLS = "\x04\x06\x13\x14\x16\x1d"
representable = st.text(st.characters(max_codepoint=0x3FFFF, exclude_categories=["Cs"],
                                      exclude_characters=MISSING_CONTROLS), max_size=60)


def test_bytes_missing_from_the_vocabulary(tok):
    have = {tok.token_bytes(i) for i in range(tok.n_vocab)}
    missing = {b for b in range(256) if bytes([b]) not in have}
    assert missing == {*map(ord, MISSING_CONTROLS), 0xC0, 0xC1, 0xF1, 0xF2, *range(0xF5, 0x100)}
    assert tok.decode(tok.encode("a\x04b")) == "ab"  # dropped, never a crash


@settings(max_examples=150, deadline=None)
@given(representable)
def test_round_trip_any_text(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.n_vocab for i in ids)
    assert tok.decode(ids) == text
    # Bytes joined token by token give the same text (what a streaming decoder relies on).
    assert b"".join(tok.token_bytes(i) for i in ids).decode("utf-8") == text


def test_token_bytes_can_split_a_character(tok):
    ids = tok.encode("🎉")
    parts = [tok.token_bytes(i) for i in ids]
    assert b"".join(parts) == "🎉".encode()
    assert len(ids) > 1  # a byte-level vocab without this emoji: partial UTF-8 per token


def test_bad_ids_are_rejected(tok):
    with pytest.raises(ConfigError, match="49152"):
        tok.decode([5, 49152])
    with pytest.raises(ConfigError, match="-1"):
        tok.token_text(-1)
    with pytest.raises(ConfigError, match="bytes"):
        tok.encode(b"bytes")
    with pytest.raises(ConfigError, match=r"surrogate '\\ud800' at position 2"):
        tok.encode("ab\ud800c")


def test_chat_template_two_messages(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"},
                                    {"role": "assistant", "content": "4"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(text)
    assert ids.count(1) == 4 and ids.count(2) == 3  # <|im_start|> / <|im_end|> as single ids
    no_prompt = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Hi"}],
                                        add_generation_prompt=False)
    assert no_prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


@pytest.mark.parametrize("messages", [[], "hello", [{"role": "user"}], [{"content": "x"}],
                                      [{"role": "user", "content": 5}]])
def test_chat_template_rejects_bad_messages(tok, messages):
    with pytest.raises(ConfigError, match="message"):
        tok.apply_chat_template(messages)


def test_chat_template_is_sandboxed_and_errors_are_model_errors():
    tok = Tokenizer(["a", "b", "ab"], ["a b"], [1, 1, 1], pre="gpt2", bos_id=None, eos_id=None,
                    chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(ModelError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    failing = Tokenizer(["a"], [], [1], pre="gpt2", bos_id=None, eos_id=None,
                        chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(ModelError, match="no system role"):
        failing.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ModelError, match="no chat template"):
        Tokenizer(["a"], [], [1], pre="gpt2", bos_id=None, eos_id=None) \
            .apply_chat_template([{"role": "user", "content": "x"}])


def test_unsupported_pre_tokenizer_is_named():
    with pytest.raises(ModelError, match="'qwen2'"):
        Tokenizer(["a"], [], [1], pre="qwen2", bos_id=None, eos_id=None)


def test_tiny_vocab_merges_and_bos():
    tok = Tokenizer(["<s>", "a", "b", "ab"], ["a b"], [3, 1, 1, 1], pre="gpt2", bos_id=0,
                    eos_id=0, add_bos=True)
    assert tok.encode("abab") == [0, 3, 3]
    assert tok.encode("<s>ab") == [0, 0, 3]
    assert tok.decode([0, 3, 3], skip_special=True) == "abab"


def test_builds_fast(model_file):
    start = time.perf_counter()
    Tokenizer.from_model(model_file)
    assert time.perf_counter() - start < 1.0  # it runs at every engine start
