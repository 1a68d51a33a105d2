"""The rule for empty text, written from docs/reliability.md (not from the code it checks):
text of only whitespace, zero-width, format or control characters counts as empty (refused in
a message, a raw prompt or a semantic text; an answer of it is not stored, not saved to a
session and not sent back in a replayed history)."""

from __future__ import annotations

import unicodedata


def blank(text: str) -> bool:
    return not any(not c.isspace() and unicodedata.category(c) not in ("Cc", "Cf")
                   for c in text)
