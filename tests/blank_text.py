"""The rule for empty text, written from docs/reliability.md (not from the code it checks):
text of only whitespace, zero-width, format (but for those drawn, as "۝"), control or other
characters Unicode draws as nothing (Hangul fillers, variation selectors, the Braille blank
U+2800) counts as empty
(refused in a message, a raw prompt or a semantic text; an answer of it is not stored, not
saved to a session and not sent back in a replayed history)."""

from __future__ import annotations

import unicodedata

# Format characters that are drawn (Unicode's Prepended_Concatenation_Mark): text.
DRAWN = {0x600, 0x601, 0x602, 0x603, 0x604, 0x605, 0x6DD, 0x70F, 0x890, 0x891, 0x8E2, 0x110BD,
         0x110CD}


# Unicode's Default_Ignorable_Code_Point (DerivedCoreProperties.txt), assigned, outside Cc/Cf.
# And U+2800 BRAILLE PATTERN BLANK, a Braille cell with no dot: drawn as a space.
IGNORABLE = ({0x34F, 0x115F, 0x1160, 0x17B4, 0x17B5, 0x180B, 0x180C, 0x180D, 0x180F, 0x3164,
              0xFFA0, 0x2800} | set(range(0xFE00, 0xFE10)) | set(range(0xE0100, 0xE01F0)))


def blank(text: str) -> bool:
    return not any(not c.isspace() and ord(c) not in IGNORABLE
                   and (unicodedata.category(c) not in ("Cc", "Cf") or ord(c) in DRAWN)
                   for c in text)


def hidden(text: str) -> bool:
    """`text` holds a control or format character, whitespace other than a plain space or a
    character drawn as nothing: a model id no service takes (the proto comments)."""
    return any(c != " " and blank(c) or unicodedata.category(c) in ("Cc", "Cf") for c in text)


def lookalike(name: str) -> bool:
    """A tenant name that prints as another (docs/deploy.md, tenant tokens): one `hidden`
    holds, or one not in NFC."""
    return hidden(name) or unicodedata.normalize("NFC", name) != name
