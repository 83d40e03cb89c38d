"""Tokenizer built in memory from the GGUF vocabulary, and the chat template.

GGUF files of the gpt2 family ("tokenizer.ggml.model" == "gpt2") carry the byte-level BPE
vocabulary and merges; we hand them to the HuggingFace `tokenizers` BPE model and add the
pre-tokenizer that the file's "tokenizer.ggml.pre" names, so ids match llama.cpp and the
original tokenizer.json. Control tokens become special added tokens: "<|im_start|>" inside a
prompt is one token, and decode(skip_special=True) drops them.
"""
from __future__ import annotations

from functools import lru_cache

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from .errors import ConfigError, ModelError

# gguf TokenType values
_CONTROL, _USER_DEFINED = 3, 4
# Tokens that end an assistant turn in the model families we know, besides the file's eos.
_END_OF_TURN_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def _byte_level_split():
    # use_regex=True is the GPT-2 split (contractions, letters, numbers, punctuation, spaces).
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _pre_tokenizer(pre: str):
    """The pre-tokenizer llama.cpp applies for the file's "tokenizer.ggml.pre" value."""
    if pre == "smollm":
        # SmolLM2's tokenizer.json: every digit on its own, then the byte-level split.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        _byte_level_split()])
    if pre in ("gpt2", "gpt-2", "default"):
        return _byte_level_split()
    raise ModelError(f"tokenizer pre-tokenizer {pre!r} is not supported; supported: smollm, "
                     "gpt2")


def _token_types(token_types, n_tokens: int) -> list[int]:
    if token_types is None:
        return []
    try:
        types = [int(t) for t in token_types]
    except (TypeError, ValueError):
        raise ModelError("tokenizer.ggml.token_type is not a list of integers; the file is "
                         "corrupt") from None
    if len(types) != n_tokens:
        raise ModelError(f"tokenizer.ggml.token_type has {len(types)} entries for {n_tokens} "
                         "tokens; the file is corrupt")
    return types


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable stand-in of each byte -> the byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table = {chr(b): b for b in printable}
    n = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + n)] = b
            n += 1
    return table


class Tokenizer:
    """encode/decode, special ids and the chat template of one model file."""

    def __init__(self, tokens: list[str], merges: list[str], token_types, pre: str,
                 bos_id: int | None, eos_id: int | None, add_bos: bool = False,
                 chat_template: str | None = None, extra_eot_ids=()):
        vocab = {tok: i for i, tok in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ModelError(f"tokenizer vocabulary has {len(tokens) - len(vocab)} duplicate "
                             "tokens; the file is corrupt")
        pairs = []
        for m in merges:
            a, sep, b = m.partition(" ")
            if not sep:
                raise ModelError(f"tokenizer merge {m!r} is not two tokens separated by a space")
            pairs.append((a, b))
        try:
            bpe = models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False)
        except Exception as e:  # tokenizers raises a bare Exception, e.g. a merge out of vocab
            raise ModelError(f"tokenizer vocabulary/merges are inconsistent: {e}") from None
        self._tok = HFTokenizer(bpe)
        self._tok.pre_tokenizer = _pre_tokenizer(pre)
        self._tok.decoder = decoders.ByteLevel()
        types = _token_types(token_types, len(tokens))
        self._special = frozenset(i for i, t in enumerate(types) if t == _CONTROL)
        # normalized=False: match the literal text; special=True: skipped by skip_special.
        self._tok.add_tokens([AddedToken(tokens[i], normalized=False, special=False)
                              for i, t in enumerate(types) if t == _USER_DEFINED])
        self._tok.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True)
                                      for i in sorted(self._special)])
        self.tokens = tokens
        self.n_vocab = len(tokens)
        self.bos_id = self._check_id(bos_id, "bos")
        self.eos_id = self._check_id(eos_id, "eos")
        self.add_bos = bool(add_bos) and self.bos_id is not None
        self.chat_template = chat_template
        eot = {i for i in (self.eos_id, *extra_eot_ids) if i is not None and 0 <= i < self.n_vocab}
        eot |= {vocab[t] for t in _END_OF_TURN_TEXTS if t in vocab}
        self.eot_ids = frozenset(eot)

    @classmethod
    def from_model(cls, model_file) -> "Tokenizer":
        """Build from a ModelFile's tokenizer.ggml.* metadata and tokenizer.chat_template."""
        meta = model_file.meta
        kind = meta("tokenizer.ggml.model", None)
        if kind != "gpt2":
            raise ModelError(f"{model_file.path}: tokenizer model {kind!r} is not supported; "
                             "only byte-level BPE ('gpt2') is")
        tokens = meta("tokenizer.ggml.tokens")
        merges = meta("tokenizer.ggml.merges")
        if not _str_list(tokens) or not tokens or not _str_list(merges):
            raise ModelError(f"{model_file.path}: tokenizer.ggml.tokens/merges are not lists of "
                             "strings; the file is corrupt")
        template = meta("tokenizer.chat_template", None)
        extra = [meta(k, None) for k in ("tokenizer.ggml.eot_token_id",
                                         "tokenizer.ggml.eom_token_id")]
        return cls(tokens, merges, meta("tokenizer.ggml.token_type", None),
                   pre=meta("tokenizer.ggml.pre", "gpt2"),
                   bos_id=meta("tokenizer.ggml.bos_token_id", None),
                   eos_id=meta("tokenizer.ggml.eos_token_id", None),
                   add_bos=meta("tokenizer.ggml.add_bos_token", False),
                   chat_template=template if isinstance(template, str) else None,
                   extra_eot_ids=[i for i in extra if isinstance(i, int)])

    def _check_id(self, i, what: str):
        if i is None:
            return None
        if not isinstance(i, int) or not 0 <= i < len(self.tokens):
            raise ModelError(f"tokenizer {what} token id {i!r} is outside the vocabulary "
                             f"(0..{len(self.tokens) - 1})")
        return i

    # -- text <-> ids ------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of text; special-token text such as "<|im_start|>" becomes its one id.
        BOS is prepended only when the file asks for it (tokenizer.ggml.add_bos_token)."""
        if not isinstance(text, str):
            raise ConfigError(f"encode() takes a str, got {type(text).__name__}")
        try:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        except TypeError:  # a lone surrogate such as "\ud800": a str, but not Unicode text
            pos = next(i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF)
            raise ConfigError(f"text has a lone surrogate {text[pos]!r} at position {pos}, "
                              "which is not valid Unicode; decode the input with "
                              "errors='replace'") from None
        return [self.bos_id] + ids if self.add_bos else ids

    def _check_ids(self, ids) -> list[int]:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.n_vocab]
        if bad:
            raise ConfigError(f"token id {bad[0]} is outside the vocabulary "
                              f"(0..{self.n_vocab - 1})")
        return ids

    def decode(self, ids, skip_special: bool = False) -> str:
        return self._tok.decode(self._check_ids(ids), skip_special_tokens=skip_special)

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry as stored (byte-level form, e.g. "Ġworld" for " world")."""
        return self.tokens[self._check_ids([token_id])[0]]

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for. A token can hold part of a UTF-8 character, so a
        streaming decoder joins bytes and decodes only complete characters."""
        text = self.token_text(token_id)
        if token_id in self._special:
            return text.encode("utf-8")
        table = _unicode_to_byte()
        if all(c in table for c in text):
            return bytes(table[c] for c in text)
        return text.encode("utf-8")  # added tokens are stored as plain text

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special

    # -- chat --------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render a conversation with the file's Jinja chat template (sandboxed)."""
        if not self.chat_template:
            raise ModelError("the model file has no chat template (tokenizer.chat_template); "
                             "pass a plain prompt instead of chat messages")
        _check_messages(messages)
        template = _compile_template(self.chat_template)
        try:
            return template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self._text_of(self.bos_id), eos_token=self._text_of(self.eos_id))
        except Exception as e:  # TemplateError, raise_exception(), errors inside the template
            raise ModelError(f"the model's chat template failed: {type(e).__name__}: {e}") \
                from None

    def _text_of(self, token_id) -> str:
        return "" if token_id is None else self.tokens[token_id]

    def __repr__(self) -> str:
        return f"Tokenizer(n_vocab={self.n_vocab}, bos={self.bos_id}, eos={self.eos_id})"


def _str_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _check_messages(messages) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ConfigError(f"chat messages must be a non-empty list of dicts, got {messages!r}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            raise ConfigError(f"chat message {i} is {m!r}; each must be a dict with str 'role' "
                              "and 'content', e.g. {'role': 'user', 'content': 'Hi'}")


@lru_cache(maxsize=8)
def _compile_template(source: str):
    # Imported here: jinja2 costs ~50 ms and plain completion never needs it.
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    # The environment HuggingFace uses for chat templates, so files render the same.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ModelError(f"the model's chat template does not parse: {e}") from None
