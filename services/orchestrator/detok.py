"""Incremental detokenization that never emits a broken character.

Decoding token by token breaks multi-byte UTF-8 (a Chinese character is often split over two
byte-level tokens) and word-boundary spaces. We re-decode a short window: text of
tokens[prefix:read] is what was already emitted from that window; text of tokens[prefix:] is
the new view. If the window's bytes end inside a character (its last tokens begin a UTF-8
sequence they do not finish) we wait.

    tokens:  ... | prefix ........ read | new ...
                   \\_ emitted _/

Incompleteness is decided from the tokens' bytes, not from the decoded text: a text ending in
U+FFFD is also what a model writes when it writes U+FFFD itself (SmolLM2's token 24211 is the
whole character), and that character was dropped from the answer and its stored ids.
"""

from __future__ import annotations

import codecs
import re
import weakref
from collections.abc import Sequence
from typing import Any, Protocol


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the printable character a byte-level vocabulary
    spells each byte with -> the byte (as transformers' `bytes_to_unicode`, not imported: its
    home moved between versions)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    moved = [b for b in range(256) if b not in kept]
    table = {chr(b): b for b in kept}
    table.update({chr(256 + n): b for n, b in enumerate(moved)})
    return table


_BYTE_OF = _byte_level_alphabet()


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """The bytes token ids stand for, read from the tokenizer's own tokens: a byte-level
    vocabulary (GPT-2's scheme: SmolLM2, Qwen, Llama 3) spells each byte with a character of
    its alphabet; a SentencePiece one with byte fallback uses `<0xNN>` pieces for bytes it has
    no piece for (its other pieces are whole text). `of()` is None for any other tokenizer,
    whose tokens this does not know how to read (callers then go by the text)."""

    def __init__(self, tok: Any) -> None:
        # The decoder says how tokens become text (a Sequence names its parts in its repr).
        decoder = repr(getattr(getattr(tok, "backend_tokenizer", None), "decoder", None))
        # A slow GPT-2 tokenizer has no backend, but keeps its byte alphabet.
        self.byte_level = "ByteLevel(" in decoder or hasattr(tok, "byte_decoder")
        readable = self.byte_level or "ByteFallback(" in decoder
        self.tokens = getattr(tok, "convert_ids_to_tokens", None) if readable else None
        added = getattr(tok, "added_tokens_decoder", None) or {}
        # Added tokens are not spelled in the byte alphabet: their text is their bytes.
        # Special ones are what decode(skip_special_tokens=True) leaves out (the tokenizer's
        # flag: convert_ids_to_tokens(skip_special_tokens=True) kept some that decode drops).
        self.added = {i: str(t).encode() for i, t in added.items()}
        self.special = frozenset(getattr(tok, "all_special_ids", None) or ()) | {
            i for i, t in added.items() if getattr(t, "special", False)}

    def of(self, ids: Sequence[int], skip_special_tokens: bool = True) -> bytes | None:
        if self.tokens is None:
            return None
        ids = [i for i in ids if not (skip_special_tokens and i in self.special)]
        out = bytearray()
        for i, piece in zip(ids, self.tokens(ids), strict=True):
            if i in self.added:
                out += self.added[i]
            elif piece is None:  # an id outside the vocabulary decodes to nothing
                continue
            elif self.byte_level:
                for ch in piece:
                    b = _BYTE_OF.get(ch)
                    out += ch.encode() if b is None else bytes((b,))
            elif m := _BYTE_PIECE.fullmatch(piece):
                out.append(int(m[1], 16))
            else:
                out += piece.encode()
        return bytes(out)


_CACHE: weakref.WeakKeyDictionary[Any, TokenBytes] = weakref.WeakKeyDictionary()


def token_bytes(tok: Any) -> TokenBytes:
    """`TokenBytes` of `tok`, built once per tokenizer (a detokenizer is made per request)."""
    try:
        return _CACHE[tok]
    except KeyError:
        _CACHE[tok] = made = TokenBytes(tok)
        return made
    except TypeError:  # a tokenizer that cannot be weakly referenced or hashed
        return TokenBytes(tok)


def unfinished_bytes(data: bytes) -> int:
    """How many bytes at the end of `data` begin a UTF-8 character they do not finish (0-3):
    what a stream cut there holds back. Bytes that can never become a character (invalid
    UTF-8) are not counted: they decode to U+FFFD whatever follows."""
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    dec.decode(data[-8:])  # a cut character is at most 3 bytes; the rest resynchronizes
    return len(dec.getstate()[0])


def decode(tok: Any, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """`tok.decode`, without the clean-up of spaces a tokenizer may be set to do
    (`clean_up_tokenization_spaces`: " ," -> ",", " ' s" -> "'s"): it rewrites text across token
    boundaries, so the windows an answer streams in decoded other than the whole (tokens were
    lost: "isn ' t it?" streamed as "isn ' it?"), and the streamed text was not the stored one.
    Every decode of an answer goes through here, streamed or whole."""
    if getattr(tok, "clean_up_tokenization_spaces", False):
        return tok.decode(ids, skip_special_tokens=skip_special_tokens,
                          clean_up_tokenization_spaces=False)
    return tok.decode(ids, skip_special_tokens=skip_special_tokens)


def complete_decode(tok: Any, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """`ids` decoded, without a character their last tokens begin but do not finish (a
    byte-level answer stopped by max_tokens inside it): its bytes decode to one U+FFFD the
    model never wrote. A U+FFFD the model did write (its three bytes whole) stays."""
    text = decode(tok, ids, skip_special_tokens)
    data = token_bytes(tok).of(ids, skip_special_tokens)
    if data is None:  # no tokens to read: the text is all there is to go by
        return text.rstrip("\ufffd")
    return text[:-1] if unfinished_bytes(data) and text.endswith("\ufffd") else text


class IncrementalDetokenizer:
    """Feed token ids, get text deltas; `flush()` returns whatever is left at the end."""

    def __init__(self, tokenizer: _Decoder, skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.bytes = token_bytes(tokenizer)
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return decode(self.tok, ids, self.skip)

    def _cut(self, text: str) -> bool:
        """Whether the window (decoded as `text`) ends inside a character."""
        data = self.bytes.of(self.ids[self.prefix :], self.skip)
        if data is None:  # no tokens to read: only the text can tell
            return text.endswith("\ufffd")
        return unfinished_bytes(data) > 0

    def push(self, new_ids: Sequence[int]) -> str:
        """Add tokens; return the text that is now safe to emit (may be "")."""
        self.ids.extend(new_ids)
        prev = self._decode(self.ids[self.prefix : self.read])
        full = self._decode(self.ids[self.prefix :])
        if self._cut(full) or len(full) <= len(prev):
            return ""
        delta = full[len(prev) :]
        # Keep the window short: the next decode starts from the last emitted token.
        self.prefix = self.read
        self.read = len(self.ids)
        return delta

    def flush(self) -> str:
        """Emit the rest (the stream is over). A character the stream ends inside (max_tokens
        cut a multi-byte character short) is dropped: its bytes would only decode to U+FFFD."""
        prev = self._decode(self.ids[self.prefix : self.read])
        full = complete_decode(self.tok, self.ids[self.prefix :], self.skip)
        self.prefix = self.read = len(self.ids)
        return full[len(prev) :] if len(full) > len(prev) else ""
