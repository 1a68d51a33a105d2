"""Incremental detokenization that never emits a broken character.

Decoding token by token breaks multi-byte UTF-8 (a Chinese character is often split over two
byte-level tokens) and word-boundary spaces. We re-decode a short window: text of
tokens[prefix:read] is what was already emitted from that window; text of tokens[prefix:] is
the new view. If the new view ends in U+FFFD the last token is an incomplete character: wait.

    tokens:  ... | prefix ........ read | new ...
                   \\_ emitted _/
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


def complete_text(text: str) -> str:
    """`text` without the replacement characters it ends with: the decoding of a character
    whose bytes were cut short (a byte-level tokenizer's answer stopped inside it)."""
    return text.rstrip("\ufffd")


class IncrementalDetokenizer:
    """Feed token ids, get text deltas; `flush()` returns whatever is left at the end."""

    def __init__(self, tokenizer: _Decoder, skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def push(self, new_ids: Sequence[int]) -> str:
        """Add tokens; return the text that is now safe to emit (may be "")."""
        self.ids.extend(new_ids)
        prev = self._decode(self.ids[self.prefix : self.read])
        full = self._decode(self.ids[self.prefix :])
        if full.endswith("\ufffd") or len(full) <= len(prev):
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
        full = complete_text(self._decode(self.ids[self.prefix :]))
        self.prefix = self.read = len(self.ids)
        return full[len(prev) :] if len(full) > len(prev) else ""
