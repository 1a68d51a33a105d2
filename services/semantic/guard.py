"""A second opinion before a high-similarity match is served: near-paraphrase traps.

Sentence embeddings are nearly bag-of-words: "flights from New York to Florida" and "flights
from Florida to New York" score ~0.98 with all-MiniLM-L6-v2, as do most PAWS non-paraphrases.
The guard refuses a match when the two texts disagree on something the embedding blurs:

1. numbers — the sets of numbers (digits or number words) differ;
2. negation — one text is negated and the other is not, or one has a word the other has only
   with a negating prefix ("legal" / "illegal", "safe" / "unsafe": ~0.99 cosine);
3. entities — a capitalised word (not sentence-initial), acronym or alphanumeric code of one
   text is missing from the other;
4. order — the words the texts share are arranged differently beyond one block move.

The order test counts breakpoints: adjacent pairs of shared words (with start/end sentinels)
in the cached text that are no longer adjacent in the new one. Moving one block of words
("X did Y in 2010" -> "In 2010 X did Y") breaks exactly 3 adjacencies; exchanging two
words or phrases ("from A to B" -> "from B to A") breaks at least 4. So more than 3
breakpoints means the shared words were shuffled, not just one phrase moved.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter, defaultdict
from collections.abc import Callable
from functools import lru_cache
from typing import NamedTuple, TypeVar

T = TypeVar("T")

_NUMBER_WORDS = {
    "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6",
    "seven": "7", "eight": "8", "nine": "9", "ten": "10", "eleven": "11", "twelve": "12",
    "thirteen": "13", "fourteen": "14", "fifteen": "15", "sixteen": "16", "seventeen": "17",
    "eighteen": "18", "nineteen": "19", "twenty": "20", "thirty": "30", "forty": "40",
    "fifty": "50", "sixty": "60", "seventy": "70", "eighty": "80", "ninety": "90",
    "hundred": "100", "thousand": "1000", "million": "1e6", "billion": "1e9",
    "first": "1st", "second": "2nd", "third": "3rd", "fourth": "4th", "fifth": "5th",
    "once": "1x", "twice": "2x", "half": "0.5", "double": "2x", "triple": "3x",
}
_NEGATIONS = {"not", "no", "never", "none", "nobody", "nothing", "neither", "nor", "nowhere",
              "without", "cannot", "n't", "t"}  # "t" = the tail of don't/isn't/can't
_STOP_CAPS = {"i", "i'm", "i've", "i'd", "i'll", "what", "how", "why", "when", "where", "who",
              "which", "is", "are", "can", "do", "does", "the", "a", "an", "in", "on", "if"}


class GuardResult(NamedTuple):
    """`ok` False means the match must not be served; `reason` says which check refused."""

    ok: bool
    reason: str


# Negated auxiliaries written without the apostrophe ("doesnt", "cant") or with it misplaced
# ("does'nt"): the same negation as "doesn't".
_BARE_NOT = re.compile(r"\b(do|does|did|is|are|was|were|ca|could|should|would|wo|has|have|had|"
                       r"must|need|might|ai)(?:nt|'nt)\b", re.IGNORECASE)


def _tokens(text: str) -> list[str]:
    text = text.replace("\u2019", "'")
    # "non-stop" and "nonstop" are one word (and "non-smoking" the opposite of "smoking").
    text = re.sub(r"\b([Nn]on)-(?=[A-Za-z])", r"\1", text)
    text = _BARE_NOT.sub(lambda m: m.group(1) + "n't", text).replace("n't", " n't")
    return re.findall(r"n't|[A-Za-z0-9]+(?:[.,][0-9]+)*|[^\sA-Za-z0-9]", text)


def _words(tokens: list[str]) -> list[str]:
    return [t for t in tokens if t[0].isalnum() or t == "n't"]


def _numbers(words: list[str]) -> Counter:
    out: Counter = Counter()
    for w in words:
        low = w.lower()
        if low[0].isdigit():
            out[low.replace(",", "")] += 1
        elif low in _NUMBER_WORDS:
            out[_NUMBER_WORDS[low]] += 1
    return out


def _negated(words: list[str]) -> bool:
    return sum(1 for w in words if w.lower() in _NEGATIONS) % 2 == 1


# Prefixes that turn a word into its opposite, and the shortest stem taken as a word.
_NEG_PREFIXES = ("non", "dis", "un", "in", "im", "il", "ir")
_MIN_STEM = 4
# Words that only look like prefix + stem: "intake" is not "not take".
_NOT_OPPOSITES = {
    "intake", "income", "input", "inside", "insight", "install", "instance", "inform", "invest",
    "increase", "include", "indoor", "inroad", "index", "interest", "intend", "invent", "involve",
    "import", "impact", "impress", "improve", "impose", "imprint", "discover", "display",
    "disease", "discuss", "dismiss", "dispose", "dispatch", "distance", "district", "discharge",
    "disclose", "dissolve", "universe", "unite", "united", "union", "irate", "illustrate",
}


def _opposite(a: set[str], b: set[str]) -> str:
    """A word of `a` that `b` has only with a negating prefix (or the reverse), as
    "word/prefixword"; "" when there is none."""
    for x, y in ((a, b), (b, a)):
        for w in x - y:
            if w in _NOT_OPPOSITES:
                continue
            for p in _NEG_PREFIXES:
                if not w.startswith(p):
                    continue
                stem = w[len(p):].lstrip("-")
                if len(stem) >= _MIN_STEM and stem in y and stem not in x:
                    return f"{stem}/{w}"
    return ""


def _entities(tokens: list[str]) -> set[str]:
    """Capitalised words not at a sentence start, acronyms and codes with digits, lowercased."""
    out: set[str] = set()
    start = True
    for t in tokens:
        if not t[0].isalnum():
            start = t in (".", "!", "?", ":", ";", '"', "``")
            continue
        if t.isalpha():
            special = len(t) >= 2 and t.isupper()  # an acronym
        else:  # a code: letters and digits
            special = any(c.isdigit() for c in t) and any(c.isalpha() for c in t)
        if special or (t[0].isupper() and not start and t.lower() not in _STOP_CAPS):
            out.add(t.lower())
        start = False
    return out


def _shared_sequences(a, b) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """The words common to both, in each text's order; the k-th repeat of a word pairs with
    the k-th repeat in the other text."""
    ca, cb = Counter(a), Counter(b)
    keep = {w: min(ca[w], cb[w]) for w in ca if w in cb}

    def seq(words) -> list[tuple[str, int]]:
        seen: dict[str, int] = {}
        out = []
        for w in words:
            k = seen.get(w, 0)
            if k < keep.get(w, 0):
                out.append((w, k))
                seen[w] = k + 1
        return out

    return seq(a), seq(b)


def breakpoints(a_words: list[str], b_words: list[str]) -> int:
    """Adjacencies of shared words in `a` (with sentinels) that `b` does not keep."""
    return _breakpoints_lower([w.lower() for w in a_words], [w.lower() for w in b_words])


def _breakpoints_lower(a: list[str] | tuple[str, ...], b: list[str] | tuple[str, ...]) -> int:
    sa, sb = _shared_sequences(a, b)
    if len(sa) < 2:
        return 0
    begin, end = ("^", 0), ("$", 0)
    sa, sb = [begin, *sa, end], [begin, *sb, end]
    adj_b = set(zip(sb, sb[1:], strict=False))
    return sum(1 for p in zip(sa, sa[1:], strict=False) if p not in adj_b)


class TextFacts(NamedTuple):
    """What the guard (and the verifier) read from one text; computed once per text."""

    tokens: tuple[str, ...]
    words: tuple[str, ...]
    lower: tuple[str, ...]  # the words, lowercased
    lower_set: frozenset[str]
    numbers: frozenset[str]
    negated: bool
    entities: frozenset[str]


# A lookup checks one query against a few candidates, and a popular cached prompt is checked
# against many queries: analysing each text once (not once per pair and check) halves the
# guard's cost. Only texts of up to 256 characters are kept, 2,048 of them: ~60 MB at worst
# for this cache and the verifier's together (measured: 232 MB for 4,096 texts of 1,000
# characters), a few MB for questions of typical length.
_FACTS_CACHE_CHARS = 256
_FACTS_CACHE_SIZE = 2048


def _facts(text: str) -> TextFacts:
    tokens = _tokens(text)
    words = _words(tokens)
    lower = tuple(w.lower() for w in words)
    return TextFacts(tuple(tokens), tuple(words), lower, frozenset(lower),
                     frozenset(_numbers(words)), _negated(words), frozenset(_entities(tokens)))


def cached_while_short(analyse: Callable[[str], T]) -> Callable[[str], T]:
    """`analyse(text)`, cached for texts of up to `_FACTS_CACHE_CHARS` characters (at most
    `_FACTS_CACHE_SIZE` of them); longer texts are analysed every time."""
    cached = lru_cache(maxsize=_FACTS_CACHE_SIZE)(analyse)

    def get(text: str) -> T:
        return cached(text) if len(text) <= _FACTS_CACHE_CHARS else analyse(text)

    get.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
    return get


text_facts = cached_while_short(_facts)
text_facts.__doc__ = "The `TextFacts` of `text` (cached for short texts)."


class ParaphraseGuard:
    """Checks that a candidate match is not a near-paraphrase trap.

    Args:
        max_breakpoints: allowed breakpoints in the order of shared words (3 = one block move).
        check_numbers, check_negation, check_entities, check_order: switch single checks.
    """

    def __init__(self, max_breakpoints: int = 3, *, check_numbers: bool = True,
                 check_negation: bool = True, check_entities: bool = True,
                 check_order: bool = True) -> None:
        self.max_breakpoints = max_breakpoints
        self.checks = (check_numbers, check_negation, check_entities, check_order)

    def check(self, query: str, cached: str) -> GuardResult:
        """GuardResult(True, "") if `cached` may answer `query`."""
        return self.check_facts(text_facts(query), text_facts(cached))[0]

    def check_facts(self, q: TextFacts, c: TextFacts) -> tuple[GuardResult, int | None]:
        """The verdict on two analysed texts, and the breakpoints of `c`'s shared words in `q`
        when the order check got that far (None otherwise)."""
        numbers, negation, entities, order = self.checks
        if numbers and q.numbers != c.numbers:
            diff = sorted(q.numbers ^ c.numbers)
            return GuardResult(False, f"numbers differ: {', '.join(diff[:4])}"), None
        lq, lc = q.lower_set, c.lower_set
        if negation:
            if q.negated != c.negated:
                return GuardResult(False, "negation differs"), None
            opposite = _opposite(lq, lc)
            if opposite:
                return GuardResult(False, f"opposite words: {opposite}"), None
        if entities:
            missing = sorted((q.entities - lc) | (c.entities - lq))
            if missing:
                return GuardResult(False, f"entities differ: {', '.join(missing[:4])}"), None
        if order:
            bp = _breakpoints_lower(c.lower, q.lower)
            if bp > self.max_breakpoints:
                return GuardResult(False, f"word order differs ({bp} breakpoints)"), bp
            return GuardResult(True, ""), bp
        return GuardResult(True, ""), None


# ---- what an uncased embedder cannot see --------------------------------------------------

_UWORD = re.compile(r"\w+")


def _fold(word: str) -> str:
    """`word` as an uncased embedder reads it: lowercased, accents dropped."""
    if word.isascii():  # no accents to drop (most words; 10x faster)
        return word.lower()
    return "".join(c for c in unicodedata.normalize("NFD", word)
                   if not unicodedata.combining(c)).lower()


def _initial_case_only(a: str, b: str) -> bool:
    """`a` and `b` differ at most in their first letter's case ("What" / "what")."""
    return a[1:] == b[1:] and a[:1].lower() == b[:1].lower()


def _layout(text: str) -> tuple[int, ...]:
    """The indentation of each non-blank line, relative to the least indented one (a text
    pasted with a margin, or starting with a space, is laid out the same)."""
    indents = [len(line) - len(line.lstrip(" \t")) for line in text.splitlines()
               if line.strip()]
    least = min(indents, default=0)
    return tuple(i - least for i in indents)


def spelling_differs(query: str, cached: str, case_and_accents: bool = True) -> str:
    """Why `cached` must not answer `query` although an uncased embedder (all-MiniLM-L6-v2
    lowercases and strips accents; whitespace is only a separator) sees one text twice ("" =
    no such difference). Served at similarity 1.0 before: "What is CO?" got "Co"'s answer,
    "salé" got "sale"'s, and two code snippets that differ only in indentation shared an
    answer.

    Refused: for texts equal up to whitespace, a different indentation; with
    `case_and_accents`, also a word spelt in the other text with other case (beyond its first
    letter) or other accents ("ls -A" / "ls -a" aside: one letter, as a sentence's first word
    differs). The cache asks for that in its strict tier only: in users' questions such
    differences are nearly always the same word typed otherwise ("gta" / "GTA", "Pokemon" /
    "Pokémon": 279 QQP pairs, none of the refused hits a false one), while where a wrong answer
    is dear "CO" is not "Co" and "mg" is not "Mg".
    """
    if query == cached:
        return ""
    qw, cw = _UWORD.findall(query), _UWORD.findall(cached)
    for words, other in ((qw, cw), (cw, qw)) if case_and_accents else ():
        forms: dict[str, set[str]] = defaultdict(set)
        for w in other:
            forms[_fold(w)].add(w)
        for w in words:
            seen = forms.get(_fold(w))
            if seen and w not in seen and not any(_initial_case_only(w, o) for o in seen):
                return f"spelling differs: {w!r} / {sorted(seen)[0]!r} (case or accents)"
    if qw == cw and " ".join(query.split()) == " ".join(cached.split()):
        # Only lines laid out alike can differ in indentation: the same sentence wrapped
        # otherwise, or with a leading space, is the same text.
        ql, cl = _layout(query), _layout(cached)
        if len(ql) == len(cl) >= 2 and ql != cl:
            return "indentation differs"
    return ""
