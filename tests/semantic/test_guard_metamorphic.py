"""A metamorphic review of the semantic tier's guard (`services/semantic/guard.py`): there is no
oracle for meaning, so the test edits real sentences (QQP questions and PAWS-Wiki sentences,
`../shared/data`, sampled by seed) in ways whose effect on meaning is known, and checks the
guard's verdict against what its docs promise for that kind of edit.

Relations checked (each on seeded samples of both data files):

- a text passes against itself, and against an edit of itself that keeps its meaning: extra,
  collapsed, leading or trailing whitespace, a trailing "?" or "." added, dropped or changed,
  straight against curly apostrophes and double quotes, the first letter's case of a first
  word that is a plain word, a space before punctuation dropped (PAWS's "word , word"), and a
  cardinal number word written in digits (rule 1: "three" is 3);
- the same edits (but the number in digits, see below) applied to one side of a QQP / PAWS
  pair leave the pair's verdict as it was;
- the verdict is symmetric, guard(a, b) == guard(b, a) (tests/semantic/test_guard_rules.py
  relies on it), on data pairs and on every edited pair;
- an edit of one side of an identical pair that the docs say the guard catches is refused: a
  digit changed, a cardinal number word changed (rule 1), a negation inserted ("not", "n't",
  "never", "no") or removed, a negating prefix put on a word ("un", "non", "dis": rule 2), a
  capitalised name replaced by another (rule 3), two
  names one or two words apart swapped, "from X to Y" made "from Y to X" and two words of one
  name swapped ("Spokane Arena" / "Arena Spokane": rule 5, "USD EUR" / "EUR USD").

Run while reviewing: 20,000 seeds of every relation (GUARD_METAMORPHIC_SEEDS=20000, 4 min).
Found and fixed (each with a deterministic test in test_guard_rules.py): a number written in
words in one text shifted the places the number-swap check paired ("three rooms (2-3 beds)" /
"3 rooms (2-3 beds)" refused); a swap after an earlier mention of one of the two items went
unseen, for numbers and for names ("Why is USD strong? Will the USD EUR rate rise?" / "... the
EUR USD rate rise?" served; 59 of 1,937 seeded name-word swaps); "0 billion" read as
1 billion. Not relations the guard keeps, so left out here (reported, not fixed):
lowercasing or uppercasing a whole text changes what is a name ("World War II" / "world war
II": numbers differ, "Nougat 7.0" / "nougat 7.0" a version against a number, an all-caps text
one span of names), and so does the case of a first word before a Roman numeral ("Celestin
III"); "C.E ." / "C.E." (PAWS's split abbreviation: "1539 C" reads as 1539 degrees Celsius);
and the order check compares words as written, so writing "five" as "5" on one side of a pair
can change its verdict ("created five other airlines" / "developed other five airlines"
refused, "created 5 other ..." served; two phrases exchanged around "and" refused once one
side has "2" for "two"); a prefixed word both texts have hides the opposite ("What are the
advantages and disadvantages of dams?" / "What are the disadvantages and disadvantages of
dams?" served: the words are compared as sets).

Teeth (default seeds): a number word after any word read as the pronoun "one" (199 seeds),
"never" no negation (87 + 5), a curly apostrophe no apostrophe (33 + 7), a comma taken as a
sentence start (9 + 11), the entity swap check back on first places (6), opposite words looked
for one way only (247), a number's decimals dropped (1: decimals are rare in the data).

More seeds: GUARD_METAMORPHIC_SEEDS=20000 (default 250 per relation, ~3 s).
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Callable

import pytest

from services.semantic.guard import _NOT_OPPOSITES, ParaphraseGuard
from services.semantic.labelled_data import load_paws, load_qqp

SEEDS = int(os.environ.get("GUARD_METAMORPHIC_SEEDS", "250"))
GUARD = ParaphraseGuard()

Edit = Callable[[str, random.Random], "str | None"]


@pytest.fixture(scope="module")
def data() -> tuple[list[str], list[tuple[str, str]]]:
    """Every sentence of both data files (in a seeded order), and every pair."""
    pairs = [(a, b) for a, b, _ in load_qqp()] + [(a, b) for a, b, _ in load_paws()]
    sentences = [s for p in pairs for s in p]
    random.Random(0).shuffle(sentences)
    return sentences, pairs


# ---- edits that keep the meaning ------------------------------------------------------------

def extra_space(s: str, r: random.Random) -> str | None:
    parts = s.split(" ")
    if len(parts) < 2:
        return None
    k = r.randrange(1, len(parts))
    return " ".join(parts[:k]) + r.choice(["  ", "   ", "\t", " \n "]) + " ".join(parts[k:])


def collapsed_space(s: str, r: random.Random) -> str | None:
    return " ".join(s.split())


def outer_space(s: str, r: random.Random) -> str | None:
    return r.choice([" " + s, s + " ", " " + s + " ", "\t" + s + "\n"])


def trailing_mark(s: str, r: random.Random) -> str | None:
    t = s.rstrip()
    if t.endswith(("?", ".")):
        if re.search(r"\b[A-Z]\.[A-Z]?\.?$", t):
            return None  # "U.S." / "C.E.": the full stop is the abbreviation's
        return r.choice([t[:-1], t[:-1].rstrip(), t[:-1] + ("." if t[-1] == "?" else "?")])
    return t + r.choice(["?", ".", " ?", " ."])


def apostrophes(s: str, r: random.Random) -> str | None:
    if "'" in s:
        return s.replace("'", "\u2019")
    return s.replace("\u2019", "'") if "\u2019" in s else None


def double_quotes(s: str, r: random.Random) -> str | None:
    if s.count('"') != 2:
        return None
    a = s.index('"')
    b = s.index('"', a + 1)
    return s[:a] + "\u201c" + s[a + 1:b] + "\u201d" + s[b + 1:]


def first_letter_case(s: str, r: random.Random) -> str | None:
    # A plain first word ("What", "how"), not an acronym or a name a Roman numeral follows
    # ("Celestin III": III is 3 only after a capitalised word, rule 1).
    if not re.match(r"[A-Za-z][a-z]+ (?![IVX]+\b)", s):
        return None
    return s[0].swapcase() + s[1:]


def space_before_mark(s: str, r: random.Random) -> str | None:
    # Not after a letter and a full stop: "C.E ." is PAWS's split "C.E." (reported apart).
    t = re.sub(r"(?<![A-Z]\.[A-Z]) ([,.?!;:])(?=\s|$)", r"\1", s)
    return t if t != s else None


CARDINALS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
             "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "twenty": 20, "thirty": 30,
             "forty": 40, "fifty": 50}
_NUMBERISH = set(CARDINALS) | {"one", "hundred", "thousand", "million", "billion", "and", "a"}


def number_in_digits(s: str, r: random.Random) -> str | None:
    """One cardinal number word standing alone ("three rooms", not "twenty five") in digits."""
    toks = s.split(" ")
    at = [k for k, t in enumerate(toks) if t.lower() in CARDINALS
          and (k == 0 or (toks[k - 1].lower() not in _NUMBERISH
                          and not toks[k - 1][-1:].isdigit()))
          and (k + 1 == len(toks) or toks[k + 1].lower().strip("-") not in _NUMBERISH)]
    if not at:
        return None
    k = r.choice(at)
    toks[k] = str(CARDINALS[toks[k].lower()])
    return " ".join(toks)


SAME_TEXT: dict[str, Edit] = {
    "extra space": extra_space, "collapsed space": collapsed_space,
    "outer space": outer_space, "trailing mark": trailing_mark, "apostrophes": apostrophes,
    "double quotes": double_quotes, "first letter case": first_letter_case,
    "space before a mark": space_before_mark, "number in digits": number_in_digits,
}
# The order check compares words as written: "five" in digits on one side of a pair may
# change its verdict (see the module docstring), so that edit is checked on a text alone.
SAME_PAIR = {k: v for k, v in SAME_TEXT.items() if k != "number in digits"}


# ---- edits that change the meaning ----------------------------------------------------------

def changed_digit(s: str, r: random.Random) -> str | None:
    at = [m.start() for m in re.finditer(r"\d", s)]
    if not at:
        return None
    i = r.choice(at)
    leading = (i == 0 or not s[i - 1].isdigit()) and s[i + 1:i + 2].isdigit()
    return s[:i] + r.choice([d for d in "0123456789" if d != s[i]
                             and not (leading and d == "0")]) + s[i + 1:]


def changed_number_word(s: str, r: random.Random) -> str | None:
    words = [w for w in CARDINALS if w not in ("twenty", "thirty", "forty", "fifty")]
    found = list(re.finditer(r"\b(" + "|".join(CARDINALS) + r")\b", s, re.IGNORECASE))
    if not found:
        return None
    m = r.choice(found)
    w = r.choice([x for x in words if x != m.group(0).lower()])
    return s[:m.start()] + (w.capitalize() if m.group(0)[0].isupper() else w) + s[m.end():]


_AUX = re.compile(r"\b(is|are|was|were|can|does|do|did|should|could|would|has|have|will)\b"
                  r"(?!['\u2019])", re.IGNORECASE)


def negation_added(s: str, r: random.Random) -> str | None:
    found = list(_AUX.finditer(s))
    if not found:
        return None
    m = r.choice(found)
    w = m.group(0)
    form = r.choice(["not", "n't", "never"])
    if form != "n't":
        return s[:m.end()] + " " + form + s[m.end():]
    neg = {"can": "can't", "will": "won't"}.get(w.lower(), w + "n't")
    return s[:m.start()] + (neg[0].upper() + neg[1:] if w[0].isupper() else neg) + s[m.end():]


def no_added(s: str, r: random.Random) -> str | None:
    found = list(re.finditer(r"\b(there (?:is|are)|have|has)\b (?!no\b|not\b|n't)", s,
                             re.IGNORECASE))
    if not found:
        return None
    m = r.choice(found)
    return s[:m.end()] + "no " + s[m.end():]


def negation_removed(s: str, r: random.Random) -> str | None:
    found = [m for m in re.finditer(r"\b(?:not|never|no)\b ?|n't\b|\bcannot\b", s,
                                    re.IGNORECASE) if m.group(0)]
    if not found:
        return None
    m = r.choice(found)
    g, before = m.group(0), s[:m.start()]
    if g.lower() == "cannot":
        return before + g[:3] + s[m.end():]
    if g.lower() == "n't":
        if before.lower().endswith("wo"):  # "won't": "will"
            before = before[:-2] + ("will" if before[-2] == "w" else "Will")
        elif before.lower().endswith("ca"):  # "can't": "can"
            before += "n"
    return before + s[m.end():]


def prefix_added(s: str, r: random.Random) -> str | None:
    """A negating prefix on a plain word ("safe" / "unsafe": rule 2) the text has nowhere
    else in any case ("River" / "nonriver" beside "Milcov River" is no opposite: the text
    has the word plain too), nor a negation ("without")."""
    words = s.split()
    seen = re.findall(r"[a-z]+", s.lower())
    at = [k for k, w in enumerate(words) if k and w.isalpha() and w.islower() and len(w) >= 4
          and sum(x.startswith(w) for x in seen) == 1 and w not in _NEGATIONS  # "doesn't"
          and not w.startswith(("un", "in", "im", "il", "ir", "dis", "non"))]
    if not at:
        return None
    k = r.choice(at)
    prefixed = r.choice(["un", "non", "dis"]) + words[k]
    # Words that only look prefixed ("display", "discharge") are listed as such in the guard;
    # and the text's own "disadvantages" beside "advantages" is in both texts (reported apart).
    if prefixed in _NOT_OPPOSITES or prefixed in seen:
        return None
    words[k] = prefixed
    return " ".join(words)


_NEGATIONS = {"not", "no", "never", "none", "nobody", "nothing", "neither", "nor", "nowhere",
              "without", "cannot", "unless", "hardly", "barely", "scarcely"}
_SENTENCE_END = set(".!?:;\"")
_NOT_NAMES = set("i what how why when where who which is are can do does the a an in on if "
                 "will may".split())
_COORDINATORS = {"and", "or", "vs", "vs.", "versus", "&"}


def names(s: str) -> list[tuple[int, int, int]]:
    """(start, end, token index) of each capitalised word (3+ letters) that starts no sentence:
    a name, by rule 3's definition."""
    toks = list(re.finditer(r"\S+", s))
    out = []
    for k, m in enumerate(toks[1:], 1):
        prev = toks[k - 1].group(0)
        if prev[-1] in _SENTENCE_END or prev in ("``", "''"):
            continue
        if re.fullmatch(r"[A-Z][a-z]{2,}", m.group(0)) and m.group(0).lower() not in _NOT_NAMES:
            out.append((m.start(), m.end(), k))
    return out


def name_runs(s: str) -> list[tuple[int, int, int, int]]:
    """Names in a row, as (start, end, first token, last token)."""
    out: list[tuple[int, int, int, int]] = []
    for a, b, k in names(s):
        if out and out[-1][3] == k - 1:
            out[-1] = (out[-1][0], b, out[-1][2], k)
        else:
            out.append((a, b, k, k))
    return out


def name_replaced(pool: list[str]) -> Edit:
    def edit(s: str, r: random.Random) -> str | None:
        found = names(s)
        if not found:
            return None
        a, b, _ = r.choice(found)
        words = set(s.lower().split())
        for _ in range(20):
            other = r.choice(pool)
            if other.lower() not in words:
                return s[:a] + other + s[b:]
        return None
    return edit


def _exchanged(s: str, a: tuple[int, int], b: tuple[int, int]) -> str:
    return s[:a[0]] + s[b[0]:b[1]] + s[a[1]:b[0]] + s[a[0]:a[1]] + s[b[1]:]


def _stems(words: str) -> set[str]:
    """The words, lowercased, without a plural's "s" (as the order check reads them)."""
    return {w[:-1] if w.endswith("s") else w for w in words.lower().split()}


def names_swapped(s: str, r: random.Random) -> str | None:
    """Two runs of names with no word in common (plurals as their singular), one or two plain
    words between them (no coordinator: "X and Y" / "Y and X" is let through by rule 5),
    exchanged."""
    runs, toks = name_runs(s), s.split()
    pairs = []
    for x, y in zip(runs, runs[1:], strict=False):
        gap = toks[x[3] + 1:y[2]]
        if not 1 <= len(gap) <= 2 or any(t.lower() in _COORDINATORS or not t.isalpha()
                                         for t in gap):
            continue
        if _stems(s[x[0]:x[1]]) & _stems(s[y[0]:y[1]]):
            continue  # "the Romans after the Roman Empire": "Empire" moved (order words)
        pairs.append((x, y))
    if not pairs:
        return None
    x, y = r.choice(pairs)
    return _exchanged(s, x[:2], y[:2])


def from_to_swapped(s: str, r: random.Random) -> str | None:
    m = re.search(r"\bfrom ([A-Z][a-z]+) to ([A-Z][a-z]+)\b", s)
    if not m or m.group(1) == m.group(2):
        return None
    return s[:m.start()] + f"from {m.group(2)} to {m.group(1)}" + s[m.end():]


def name_words_swapped(s: str, r: random.Random) -> str | None:
    """Two adjacent words of one name exchanged ("Spokane Arena" / "Arena Spokane")."""
    found = names(s)
    pairs = [(x, y) for x, y in zip(found, found[1:], strict=False)
             if y[2] == x[2] + 1 and s[x[0]:x[1]].lower() != s[y[0]:y[1]].lower()]
    if not pairs:
        return None
    x, y = r.choice(pairs)
    return _exchanged(s, x[:2], y[:2])


def changing_edits(sentences: list[str]) -> dict[str, Edit]:
    pool = sorted({s[a:b] for s in sentences[:4000] for a, b, _ in names(s)})
    return {"digit changed": changed_digit, "number word changed": changed_number_word,
            "negation added": negation_added, "no added": no_added,
            "negation removed": negation_removed, "prefix added": prefix_added,
            "name replaced": name_replaced(pool),
            "names swapped": names_swapped, "from X to Y swapped": from_to_swapped,
            "name words swapped": name_words_swapped}


# ---- the relations ---------------------------------------------------------------------------

def _applied(edit: Edit, sentences: list[str], seed: int) -> tuple[str, str] | None:
    """A sentence of the seed's sample and its edit (None: the edit found nothing to edit)."""
    r = random.Random(seed)
    s = r.choice(sentences)
    t = edit(s, r)
    return None if t is None or t == s else (s, t)


def _usable(edit: Edit, sentences: list[str]) -> list[str]:
    """Up to SEEDS sentences (at least 50) that `edit` changes, the first in the sentences'
    seeded order: some kinds are rare ("from X to Y", two double quotes)."""
    out: list[str] = []
    r = random.Random(0)
    for s in sentences:
        if edit(s, r) not in (None, s):
            out.append(s)
            if len(out) >= max(SEEDS, 50):
                break
    assert len(out) >= 10, len(out)
    return out


def _report(failures: list, what: str) -> None:
    assert not failures, f"{len(failures)} {what}, e.g.:\n" + "\n".join(
        repr(f) for f in failures[:5])


@pytest.mark.parametrize("name", SAME_TEXT)
def test_a_text_passes_against_itself_and_an_edit_that_keeps_its_meaning(data, name):
    sentences, _ = data
    edit, failures = SAME_TEXT[name], []
    usable = _usable(edit, sentences)
    for seed in range(SEEDS):
        s = random.Random(-seed).choice(sentences)
        if not GUARD.check(s, s).ok:
            failures.append((s, GUARD.check(s, s).reason))
        edited = _applied(edit, usable, seed)
        if edited is None:
            continue
        s, t = edited
        a, b = GUARD.check(s, t), GUARD.check(t, s)
        if not (a.ok and b.ok):
            failures.append((s, t, a.reason, b.reason))
    _report(failures, f"texts refused against an edit ({name}) of themselves")


@pytest.mark.parametrize("name", SAME_PAIR)
def test_an_edit_that_keeps_one_sides_meaning_keeps_a_pairs_verdict(data, name):
    sentences, pairs = data
    edit, failures = SAME_PAIR[name], []
    usable = set(_usable(edit, sentences))
    pairs = [p for p in pairs if p[0] in usable or p[1] in usable]
    for seed in range(SEEDS):
        r = random.Random(seed)
        q, c = r.choice(pairs)
        before = GUARD.check(q, c)
        if before.ok != GUARD.check(c, q).ok:
            failures.append(("asymmetric", q, c))
        side = r.choice([k for k in (0, 1) if (q, c)[k] in usable])
        t = edit((q, c)[side], r)
        if t is None:
            continue
        q2, c2 = (t, c) if side == 0 else (q, t)
        after, back = GUARD.check(q2, c2), GUARD.check(c2, q2)
        if after.ok != before.ok or back.ok != after.ok:
            failures.append((q, c, q2, c2, before.reason, after.reason, back.reason))
    _report(failures, f"pairs whose verdict an edit ({name}) of one side changed")


@pytest.mark.parametrize("name", [
    "digit changed", "number word changed", "negation added", "no added",
    "negation removed", "prefix added", "name replaced", "names swapped", "from X to Y swapped",
    "name words swapped"])
def test_an_edit_the_guard_documents_it_catches_is_refused(data, name):
    sentences, _ = data
    edit = changing_edits(sentences)[name]
    usable = _usable(edit, sentences)
    failures = []
    for seed in range(SEEDS):
        edited = _applied(edit, usable, seed)
        if edited is None:
            continue
        s, t = edited
        a, b = GUARD.check(s, t), GUARD.check(t, s)
        if a.ok or b.ok:
            failures.append((s, t, a.reason, b.reason))
    _report(failures, f"edits ({name}) served as the same text")
