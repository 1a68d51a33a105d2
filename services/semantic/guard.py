"""A second opinion before a high-similarity match is served: near-paraphrase traps.

Sentence embeddings are nearly bag-of-words: "flights from New York to Florida" and "flights
from Florida to New York" score ~0.98 with all-MiniLM-L6-v2, as do most PAWS non-paraphrases.
The guard refuses a match when the two texts disagree on something the embedding blurs:

1. numbers — the numbers (digits, signed, or number words, "twenty-five" one number), the
   units written after them ("5 pm" / "5 am", "100 mg" / "100 g") or how often each occurs
   differ;
2. negation — the texts have a different number of negations ("no sugar and no salt" is
   not "sugar and salt"), or one has a word the other has only with a negating prefix
   ("legal" / "illegal", "safe" / "unsafe": ~0.99 cosine) or a "-less" suffix ("harmless" /
   "harmful", "odorless" / "odorous");
3. entities — a capitalised word (not sentence-initial), acronym or alphanumeric code of one
   text is missing from the other;
4. contrast — one text has a word of a contrasting group where the other has another of
   that group: quantifiers ("all" / "some"), comparisons ("over 18" / "under 18", "more" /
   "less"), times ("before" / "after", "this week" / "next week", "minutes" / "hours"),
   directions, opposite actions ("buy" / "sell") and roles ("husband" / "wife"). MiniLM
   scores such pairs 0.95-0.99;
5. order — two entities (or two numbers in digits) both texts have, next to each other, are
   swapped ("from Spanish to English" / "from English into Spanish", "5/6/2020" / "6/5/2020";
   each item at every place it stands, the k-th paired with the k-th, a number also where it
   is written as a word; moved with a phrase, "In Berlin, what did Obama say?", is not a
   swap), or the words the texts share are arranged differently beyond one block move.
   Either is let through when the texts are the same words with the two phrases around one
   "and", "or" or "vs" exchanged ("the difference between X and Y" / "... between Y and X").

Accents are dropped first ("Pokémon" is the word "Pokemon"; the strict tier's spelling check
tells them apart), and a number is split from a unit written onto it ("10km" is "10 km").

The order test counts breakpoints: adjacent pairs of shared words (with start/end sentinels)
in the cached text that are no longer adjacent in the new one. Moving one block of words
("X did Y in 2010" -> "In 2010 X did Y") breaks exactly 3 adjacencies; exchanging two
words or phrases ("from A to B" -> "from B to A") breaks at least 4. So more than 3
breakpoints means the shared words were shuffled, not just one phrase moved.
"""

from __future__ import annotations

import math
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
    # Orders of magnitude ("hundreds of people" / "thousands of people": 0.986 cosine).
    "dozens": "12s", "hundreds": "100s", "thousands": "1000s", "millions": "1e6s",
    "billions": "1e9s",
}
_NEGATIONS = {"not", "no", "never", "none", "nobody", "nothing", "neither", "nor", "nowhere",
              "without", "cannot", "n't", "unless", "hardly", "barely", "scarcely"}
# Cardinal number words that combine into one number ("twenty-five", "two hundred"); the
# rest of _NUMBER_WORDS stand alone.
_UNITS = {w: int(v) for w, v in _NUMBER_WORDS.items() if v.isdigit() and int(v) < 20}
_TENS = {w: int(v) for w, v in _NUMBER_WORDS.items() if v.isdigit() and 20 <= int(v) < 100}
_SCALES = {"hundred": 100, "thousand": 1000, "million": 10**6, "billion": 10**9}
_ONE_AS_PRONOUN = frozenset({"no", "any", "some", "every", "each", "which", "someone's", "does",
                             "do", "can", "should", "would", "could", "must", "might", "may",
                             "will", "if"})


def _pronoun_one(low: str, before: str) -> bool:
    """`low` (lowercased) is "one" as a pronoun after `before` ("no one", "which one"): no
    number."""
    return low == "one" and before.lower() in _ONE_AS_PRONOUN


# Roman numerals after a name ("World War II", "Henry VIII", "Chapter IV"): that number.
_ROMAN = re.compile(r"(?=[IVX]{2,})X{0,3}(?:IX|IV|V?I{0,3})")
_ROMAN_DIGITS = {"I": 1, "V": 5, "X": 10}


def _roman(tokens: list[str], k: int) -> int | None:
    """The value of tokens[k] as a Roman numeral after a capitalised word, else None."""
    t = tokens[k]
    if not (k and t.isupper() and t != "IV" and _ROMAN.fullmatch(t)
            and tokens[k - 1][:1].isupper()):  # "IV": intravenous as often
        return None
    vals = [_ROMAN_DIGITS[ch] for ch in t]
    return sum(-v if v < nxt else v for v, nxt in zip(vals, [*vals[1:], 0], strict=True))
# Units written after a number, which the number's meaning depends on ("5 pm" / "5 am",
# "100 mg" / "100 g"), each spelling as one ("10 lbs" / "10 pounds", "30 mins" / "30 minutes":
# refused before as different numbers); words that are also plain English words ("in", "a",
# "second") are left out. "canon:form,form" items.
_UNIT_SPEC = """am pm mg:milligram,milligrams g:gram,grams kg:kgs,kilogram,kilograms,kilo,kilos
lb:lbs,pound,pounds oz:ounce,ounces km:kms,kilometer,kilometers,kilometre,kilometres
m:meter,meters,metre,metres cm:centimeter,centimeters,centimetre,centimetres
mm:millimeter,millimeters,millimetre,millimetres mi:mile,miles ft:foot,feet in:inch,inches
yd:yard,yards kb:kilobyte,kilobytes mb:megabyte,megabytes gb:gigabyte,gigabytes
tb:terabyte,terabytes ml:milliliter,milliliters,millilitre,millilitres
l:liter,liters,litre,litres mph kph:kmh ms:millisecond,milliseconds min:mins,minute,minutes
h:hr,hrs,hour,hours sec:secs,seconds day:days week:weeks month:months year:years,yr,yrs
decade:decades hz khz mhz ghz w:watt,watts kw kwh v:volt,volts mah c:celsius f:fahrenheit
kelvin:kelvins
usd:dollar,dollars eur:euro,euros gbp inr:rupee,rupees percent deg:degree,degrees"""
_UNIT_FORMS: dict[str, str] = {}
for _item in _UNIT_SPEC.split():
    _canon, _, _forms = _item.partition(":")
    for _f in (_canon, *filter(None, _forms.split(","))):
        _UNIT_FORMS[_f] = _canon
_UNIT_FORMS.pop("in")  # "inch" and "inches" only: "in" is the preposition
# Units a number is often written without, meaning the same ("at the age of 3" / "at the age of
# 3 years", "takes 30" / "takes 30 minutes"): a bare number agrees with the number in them.
_IMPLIED_UNITS = frozenset({"ms", "min", "h", "sec", "day", "week", "month", "year",
                            "decade"})
# The temperature scales, written after "degrees" ("400 degrees F" is "400°F"). Degrees without
# one agree with neither ("Is 40 degrees cold outside?" / "Is 40°C ...": a review's strict
# hits), nor with a bare number.
_DEGREE_SCALES = ("c", "f", "kelvin")
# Words a version number follows ("version 1.10"), compared as written.
_VERSION_WORDS = frozenset({"version", "v", "ver", "release", "build"})
# Scale letters after a currency amount ("$5m", "$2bn"): the scale words.
_MONEY_SCALES = {"m": "million", "mn": "million", "bn": "billion", "b": "billion"}
# Currency signs written before the number: its unit, as if written after it.
_CURRENCY_SIGNS = {"$": "usd", "\u20ac": "eur", "\u00a3": "gbp", "\u20b9": "inr"}
_STOP_CAPS = {"i", "i'm", "i've", "i'd", "i'll", "what", "how", "why", "when", "where", "who",
              "which", "is", "are", "can", "do", "does", "the", "a", "an", "in", "on", "if"}
# Words in capitals that are no name, and another spelling of them ("OK" / "okay").
_PLAIN_CAPS = {"ok": "okay"}
# Words an acronym's letters do not stand for ("an instance" is no "AI").
_NOT_IN_ACRONYMS = frozenset("""a an the of and or to in on for at by is are was with my your
his her its our their this that what how why""".split())


class GuardResult(NamedTuple):
    """`ok` False means the match must not be served; `reason` says which check refused."""

    ok: bool
    reason: str


# Negated auxiliaries written without the apostrophe ("doesnt", "cant") or with it misplaced
# ("does'nt"): the same negation as "doesn't".
_BARE_NOT = re.compile(r"\b(do|does|did|is|are|was|were|ca|could|should|would|wo|has|have|had|"
                       r"must|need|might|ai|sha)(?:nt|'nt|n t)\b", re.IGNORECASE)
# Apostrophes typed otherwise: right and left quotes, an acute accent ("don´t").
_APOSTROPHES = str.maketrans({c: "'" for c in "\u2019\u2018\u00b4`\u02bc\u2032\uff07"})


def _unaccented(text: str) -> str:
    """`text` without accents ("Pokémon" -> "Pokemon"), case kept."""
    if text.isascii():  # no accents to drop (most texts; 10x faster)
        return text
    return unicodedata.normalize("NFC", "".join(
        c for c in unicodedata.normalize("NFD", text) if not unicodedata.combining(c)))


# A number: a sign only where it starts a word ("-10", not "COVID-19" or "1-2"), then digits
# with decimal or thousands separators. Letters written onto it are a word of their own, a
# unit ("10km", "5pm", "5k"), except an ordinal's or a multiple's ("3rd", "2x": "third",
# "twice").
_NUMBER = r"(?<![\w.])-?[0-9]+(?:[.,][0-9]+)*"
_TOKEN = re.compile(rf"n't|{_NUMBER}(?:st|nd|rd|th|x)\b|{_NUMBER}(?![0-9])"
                    r"|[A-Za-z0-9]+(?:[.,][0-9]+)*|[^\sA-Za-z0-9]", re.IGNORECASE)


_DOTTED = re.compile(r"\b(?:[A-Z]\.){2,}")
_DOTTED_TIME = re.compile(r"(?<=\d)\s*([AaPp])\.\s?([Mm])\.?")
_US_DOLLARS = re.compile(r"\bU\.?S\.?\s+([Dd]ollars?)\b")
_DEGREES = re.compile(r"\s*\u00b0\s*([CF](?![A-Za-z]))?|(?<![A-Za-z])degrees?\s+([CF])\b")
_DEGREE_NAMES = {"C": " Celsius", "F": " Fahrenheit"}


def _degrees(m: re.Match) -> str:
    """A degree sign or "degrees C" written out, as words. A space after them only before a
    word ("40° Fahrenheit" was the one word "degreesFahrenheit"); none before a hyphen, which
    stays a range's ("30°C-40°C": with a space, "-40" read as a negative number)."""
    words = " degrees" + _DEGREE_NAMES.get(m.group(1) or m.group(2) or "", "")
    after = m.string[m.end():m.end() + 1]
    # A space the match took ("40.7° -74.0°") is given back: "-74.0" keeps its sign.
    return words + " " if after.isalnum() or m.group(0)[-1:].isspace() else words


def _tokens(text: str) -> list[str]:
    text = _unaccented(text.translate(_APOSTROPHES)).replace("\u2212", "-")
    # "non-stop" and "nonstop" are one word (and "non-smoking" the opposite of "smoking").
    text = re.sub(r"\b([Nn]on)-(?=[A-Za-z])", r"\1", text)
    # "U.S." and "U.S.A." are the acronyms "US" and "USA" (their letters fell apart, and the
    # "S" after a full stop read as a sentence start).
    # "8 p.m." is "8 pm" (its letters fell apart: "8" / "8 pm" read as other numbers).
    text = _DOTTED_TIME.sub(lambda m: f"{m.group(1)}{m.group(2)} ", text)
    # "100 US dollars" is "100 dollars" ("US" read as an entity the other lacked).
    text = _US_DOLLARS.sub(r"\1", text)
    text = _DOTTED.sub(lambda m: m.group(0).replace(".", "") + " ", text)
    # "400°F", "400 ° F" and "400 degrees F" are "400 degrees Fahrenheit" ("°C" and "C"
    # were an entity the other text lacked), a "°" alone is "degrees".
    text = _DEGREES.sub(_degrees, text)
    text = _BARE_NOT.sub(lambda m: m.group(1) + "n't", text)
    text = re.sub(r"n't\b", " n't", text, flags=re.IGNORECASE)
    return ["n't" if t.lower() == "n't" else t for t in _TOKEN.findall(text)]


def _signed(t: str) -> bool:
    """`t` is a number with its sign ("-10": the tokenizer keeps a sign only there)."""
    return t[0] == "-" and len(t) > 1


def _is_word(t: str) -> bool:
    return t[0].isalnum() or t == "n't" or _signed(t)


def _words(tokens: list[str]) -> list[str]:
    return [t for t in tokens if _is_word(t)]


# Commas that separate thousands: each before a group of three digits that ends the whole
# number ("1,000", "1,234.5", "1,000th"), groups of two allowed before it ("12,34,567").
_THOUSANDS = re.compile(r"-?[0-9]+(?:,[0-9]{2,3})*,[0-9]{3}(?:\.[0-9]+)?(?:st|nd|rd|th|x)?",
                        re.IGNORECASE)


def _without_separators(word: str) -> str:
    """`word` (digits) without its thousands separators. Another comma separates no thousands
    ("1,5" is 1.5 in much of Europe, "2,3" a list; both were read as 15 and 23): the number is
    kept as written."""
    return word.replace(",", "") if "," not in word or _THOUSANDS.fullmatch(word) else word


def _number(word: str) -> str | None:
    """The number `word` writes (digits, signed, or a number word), in one form; else None."""
    low = word.lower()
    if low[0].isdigit() or _signed(low):
        return _without_separators(low)
    return _NUMBER_WORDS.get(low)


def _number_value(word: str) -> float | None:
    """The value of a number written in digits ("1,000", "-2.5"), else None ("1,5": a comma
    that separates no thousands)."""
    try:
        v = float(_without_separators(word))
    except ValueError:
        return None
    return v if math.isfinite(v) else None  # 400 digits: compared as written


def _number_key(value: float) -> str:
    return str(int(value)) if value == int(value) else repr(value)


def _version_after_name(words: list[str], low: list[str], i: int) -> bool:
    """The number at `i` (with a ".") is a version after a name, not a quantity."""
    return bool(i) and (
        low[i - 1] in _VERSION_WORDS
        or (words[i - 1][:1].isupper() and low[i - 1] not in _STOP_CAPS)) and not (
        i + 1 < len(low) and (low[i + 1] in _UNIT_FORMS or low[i + 1] in _SCALES
                              or low[i + 1] == "per"))


def _digits_at(words: list[str], low: list[str], i: int) -> float | None:
    """The value the digits at `i` start a run with (inf: compared as written); None where
    they start none."""
    w = low[i]
    digits = _number_value(w) if w[0].isdigit() or _signed(w) else None
    if digits is None and "," in w and w[-1].isdigit() and (w[0].isdigit() or _signed(w)):
        # "1,5 liters": no thousands separator, compared as written with its unit (as a
        # number past a float is, `_run_key`), not as 15 nor without "liters".
        digits = math.inf
    if digits is not None and "." in w and _version_after_name(words, low, i):
        # A version after a name is no quantity: "Python 3.10" is not "Python 3.1" (equal
        # as numbers; a review's standard-tier hit), though "2.50 mg" is "2.5 mg", and
        # "Xanax 0.5 mg" a dose with its unit (a first version dropped the unit).
        digits = None
    return digits


def _run(low: list[str], i: int, digits: float | None) -> tuple[float, str, int]:
    """A run: digits or number words, then scale words ("2 million", "two hundred and
    fifty"). Returns its value, the kind of its last word, and where it ends."""
    n = len(low)
    total = group = 0.0
    last = ""
    if digits is not None:
        group, last, i = digits, "digits", i + 1
    while i < n:
        w = low[i]
        if w in _UNITS and last in ("", "ten", "scale", "and"):
            group, last = group + _UNITS[w], "unit"
        elif w in _TENS and last in ("", "scale", "and"):
            group, last = group + _TENS[w], "ten"
        elif w in _SCALES and last in ("", "digits", "unit", "ten", "scale"):
            scale = _SCALES[w]
            # A scale alone ("a million", "hundred thousand") counts one of it; a number
            # written before it, even 0, counts that many ("0 billion" was 1 billion).
            base = group if last in ("digits", "unit", "ten") else (group or 1)
            if scale == 100:
                group = base * 100
            else:
                total, group = total + base * scale, 0.0
            last = "scale"
        elif (w == "and" and last == "scale" and i + 1 < n
              and (low[i + 1] in _UNITS or low[i + 1] in _TENS)):
            last = "and"
        else:
            break
        i += 1
    return total + group, last, i


def _run_key(low: list[str], start: int, i: int, value: float, last: str) -> tuple[str, int]:
    """The key of the run `low[start:i]` worth `value`, and where it ends ("k" taken)."""
    # Past a float ("9" x 300 "billion"): as written, as a long number alone is (int() of
    # the inf was an OverflowError, every Lookup meeting the entry INTERNAL).
    key = _number_key(value) if math.isfinite(value) else " ".join(low[start:i])
    if i < len(low) and low[i] == "k" and last == "digits" and math.isfinite(value):
        key, i = _number_key(value * 1000), i + 1  # "100k" is 100000
    return key, i


def _with_unit(low: list[str], i: int, key: str, start: int,
               feet_end: int) -> tuple[str, int, int]:
    """`key` with the unit at `i` that belongs to it; where it ends, and where the last
    "<number> ft" ended."""
    n = len(low)
    if i < n and low[i] in _UNIT_FORMS:
        unit, i = _UNIT_FORMS[low[i]], i + 1
        if unit == "deg" and i < n and _UNIT_FORMS.get(low[i]) in _DEGREE_SCALES:
            unit, i = _UNIT_FORMS[low[i]], i + 1  # "400 degrees Fahrenheit": 400 f
        key = f"{key} {unit}"
        if unit == "ft":
            feet_end = i
    elif start == feet_end:
        # "5 ft 10 in", "5 ft 10", "5 foot 10": the number right after feet is inches.
        key = f"{key} in"
        if i < n and low[i] == "in":
            i += 1
    elif i + 1 < n and low[i] == "per" and low[i + 1] == "cent":
        key, i = f"{key} percent", i + 2
    return key, i, feet_end


def _numbers(words: list[str]) -> Counter:
    """How often each number occurs, with the unit written after it ("5pm" and "5 pm" are
    "5 pm", not "5 am": "10km" is read as "10 km"). Cardinal number words in a row make one
    number ("twenty five" and "twenty-five" are 25, "two hundred and fifty" 250, "a million"
    and "1 million" 1000000)."""
    out: Counter = Counter()
    low = [w.lower() for w in words]
    i, n = 0, len(low)
    feet_end = -1  # where the last "<number> ft" ended
    while i < n:
        w = low[i]
        if i and _pronoun_one(w, low[i - 1]) and not (i + 1 < n and low[i + 1] in _SCALES):
            i += 1  # "no one", "which one": no number ("nobody" / "no one" were refused)
            continue
        digits = _digits_at(words, low, i)
        if digits is None and w not in _UNITS and w not in _TENS and w not in _SCALES:
            # Ordinals, multiples, "half" (in words or digits: "third", "3rd", "2x"), and
            # numbers too long for a float: alone, as written.
            key = _number(w)
            if key is not None:
                out[key] += 1
            i += 1
            continue
        # A unit after a run belongs to it.
        start = i
        value, last, i = _run(low, i, digits)
        key, i = _run_key(low, start, i, value, last)
        key, i, feet_end = _with_unit(low, i, key, start, feet_end)
        out[key] += 1
    return out


def _number_words(tokens: list[str]) -> list[str]:
    """The words `_numbers` reads: the text's words, "%" as "percent", and a currency sign
    before a number as its unit after it ("$5" as "5 usd", "$5 million" as "5 million usd")."""
    out: list[str] = []
    unit = ""
    for k, t in enumerate(tokens):
        if t in _CURRENCY_SIGNS and k + 1 < len(tokens) and tokens[k + 1][0].isdigit():
            unit = _CURRENCY_SIGNS[t]
            continue
        if t in _CURRENCY_SIGNS and k and tokens[k - 1][0].isdigit() and not unit:
            out.append(_CURRENCY_SIGNS[t])  # "1000$": written after, as "1000 dollars"
            continue
        if unit and t.lower() in _MONEY_SCALES and k and tokens[k - 1][0].isdigit():
            t = _MONEY_SCALES[t.lower()]  # "$5m": 5 million usd, not 5 usd and a word
        roman = _roman(tokens, k)
        if roman is not None:
            out.append(str(roman))
        elif t == "%":
            out.append("percent")
        elif _is_word(t):
            out.append(t)
        else:
            continue
        nxt = tokens[k + 1].lower() if k + 1 < len(tokens) else ""
        if unit and not (nxt in _SCALES or nxt == "k" or nxt in _MONEY_SCALES):
            out.append(unit)
            unit = ""
    return out


def numbers_agree(q: TextFacts, c: TextFacts) -> bool:
    """The texts write the same numbers, as often, with the same units; a number written
    without a unit agrees with the same number in a unit often left out ("3" / "3 years")."""
    if q.numbers == c.numbers:
        return True
    a, b = Counter(dict(q.numbers)), Counter(dict(c.numbers))
    a, b = a - b, b - a
    for x, y in ((a, b), (b, a)):
        for key in list(x):
            num, _, unit = key.partition(" ")
            if unit in _IMPLIED_UNITS and y[num] > 0:
                k = min(x[key], y[num])
                x[key] -= k
                y[num] -= k
    return not +a and not +b


def _negations(words: list[str]) -> int:
    """How many negations the words hold ("neither A nor B" two, as "not A and not B")."""
    return sum(1 for w in words if w.lower() in _NEGATIONS)


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


def _prefixed(x: set[str], y: set[str]) -> list[tuple[str, str]]:
    """(word, prefixed word) for the words of `x` that are a word of `y` with a negating
    prefix ("illegal" for "legal"), that word absent from `x`."""
    out = []
    for w in x - y:
        if w in _NOT_OPPOSITES:
            continue
        for p in _NEG_PREFIXES:
            stem = w[len(p):].lstrip("-") if w.startswith(p) else ""
            if len(stem) >= _MIN_STEM and stem in y and stem not in x:
                out.append((stem, w))
                break
    return out


def negated_alike(q: TextFacts, c: TextFacts) -> bool:
    """The texts negate the same thing, one with "not", the other with a prefix ("not
    possible" / "impossible", "not legal" / "illegal": refused before as negation differing):
    the text with fewer negations has just as many more prefixed opposites, the other none."""
    pq, pc = _prefixed(q.lower_set, c.lower_set), _prefixed(c.lower_set, q.lower_set)
    more = q.negations - c.negations
    return bool(more) and ((not pq and len(pc) == more) or (not pc and len(pq) == -more))


def _opposite(a: set[str], b: set[str]) -> str:
    """A word of `a` that `b` has only with a negating prefix (or the reverse), as
    "word/prefixword"; "" when there is none."""
    for x, y in ((a, b), (b, a)):
        for stem, w in _prefixed(x, y):
            return f"{stem}/{w}"
        for w in x - y:
            if w in _NOT_OPPOSITES:
                continue
            if w.endswith("less") and len(w) - 4 >= _MIN_STEM:
                # "odorless" / "odorous", "harmless" / "harmful", "sugarless" / "sugar"
                stem = w[:-4]
                for other in (stem, stem + "ful", stem + "ous", stem + "y"):
                    if other in y and other not in x:
                        return f"{other}/{w}"
    return ""


# Groups of words that contrast with each other: "canon:form,form ..." per group, one group a
# line. A text with more of one word of a group, where the other has more of another word of
# the same group, says something else ("all users" / "some users", "over 18" / "under 18",
# "once a day" / "once a week"). Only words alone: "the most", "how many", "all time" and
# "every other" are read apart below. Left out: words with a common other sense, such as
# "second" (an ordinal), "may" and "march" (verbs), "min" (minimum or minutes). A word may be
# in several groups ("most": "all" / "most" and "at most" / "at least"); "some" / "many" and
# "several" are near enough in questions to stand together.
_CONTRAST_SPEC = """
all:every,each most some few
all any
many few
most least
both either
always:usually,often,frequently,generally,normally sometimes:occasionally,rarely,seldom
more less:fewer
over under
above below
higher lower
highest lowest
bigger:larger smaller
biggest:largest smallest
longer shorter
faster:quicker slower
fastest:quickest slowest
older younger
oldest youngest
newer older
newest oldest
best worst
better worse
maximum minimum
before after during
early late
earlier later
yesterday today tomorrow
next last this
increase:increases,increased,increasing decrease:decreases,decreased,decreasing,reduce
buy:buying,bought,buys sell:selling,sold,sells
import:imports,importing export:exports,exporting
win:wins,winning,won lose:loses,losing,lost
upload:uploads,uploading download:downloads,downloading
encrypt:encrypting,encryption decrypt:decrypting,decryption
hot cold
left right
north south east west
morning afternoon evening night:nights noon midnight
seconds:secs,sec minute:minutes,mins hour:hours,hrs,hr day:days week:weeks month:months \
year:years,yrs decade:decades century:centuries
man:men woman:women
male:males female:females
boy:boys girl:girls
boyfriend girlfriend
husband wife
son:sons daughter:daughters
father:dad mother:mom,mum
brother:brothers sister:sisters
on off
keep:keeps,keeping stop:stops,stopping,stopped
start:starts,starting,started stop:stops,stopping,stopped
good:ok,okay,fine,safe bad:harmful,dangerous,wrong,toxic
glass:glasses bottle:bottles pint:pints jar:jars
cup:cups tablespoon:tablespoons,tbsp teaspoon:teaspoons,tsp
must:required,mandatory,compulsory,obligatory may:optional,allowed,permitted,recommended,should
monday tuesday wednesday thursday friday saturday sunday
january february april june july september october november december
"""
_CONTRAST_CANON: dict[str, str] = {}
_CONTRAST_GROUPS: dict[str, tuple[int, ...]] = {}  # canonical word -> its groups
for _g, _line in enumerate(filter(None, _CONTRAST_SPEC.strip().splitlines())):
    for _item in _line.split():
        _canon, _, _forms = _item.partition(":")
        for _f in (_canon, *filter(None, _forms.split(","))):
            _CONTRAST_CANON.setdefault(_f, _canon)
        _CONTRAST_GROUPS[_canon] = (*_CONTRAST_GROUPS.get(_canon, ()), _g)
# Two-word phrases whose second word contrasts nothing: a superlative ("the most popular"), a
# question or an intensifier ("how many", "so many"), "of all time", "not at all".
_VACUOUS_AFTER = {"most": {"the"}, "many": {"how", "so", "too", "as"},
                  "all": {"at"}, "time": {"all"}}


def _contrast_words(lower: tuple[str, ...]) -> frozenset[tuple[str, int]]:
    """(canonical contrast word, how often) for the words of `lower` in a contrast group."""
    out: Counter = Counter()
    prev = ""
    for k, w in enumerate(lower):
        if w == "keep" and "from" in lower[k + 1:k + 5]:
            out["stop"] += 1  # "keep my dog from barking" is "stop my dog from barking"
            prev = w
            continue
        if prev in _VACUOUS_AFTER.get(w, ()):
            if w == "time":  # "all time": the "all" counted before was no quantifier
                out["all"] -= 1
        elif prev == "every" and w == "other":  # "every other day" is not "every day"
            out["all"] -= 1
            out["every other"] += 1
        elif prev == "a" and w == "few":  # "a few" is "some"; "few" alone is "not many"
            out["some"] += 1
        elif prev == "this" and w == "past":  # "this past weekend" is "last weekend"
            out["this"] -= 1
            out["last"] += 1
        else:
            canon = _CONTRAST_CANON.get(w)
            if canon is not None:
                out[canon] += 1
        prev = w
    return frozenset((w, k) for w, k in out.items() if k > 0)


def _comparatives(lower: tuple[str, ...]) -> frozenset[tuple[str, int]]:
    """(adjective, +1 / -1) for each comparison before "than": "healthier than" and "more
    healthy than" +1, "less healthy than" -1 (the adjective as written after "more" / "less",
    or the "-er" / "-ier" word's stem)."""
    out = set()
    for k in range(1, len(lower)):
        if lower[k] != "than":
            continue
        w, before = lower[k - 1], lower[k - 2] if k > 1 else ""
        if before in ("less", "more"):
            out.add((w, 1 if before == "more" else -1))
        elif len(w) > 4 and w.endswith("ier"):
            out.add((w[:-3] + "y", 1))
        elif len(w) > 4 and w.endswith("er"):
            out.add((w[:-2], 1))
    return frozenset(out)


def _same_stem(a: str, b: str) -> bool:
    return a.startswith(b) or b.startswith(a) or (len(a) >= 5 and a[:5] == b[:5])


def _comparison_reversed(q: TextFacts, c: TextFacts) -> str:
    """An adjective compared one way in one text and the other way in the other ("healthier
    than" / "less healthy than": a tester's standard-tier hit, 0.964 cosine); "cheaper than" /
    "less expensive than" say the same."""
    for a, da in q.comparatives:
        for b, db in c.comparatives:
            if da != db and _same_stem(a, b):
                return f"{a}/{b}"
    return ""


def contrast(q: TextFacts, c: TextFacts) -> str:
    """A word of one text and another of the same contrast group that the other text has
    instead, as "word/word"; "" when there is none."""
    if q.comparatives != c.comparatives:
        reversed_ = _comparison_reversed(q, c)
        if reversed_:
            return reversed_
    if q.contrasts == c.contrasts:
        return ""
    cq, cc = dict(q.contrasts), dict(c.contrasts)
    more: dict[int, str] = {}
    fewer: dict[int, str] = {}
    for w in sorted(set(cq) | set(cc)):
        a, b = cq.get(w, 0), cc.get(w, 0)
        for g in _CONTRAST_GROUPS.get(w, ()):
            if a > b:
                more.setdefault(g, w)
            elif a < b:
                fewer.setdefault(g, w)
    for g in sorted(set(more) & set(fewer)):
        return f"{more[g]}/{fewer[g]}"
    if ("every other" in cq) != ("every other" in cc) and cq.get("all", 0) != cc.get("all", 0):
        return "every other/every"
    return ""


class Span(NamedTuple):
    """Entity words in a row ("new york"), and where they stand among the text's words."""

    key: str
    first: int
    last: int


def _ends_number(word: str, before: str) -> bool:
    """`word` (after `before`) can end a number that `_numbers` reads a unit after: digits,
    signed or not, a cardinal or scale word ("twenty USD", "5 million USD"), the "k" of "40k".
    """
    low = word.lower()
    if _pronoun_one(low, before):
        return False
    return (low[0].isdigit() or _signed(low) or low in _UNITS or low in _TENS or low in _SCALES
            or (low == "k" and before[:1].isdigit()))


def _entities(tokens: list[str]) -> tuple[set[str], list[Span]]:
    """Capitalised words not at a sentence start, acronyms and codes with digits, lowercased;
    and the spans they form (every occurrence, in order)."""
    out: set[str] = set()
    spans: list[Span] = []
    start = True
    pos = -1  # index among the words
    run: list[str] = []
    run_first = 0

    def close() -> None:
        if run:
            key = " ".join(run)
            spans.append(Span(key, run_first, run_first + len(run) - 1))
            run.clear()

    prev = prev_word = ""
    number_before = False  # the word before can end a number (`_ends_number`)
    for k, t in enumerate(tokens):
        if not _is_word(t) or t == "n't":
            start = t in (".", "!", "?", ":", ";", '"', "``")
            close()
            if t == "n't":
                pos += 1
            prev, number_before = t, False
            continue
        pos += 1
        after_number = number_before or (
            prev.lower() in ("degree", "degrees") and _UNIT_FORMS.get(t.lower()) in _DEGREE_SCALES)
        # The word before, as `_numbers` reads it: "no, one GB" is no number ("no one").
        prev, prev_word, number_before = t, t, _ends_number(t, prev_word)
        unit = _UNIT_FORMS.get(t.lower()) if after_number else None
        if ((unit is not None and not (t[0].isupper() and unit in _IMPLIED_UNITS))
                or _roman(tokens, k) is not None):
            # A unit after its number ("500 MB", "20 USD", "5 million USD", "-10 C") is the
            # number's, compared with it in any spelling ("500 megabytes"), not an entity the
            # other text must write. Not a capitalised unit that a bare number matches
            # (`numbers_agree`): "five MS patients" / "five patients" agree as numbers, and
            # MS (or SEC, H, Year) there is a name the other text lacks.
            close()
            start = False
            continue
        if _signed(t):
            special = False
        elif t.isalpha():
            special = len(t) >= 2 and t.isupper()  # an acronym
        else:  # a code: letters and digits
            special = any(c.isdigit() for c in t) and any(c.isalpha() for c in t)
        if t.lower() in _PLAIN_CAPS:  # "OK" is a word, not a name ("Is it OK to ...")
            close()
            start = False
            continue
        if special or (t[0].isupper() and not start and t.lower() not in _STOP_CAPS):
            out.add(t.lower())
            if not run:
                run_first = pos
            run.append(t.lower())
        else:
            close()
        start = False
    close()
    return out, spans


def entities_missing(q: TextFacts, c: TextFacts) -> set[str]:
    """The entities of either text that the other does not have (as a word, or a number
    written otherwise: "3rd" / "third", "Three" / "3")."""
    def absent(e: str, other: TextFacts) -> bool:
        # "Chapter Three" / "Chapter 3": a capitalised number word is the other's digits
        return (e not in other.vocab and _number(e) not in other.vocab
                and _PLAIN_CAPS.get(e) not in other.vocab)

    missing = ({e for e in q.entities if absent(e, c)}
               | {e for e in c.entities if absent(e, q)})
    for a, b in ((q, c), (c, q)):
        for e in sorted(missing & a.entities):
            spelled = _spelled_out(e, a, b)
            if spelled:  # "US" / "United States", "OS" / "operating system"
                missing.discard(e)
                missing.difference_update(spelled)
    return missing


def _spelled_out(acronym: str, a: TextFacts, b: TextFacts) -> tuple[str, ...]:
    """Words of `b`, in a row, whose initials spell `acronym` (2-5 letters, an entity of
    `a`), none of them in `a` nor a word acronyms skip, or one word of `b` whose capitals
    spell it ("JavaScript"); () when there are none."""
    n = len(acronym)
    if not (2 <= n <= 5 and acronym.isalpha()):
        return ()
    for w in b.words:  # one word, its capitals the acronym: "JS" / "JavaScript"
        if (len(w) > n and w[0].isupper() and w.isalpha() and w.lower() not in a.lower_set
                and "".join(ch for ch in w if ch.isupper()).lower() == acronym):
            return (w.lower(),)
    words = b.lower
    for k in range(len(words) - n + 1):
        run = words[k:k + n]
        if ("".join(w[0] for w in run) == acronym and a.lower_set.isdisjoint(run)
                and _NOT_IN_ACRONYMS.isdisjoint(run) and all(w.isalpha() for w in run)):
            return run
    return ()


def acronyms_folded(q: TextFacts, c: TextFacts) -> tuple[TextFacts, TextFacts]:
    """`q` and `c`, with the words of one that spell out an acronym of the other written as
    that acronym (the pair unchanged when there are none)."""
    if q.entities <= c.vocab and c.entities <= q.vocab:
        return q, c
    out = [q, c]
    for i, (a, b) in enumerate(((q, c), (c, q))):
        for e in sorted(a.entities - b.vocab):
            run = _spelled_out(e, a, b)
            if run:
                out[1 - i] = _with_acronym(out[1 - i], run, e)
    return out[0], out[1]


def _with_acronym(f: TextFacts, run: tuple[str, ...], acronym: str) -> TextFacts:
    """`f` analysed again with the first place of the words `run` written as `acronym`."""
    at = [k for k, t in enumerate(f.tokens) if _is_word(t)]  # each word's token
    n = len(run)
    for i in range(len(f.lower) - n + 1):
        if f.lower[i:i + n] == run:
            tokens = (*f.tokens[:at[i]], acronym.upper(), *f.tokens[at[i + n - 1] + 1:])
            return _facts(" ".join(tokens))
    return f


# Entities swapped within this many words of each other, in both texts, are a swap of roles
# ("from Spanish to English" / "from English into Spanish", "USD EUR" / "EUR USD"); farther
# apart, one moved with its phrase ("What did Obama say in Berlin?" / "In Berlin, what did
# Obama say?").
SWAP_GAP = 2


def _swapped(shared: list[tuple[Span, Span]]) -> bool:
    """Two of the items both texts have (each as (its span in q, its span in c)) stand within
    SWAP_GAP words of each other in both, in the other order in one than in the other.

    Only pairs that close in q are compared (walking the items in q's order), so a long text
    costs O(items), not O(items^2): every place of a number or entity is an item, and 4,000
    numbers in an 8 KB text took 0.6 s a check compared pair by pair."""
    order = sorted(range(len(shared)), key=lambda i: shared[i][0].first)
    for x, i in enumerate(order):
        reach = shared[i][0].last + SWAP_GAP  # no item starting past it is close in q
        for y in range(x + 1, len(order)):
            j = order[y]
            if shared[j][0].first > reach:
                break
            (qa, ca), (qb, cb) = shared[min(i, j)], shared[max(i, j)]
            if (qa.first < qb.first) == (ca.first < cb.first):
                continue
            gap_q = max(qa.first, qb.first) - min(qa.last, qb.last)
            gap_c = max(ca.first, cb.first) - min(ca.last, cb.last)
            if gap_q <= SWAP_GAP and gap_c <= SWAP_GAP:
                return True
    return False


def _paired(qi: dict[str, list[Span]], ci: dict[str, list[Span]]) -> list[tuple[Span, Span]]:
    """The places of each item both texts have, the k-th in one with the k-th in the other
    (as `_shared_sequences` pairs repeated words). An item's first place alone hid a swap
    after an earlier mention: "Was it 5 or 6? The date is 5/6/2020" / "... 6/5/2020" was
    served."""
    return [pair for k, qs in qi.items() if k in ci
            for pair in zip(qs, ci[k], strict=False)]


def _number_places(lower: tuple[str, ...]) -> tuple[dict[str, list[Span]], set[str]]:
    """Each number written in digits or as a cardinal word ("three" as "3"), at each of its
    places among the words; and the numbers written in digits. Digits stand as their value
    ("1,000" as "1000", "5.0" as "5", as rule 1 compares them; as written, "from 1,000 to 5" /
    "from 5 to 1000" was no swap)."""
    out: dict[str, list[Span]] = defaultdict(list)
    digits = set()
    for k, w in enumerate(lower):
        if w[0].isdigit():
            value = _number_value(w)
            key = w if value is None else _number_key(value)
            digits.add(key)
        elif w in _UNITS or w in _TENS:
            if k and _pronoun_one(w, lower[k - 1]):
                continue
            key = str(_UNITS.get(w, _TENS.get(w)))
        else:
            continue
        out[key].append(Span(key, k, k))
    return out, digits


def numbers_reordered(q: TextFacts, c: TextFacts) -> bool:
    """Two numbers both texts write in digits stand close together in both, in the other
    order in one ("on 5/6/2020" / "on 6/5/2020": the same numbers, 0.99 cosine). A number
    stands wherever it is written, in digits or in words: "three rooms (2-3 beds)" / "3 rooms
    (2-3 beds)" was refused, one text's first "3" paired with the other's second."""
    (qn, qd), (cn, cd) = _number_places(q.lower), _number_places(c.lower)
    both = qd & cd
    return _swapped(_paired({k: v for k, v in qn.items() if k in both}, cn))


# Words joining two phrases that may stand in either order ("the difference between X and
# Y", "X or Y?", "X vs Y"): exchanging them is no change of roles, as "from X to Y" is.
_COORDINATORS = frozenset({"and", "or", "vs", "versus"})
_SWAP_MAX_WORDS = 64


# Object pronouns as their subject form, for the order of shared words only: "she ignores
# him" / "he ignores her" are the same words swapped (0.978 cosine, served before as a strict
# hit), not four words of which two are shared.
_SUBJECT_CASE = {"me": "i", "him": "he", "her": "she", "us": "we", "them": "they",
                 "whom": "who"}


def _order_words(lower: tuple[str, ...]) -> tuple[str, ...]:
    """The words as the order check compares them: object pronouns as subjects, and plurals
    as their singular ("Can cats eat dog food?" / "Can dogs eat cat food?": the same words
    swapped, 0.985 cosine, a strict hit when "cats" and "cat" were two words)."""
    return tuple(_SUBJECT_CASE.get(w) or _singular(w) for w in lower)


def _singular(w: str) -> str:
    if len(w) > 3 and w.endswith("s") and not w.endswith(("ss", "us", "is", "'s")):
        return w[:-1]
    return w


# The phrases exchanged must be short noun phrases: one holding a word that gives a role
# ("dogs smarter than cats and birds" / "birds and dogs smarter than cats", "USD to EUR and
# GBP" / "GBP and USD to EUR", "add 5 and multiply by 3" / "multiply by 3 and add 5"), or
# another coordinator, changes who does what to whom when moved (a review's traps, each served
# as a strict hit by the first version of this rule).
_SWAP_MAX_PHRASE = 4
_ROLE_WORDS = frozenset("""than to from into onto by of for with without at on in over under
before after then per via as vs versus and or but""".split())


def coordination_swapped(q: tuple[str, ...], c: tuple[str, ...]) -> bool:
    """`q`'s words become `c`'s by exchanging the two short phrases (at most
    `_SWAP_MAX_PHRASE` words, none of `_ROLE_WORDS`) on either side of one coordinator
    ("between a virus and bacteria" / "between bacteria and a virus")."""
    n = len(q)
    if n != len(c) or n > _SWAP_MAX_WORDS or q == c or Counter(q) != Counter(c):
        return False
    i = next(k for k in range(n) if q[k] != c[k])
    j = next(k for k in range(n, 0, -1) if q[k - 1] != c[k - 1])
    for k in range(i, j):  # the coordinator stands where the texts differ
        if q[k] not in _COORDINATORS:
            continue
        for a in range(min(i, k - 1), max(-1, k - 1 - _SWAP_MAX_PHRASE), -1):
            if not _ROLE_WORDS.isdisjoint(q[a:k]):
                break  # longer phrases to the left hold it too
            for b in range(max(j, k + 2), min(n, k + 1 + _SWAP_MAX_PHRASE) + 1):
                if not _ROLE_WORDS.isdisjoint(q[k + 1:b]):
                    break
                if c[a:b] == (*q[k + 1:b], q[k], *q[a:k]):
                    return True
    return False


def entities_reordered(q: TextFacts, c: TextFacts) -> bool:
    """Two entities (or entity spans) both texts have stand close together in both, in the
    other order in one than in the other; each at every place it stands, the k-th paired with
    the k-th (the first place alone left "Why is USD strong? Will the USD EUR rate rise?" /
    "... the EUR USD rate rise?" served)."""
    def items(spans: tuple[Span, ...], other: tuple[Span, ...]) -> dict[str, list[Span]]:
        # A span the other text has too stands as one (as often as both have it); the others
        # as their words ("USD EUR" and "EUR USD" are the two words, swapped; so are "Stella
        # Gemmell" and "Gemmell Stella" after an earlier "Stella Gemmell" in both).
        shared = Counter(sp.key for sp in other)
        out: dict[str, list[Span]] = defaultdict(list)
        for sp in spans:
            if shared[sp.key] > 0:
                shared[sp.key] -= 1
                out[sp.key].append(sp)
                continue
            for k, word in enumerate(sp.key.split()):
                out[word].append(Span(word, sp.first + k, sp.first + k))
        return out

    return _swapped(_paired(items(q.spans, c.spans), items(c.spans, q.spans)))


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
    numbers: frozenset[tuple[str, int]]  # (number, how often)
    negations: int
    entities: frozenset[str]
    spans: tuple[Span, ...]  # entity words in a row, with their places (each occurrence)
    vocab: frozenset[str]  # lower_set and the numbers its words write ("third": "3rd" too)
    contrasts: frozenset[tuple[str, int]] = frozenset()  # (contrast word, how often)
    order: tuple[str, ...] = ()  # the words as the order check compares them (_order_words)
    comparatives: frozenset[tuple[str, int]] = frozenset()  # (adjective, +1 / -1) before "than"


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
    entities, spans = _entities(tokens)
    numbers = {n for n in map(_number, words) if n is not None}
    counted = _numbers(_number_words(tokens))
    return TextFacts(tuple(tokens), tuple(words), lower, frozenset(lower),
                     frozenset(counted.items()), _negations(words), frozenset(entities),
                     tuple(spans), frozenset(lower) | numbers, _contrast_words(lower),
                     _order_words(lower), _comparatives(lower))


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
        check_numbers, check_negation, check_entities, check_order, check_contrast: switch
            single checks.
    """

    def __init__(self, max_breakpoints: int = 3, *, check_numbers: bool = True,
                 check_negation: bool = True, check_entities: bool = True,
                 check_order: bool = True, check_contrast: bool = True) -> None:
        self.max_breakpoints = max_breakpoints
        self.checks = (check_numbers, check_negation, check_entities, check_order)
        self.check_contrast = check_contrast

    def check(self, query: str, cached: str) -> GuardResult:
        """GuardResult(True, "") if `cached` may answer `query`."""
        return self.check_facts(text_facts(query), text_facts(cached))[0]

    def check_facts(self, q: TextFacts, c: TextFacts) -> tuple[GuardResult, int | None]:
        """The verdict on two analysed texts, and the breakpoints of `c`'s shared words in `q`
        when the order check got that far (None otherwise)."""
        numbers, negation, entities, order = self.checks
        if numbers and not numbers_agree(q, c):
            diff = sorted({n for n, _ in q.numbers ^ c.numbers})
            return GuardResult(False, f"numbers differ: {', '.join(diff[:4])}"), None
        lq, lc = q.lower_set, c.lower_set
        if negation and not (q.negations != c.negations and negated_alike(q, c)):
            if q.negations != c.negations:
                return GuardResult(False, "negation differs"), None
            opposite = _opposite(lq, lc)
            if opposite:
                return GuardResult(False, f"opposite words: {opposite}"), None
        if self.check_contrast:
            words = contrast(q, c)
            if words:
                return GuardResult(False, f"contrasting words: {words}"), None
        if entities:
            missing = sorted(entities_missing(q, c))
            if missing:
                return GuardResult(False, f"entities differ: {', '.join(missing[:4])}"), None
        if order:
            # An acronym and its spelled-out words are one item where they stand ("from US
            # to UK" / "from United Kingdom to United States" was served: no shared entity).
            q, c = acronyms_folded(q, c)
            why = ("entities in another order" if entities_reordered(q, c)
                   else "numbers in another order" if numbers_reordered(q, c) else "")
            bp = None if why else _breakpoints_lower(c.order, q.order)
            if bp is not None and bp > self.max_breakpoints:
                why = f"word order differs ({bp} breakpoints)"
            if why:
                if coordination_swapped(q.lower, c.lower):
                    # The same words, two phrases around "and" / "or" exchanged: in the order
                    # the other text has them, nothing is out of place.
                    return GuardResult(True, ""), 0
                return GuardResult(False, why), bp
            return GuardResult(True, ""), bp
        return GuardResult(True, ""), None


# ---- what an uncased embedder cannot see --------------------------------------------------

_UWORD = re.compile(r"\w+")


def _fold(word: str) -> str:
    """`word` as an uncased embedder reads it: lowercased, accents dropped."""
    return _unaccented(word).lower()


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


# Scripts whose accents users drop as a typo ("Pokemon" / "Pokémon"). Elsewhere a mark
# the embedder strips (category Mn) makes another letter or word: kana voicing (バス "bus" /
# ハス "lotus"), Devanagari nukta, Thai tone marks, Arabic and Hebrew vowel points.
_TYPO_ACCENT_SCRIPTS = ("LATIN", "GREEK", "CYRILLIC")


def _letter_marks(word: str) -> str:
    """`word` lowercased, with marks dropped only from Latin, Greek and Cyrillic letters."""
    if word.isascii():
        return word.lower()
    out: list[str] = []
    drop = False
    for c in unicodedata.normalize("NFD", word):
        if unicodedata.category(c) == "Mn":
            if not drop:
                out.append(c)
        else:
            drop = unicodedata.name(c, "").startswith(_TYPO_ACCENT_SCRIPTS)
            out.append(c)
    return unicodedata.normalize("NFC", "".join(out)).lower()


# Quoted or backticked spans: what is between the quotes is a literal, its spacing included.
_QUOTED = re.compile(r"`[^`]*`|\"[^\"\n]*\"|\u201c[^\u201d]*\u201d|(?<!\w)'[^'\n]*'(?!\w)")
# A line of code: an assignment at its start ("x = 1", "a[i] += 2"), or a statement's end or a
# brace at its end. Text with two such lines is laid out as code: its line breaks are part of
# what it says. (One "=" or ";" in a sentence, or an indented line, is prose as often.)
_CODE_LINE = re.compile(r"^[ \t]*(?:[\w.\[\]]+[ \t]*[-+*/%]?=(?!=)|.*[;{}][ \t]*$)",
                        re.MULTILINE)


def _laid_out_as_code(text: str) -> bool:
    return len(_CODE_LINE.findall(text)) >= 2


def _marked_words(text: str) -> list[str]:
    """The words of `text`, marks included: a regex word leaves out combining marks (Mn, Mc),
    so a Devanagari word fell apart at its nukta or vowel sign and the mark went unseen."""
    if text.isascii():
        return _UWORD.findall(text)
    words: list[str] = []
    cur: list[str] = []
    for c in text:
        if c.isalnum() or c == "_" or (cur and unicodedata.category(c)[0] == "M"):
            cur.append(c)
        elif cur:
            words.append("".join(cur))
            cur = []
    if cur:
        words.append("".join(cur))
    return words


def spelling_differs(query: str, cached: str, case_and_accents: bool = True) -> str:
    """Why `cached` must not answer `query` although an uncased embedder (all-MiniLM-L6-v2
    lowercases and strips accents; whitespace is only a separator) sees one text twice ("" =
    no such difference). Served at similarity 1.0 before: "What is CO?" got "Co"'s answer,
    "salé" got "sale"'s, and two code snippets that differ only in indentation shared an
    answer.

    Refused: for texts equal up to whitespace, a different indentation, other spacing inside
    quotes or backticks ("the string 'a    b'" / "'a b'"), or other line breaks in text laid
    out as code; in every tier, a mark that makes another letter outside Latin, Greek and
    Cyrillic script (バス / ハス); with `case_and_accents`, also a word spelt in the other text
    with other case (beyond its first letter) or other accents ("ls -A" / "ls -a" aside: one
    letter, as a sentence's first word differs). The cache asks for that in its strict tier
    only: in users' questions such differences are nearly always the same word typed
    otherwise ("gta" / "GTA", "Pokemon" / "Pokémon": 279 QQP pairs, none of the refused hits a
    false one), while where a wrong answer is dear "CO" is not "Co" and "mg" is not "Mg".
    """
    if query == cached:
        return ""
    if not (query.isascii() and cached.isascii()):
        # Composed alike: "café" typed decomposed (macOS) is the same word, and a mark alone
        # is no \w, so it would split the word in two.
        query, cached = (unicodedata.normalize("NFC", query),
                         unicodedata.normalize("NFC", cached))
    qw, cw = _marked_words(query), _marked_words(cached)
    for words, other in ((qw, cw), (cw, qw)):
        forms: dict[str, set[str]] = defaultdict(set)
        for w in other:
            forms[_fold(w)].add(w)
        for w in words:
            seen = forms.get(_fold(w))
            if not seen or w in seen:
                continue
            if case_and_accents and not any(_initial_case_only(w, o) for o in seen):
                return f"spelling differs: {w!r} / {sorted(seen)[0]!r} (case or accents)"
            marks = _letter_marks(w)
            if all(_letter_marks(o) != marks for o in seen):
                return (f"spelling differs: {w!r} / {sorted(seen)[0]!r} (a mark that makes "
                        "another letter)")
    if qw == cw and " ".join(query.split()) == " ".join(cached.split()):
        # Only lines laid out alike can differ in indentation: the same sentence wrapped
        # otherwise, or with a leading space, is the same text.
        ql, cl = _layout(query), _layout(cached)
        if len(ql) == len(cl) >= 2 and ql != cl:
            return "indentation differs"
        if _QUOTED.findall(query) != _QUOTED.findall(cached):
            return "spacing inside quotes differs"
        if len(ql) != len(cl) and (_laid_out_as_code(query) or _laid_out_as_code(cached)):
            return "line breaks differ in code"
    return ""
