"""Guard rules a mutation audit of services/semantic/guard.py found unguarded: concrete sentence
pairs the guard must refuse or pass, each tied to the rule (module docstring, a function's
docstring or the comment at the code) that says so; the switches of single checks; what
`check_facts` and `breakpoints` report to the verifier; the facts cache's length limit; and
`spelling_differs` on decomposed accents, a first letter's case and one line that looks like
code."""

from __future__ import annotations

import pytest

from services.semantic.guard import (
    ParaphraseGuard,
    breakpoints,
    cached_while_short,
    spelling_differs,
    text_facts,
)


def _refused(query: str, cached: str, check: str) -> None:
    g = ParaphraseGuard()
    for q, c in ((query, cached), (cached, query)):  # the guard is symmetric
        res = g.check(q, c)
        assert not res.ok, (q, c)
        assert check in res.reason, res.reason


def _passed(query: str, cached: str) -> None:
    g = ParaphraseGuard()
    for q, c in ((query, cached), (cached, query)):
        res = g.check(q, c)
        assert res.ok, (q, c, res.reason)


# ---- 1. numbers ------------------------------------------------------------------------------

@pytest.mark.parametrize(("query", "cached"), [
    # "IV" is never read as 4: it is "intravenous" as often.
    ("Can I take Tylenol IV at home?", "Can I take Tylenol 4 at home?"),
    # Only after a capitalised word: "XX chromosomes" is no 20 ...
    ("Does a woman have XX chromosomes?", "Does a woman have 20 chromosomes?"),
    # ... and a text's first word has no word before it (not the text's last one).
    ("XX chromosomes in Women", "20 chromosomes in Women"),
])
def test_roman_numerals_are_numbers_only_after_a_capitalised_word(query, cached):
    """_roman: a Roman numeral after a capitalised word ("Henry VIII") is that number, not
    "IV"; elsewhere the letters are no number (here they leave the other text's 20 unmatched)."""
    _refused(query, cached, "numbers differ")


def test_zero_before_a_scale_is_zero():
    """_numbers: "0 billion" is 0, not the 1 billion a scale alone ("a billion") counts."""
    _refused("Did the fund lose 0 billion dollars?", "Did the fund lose 1 billion dollars?",
             "numbers differ")
    _refused("Is zero hundred hours midnight?", "Is one hundred hours midnight?",
             "numbers differ")


@pytest.mark.parametrize(("query", "cached"), [
    ("Is a hundred dollars enough for a week in Rome?",
     "Is 100 dollars enough for a week in Rome?"),
    ("Is two thousand calories a day enough?", "Is 2000 calories a day enough?"),
    ("Is two hundred thousand dollars a good salary?", "Is 200,000 dollars a good salary?"),
    # "and" joins a number's words only after a scale ("two hundred and fifty"): five and six
    # are two numbers, not 11.
    ("Should kids aged five and six share a room?", "Should kids aged 5 and 6 share a room?"),
])
def test_cardinal_number_words_make_one_number(query, cached):
    """_numbers: cardinal number words in a row make one number ("a million" and "1 million"
    are 1000000, "two hundred and fifty" 250)."""
    _passed(query, cached)


@pytest.mark.parametrize(("query", "cached"), [
    ("Who was the 1,000th visitor?", "Who was the 1000th visitor?"),  # _number: one form
    ("Is a 3 per cent raise normal?", "Is a 3% raise normal?"),
    ("Is $5m a lot for a house?", "Is 5 million dollars a lot for a house?"),  # not "5 m"
])
def test_a_number_and_its_unit_in_another_spelling_agree(query, cached):
    """Rule 1: units "each spelling as one"; a number in one form ("1,000th" is "1000th");
    a scale letter after a currency amount is the scale word ("$5m": 5 million usd)."""
    _passed(query, cached)


@pytest.mark.parametrize(("query", "cached"), [
    # "1,5" is 1.5 in much of Europe, "2,3" a list: neither is 15 or 23 (both were served).
    ("Is 1,5 liters of water a day enough?", "Is 15 liters of water a day enough?"),
    ("Should I pick rows 2,3 of the table?", "Should I pick rows 23 of the table?"),
    ("Is 1,50 euros a fair tip?", "Is 150 euros a fair tip?"),
    # ... and such a number keeps its unit ("1,5 kg" is no "1,5 liters").
    ("Is 1,5 liters a lot?", "Is 1,5 kg a lot?"),
])
def test_a_comma_that_separates_no_thousands_makes_no_other_number(query, cached):
    """_numbers: a number's digits "with decimal or thousands separators"; a comma separates
    thousands only before a group of three digits ("1,000", "12,34,567"), elsewhere the number
    is compared as written."""
    _refused(query, cached, "numbers differ")


def test_a_number_written_with_commas_or_as_written_agrees_with_itself():
    _passed("Is 1,5 liters of water a day enough?", "Is 1,5 liters of water a day enough")
    _passed("Is 12,34,567 rupees a lot?", "Is 1234567 rupees a lot?")
    _passed("Is 1,234.50 dollars a lot?", "Is 1234.5 dollars a lot?")


# ---- 2. negation -----------------------------------------------------------------------------

def test_a_capitalised_negation_counts():
    """Rule 2: the texts have a different number of negations; "Never" is "never"."""
    _refused("Never store bread in the fridge?", "Store bread in the fridge?", "negation")


@pytest.mark.parametrize(("query", "cached"), [
    # Rule 2: a word the other text has "only with a negating prefix"; the first text has
    # the word itself as well.
    ("Is it legal or illegal to record a phone call?", "Is it legal to record a phone call?"),
    ("Are bats harmful or harmless?", "Are bats harmful?"),
])
def test_an_opposite_that_the_text_also_has_plain_is_no_opposite(query, cached):
    """_prefixed / _opposite: a prefixed (or "-less") word counts only where its plain word is
    absent from its own text."""
    _passed(query, cached)


def test_not_and_a_prefix_agree_only_when_the_other_text_has_no_prefixed_opposite():
    """negated_alike: "not possible" is "impossible" when the text with fewer negations has
    as many more prefixed opposites "and the other none": here "unsafe" / "safe" differ too."""
    _refused("Is it not possible to swim when the sea is unsafe?",
             "Is it impossible to swim when the sea is safe?", "negation")


def test_a_less_word_against_its_bare_stem_is_an_opposite():
    """_opposite: "-less" against the stem itself ("sugarless" / "sugar"), not only "-ful",
    "-ous" or "-y"."""
    _refused("Is sugarless gum bad for your teeth?", "Is sugar gum bad for your teeth?",
             "opposite")


@pytest.mark.parametrize(("query", "refused"), [
    ("Why don\u2019t cats like water?", True),  # a right quote as the apostrophe
    ("Why don\u2019t cats like water?", False),
])
def test_a_right_quote_is_an_apostrophe(query, refused):
    """_APOSTROPHES: "right and left quotes" are apostrophes, so "don’t" is a negation (the
    most common way phones type it)."""
    if refused:
        _refused(query, "Why do cats like water?", "negation")
    else:
        _passed(query, "Why don't cats like water?")


# ---- 4. contrast -----------------------------------------------------------------------------

def test_this_past_is_last_and_contrasts_with_this():
    """_contrast_words: "this past weekend" is "last weekend" (the "this" no longer counts), so
    it contrasts with "this" as "last month" / "this month" do."""
    _refused("What movies came out this past month?", "What movies came out this month?",
             "contrasting")


def test_a_comparison_the_same_way_with_another_form_is_not_reversed():
    """_comparison_reversed: an adjective compared "one way in one text and the other way in
    the other"; "healthier than" / "more healthful than" are both one way."""
    _passed("Is tea healthier than coffee?", "Is tea more healthful than coffee?")


def test_a_comparison_at_the_texts_start_is_read():
    """_comparatives: each comparison before "than", also one whose adjective is the first
    word."""
    _refused("Healthier than butter: is margarine?", "Less healthy than butter: is margarine?",
             "contrasting")


def test_a_contrast_word_only_one_text_adds_is_no_contrast():
    """contrast: refused where one text has more of one word of a group and the other more of
    another; both have "day" as often, only one adds "week"."""
    _passed("Is it OK to eat eggs every day?", "Is it OK to eat eggs every day of the week?")


# ---- 3. entities -----------------------------------------------------------------------------

@pytest.mark.parametrize(("query", "cached"), [
    ("Is the U.S.A. bigger than China?", "Is the USA bigger than China?"),  # dotted acronym
    # A capital after a colon starts a sentence: "Should" is no name.
    ("Quick question: Should dogs eat grapes?", "Is it OK for dogs to eat grapes?"),
    # An acronym of 5 letters and its words.
    ("How hard is the IELTS exam?",
     "How hard is the International English Language Testing System exam?"),
])
def test_entities_written_otherwise_agree(query, cached):
    """Rule 3 (a capitalised word that is not sentence-initial, an acronym): "U.S.A." is the
    acronym "USA"; an acronym of 2-5 letters agrees with the words that spell it."""
    _passed(query, cached)


@pytest.mark.parametrize(("query", "cached"), [
    ("How do I create an instance on AWS?", "How do I create AI on AWS?"),  # "an" skipped
    # Words the acronym's own text has do not spell it.
    ("Is AI the same as artificial intelligence?",
     "Is artificial intelligence the same as artificial intelligence?"),
])
def test_words_that_do_not_spell_an_acronym(query, cached):
    """_spelled_out: the words spelling an acronym are none of the acronym's text nor a word
    acronyms skip ("an instance" is no "AI")."""
    _refused(query, cached, "entities differ")


# ---- 5. order --------------------------------------------------------------------------------

@pytest.mark.parametrize(("query", "cached"), [
    # A phrase of five words, holding the verb: roles change ("brother called Anna and Bob" /
    # "Bob and brother called Anna").
    ("Did my older brother call Anna and Bob?", "Did Bob and my older brother call Anna?"),
    # Words exchanged across "and", not the two phrases.
    ("Is red wine and white meat healthy?", "Is white wine and red meat healthy?"),
])
def test_only_two_short_phrases_exchanged_around_and_are_let_through(query, cached):
    """coordination_swapped: the two phrases (at most `_SWAP_MAX_PHRASE` = 4 words each) on
    either side of one coordinator exchanged, nothing else."""
    _refused(query, cached, "order")


def test_a_phrase_of_four_words_may_be_exchanged():
    """coordination_swapped: phrases of up to `_SWAP_MAX_PHRASE` (4) words."""
    _passed("Which is better, a used Toyota Corolla or a Honda?",
            "Which is better, a Honda or a used Toyota Corolla?")


def test_a_number_stands_where_it_is_written_in_digits_or_in_words():
    """numbers_reordered: "three" is the number 3 where it stands, so the other text's "3"
    there is not paired with this text's later "3" (a metamorphic test's find: writing a
    number in digits, which rule 1 says changes nothing, made a swap out of "2-3")."""
    _passed("Do I need three rooms (2-3 beds each)?", "Do I need 3 rooms (2-3 beds each)?")


def test_numbers_swapped_after_an_earlier_mention_are_refused():
    """numbers_reordered: the k-th place of a number pairs with the k-th in the other text;
    the first alone left "5/6" / "6/5" after an earlier "5 or 6" unseen (3 breakpoints: one
    block move)."""
    _refused("Was it 5 or 6? The date is 5/6/2020", "Was it 5 or 6? The date is 6/5/2020",
             "numbers in another order")


@pytest.mark.parametrize(("query", "cached"), [
    ("Convert from 1,000 to 5 units", "Convert from 5 to 1000 units"),
    ("Is the range 5.0 to 10 or wider?", "Is the range 10 to 5 or wider?"),
    ("Please sort 300 12 now", "Please sort 12.00 300 now"),
])
def test_numbers_swapped_in_another_digit_form_are_refused(query, cached):
    """numbers_reordered: a number stands where it is written whatever its digits' form (rule 1
    compares values: "1,000" is 1000, "5.0" is 5); its places were keyed as written, so the
    swap went unseen and one block move's 3 breakpoints let it through."""
    _refused(query, cached, "order")


def test_entities_swapped_after_an_earlier_mention_are_refused():
    """entities_reordered: an entity's k-th place pairs with the k-th in the other text; its
    first place alone left the adjacent swap unseen ("USD EUR" / "EUR USD": 3 breakpoints,
    one block move)."""
    _refused("Why is USD strong? Will the USD EUR rate rise?",
             "Why is USD strong? Will the EUR USD rate rise?", "entities in another order")


def test_a_span_both_texts_have_stands_as_one_only_as_often_as_both_have_it():
    """entities_reordered: "USD EUR" twice in one text and once in the other stands as one
    item once; the other "USD EUR" is its two words, swapped in "EUR USD" (every occurrence
    of a span both have stood as one, and the swap went unseen)."""
    _refused("Is the USD EUR pair up? Will the USD EUR rate fall?",
             "Is the USD EUR pair up? Will the EUR USD rate fall?", "entities in another order")


def test_breakpoints_of_two_words_and_of_repeats():
    """breakpoints: adjacencies of shared words in `a`, with the sentinels, that `b` breaks
    (two words exchanged break all 3); the k-th repeat pairs with the k-th in the other text,
    a repeat the other lacks is no shared word."""
    assert breakpoints(["a", "b"], ["b", "a"]) == 3
    assert breakpoints(["a", "b", "a"], ["a", "b"]) == 0
    assert breakpoints(["a", "b"], ["a", "b", "a"]) == 0


def test_check_facts_reports_the_breakpoints_the_order_check_saw():
    """check_facts: the breakpoints of `c`'s shared words in `q` when the order check got that
    far; two phrases exchanged around "and" are in the other text's order: 0."""
    g = ParaphraseGuard()
    swap = ("What is the difference between a crocodile and an alligator?",
            "What is the difference between an alligator and a crocodile?")
    assert g.check_facts(text_facts(swap[0]), text_facts(swap[1])) == ((True, ""), 0)
    q, c = "Does the dog chase the cat?", "Does the cat chase the dog?"
    verdict, bp = g.check_facts(text_facts(q), text_facts(c))
    assert not verdict.ok and "word order" in verdict.reason
    assert bp == breakpoints(list(text_facts(c).words), list(text_facts(q).words)) == 4


# ---- the switches --------------------------------------------------------------------------

def test_each_switch_turns_off_its_own_check_only():
    """ParaphraseGuard's check_numbers, check_negation, check_contrast switch single checks."""
    numbers = ("How do I lose 10 kg in a month?", "How do I lose 15 kg in a month?")
    negation = ("Why can't I sleep at night?", "Why can I sleep at night?")
    contrast = ("Do all employees get a bonus?", "Do some employees get a bonus?")
    no_numbers = ParaphraseGuard(check_numbers=False)
    assert no_numbers.check(*numbers).ok
    assert not no_numbers.check(*negation).ok
    no_negation = ParaphraseGuard(check_negation=False)
    assert no_negation.check(*negation).ok
    assert not no_negation.check(*numbers).ok
    no_contrast = ParaphraseGuard(check_contrast=False)
    assert no_contrast.check(*contrast).ok
    assert not no_contrast.check(*numbers).ok


# ---- the facts cache -------------------------------------------------------------------------

def test_only_short_texts_are_cached():
    """cached_while_short: texts of up to 256 characters are analysed once, longer ones every
    time."""
    calls: list[str] = []

    def analyse(text: str) -> int:
        calls.append(text)
        return len(text)

    get = cached_while_short(analyse)
    short, long_ = "x" * 256, "y" * 257
    assert [get(short), get(short), get(long_), get(long_)] == [256, 256, 257, 257]
    assert calls == [short, long_, long_]


# ---- spelling_differs ------------------------------------------------------------------------

@pytest.mark.parametrize(("a", "b"), [
    # "café" typed decomposed (macOS) is the same word, in the strict tier too.
    ("Is it cafe\u0301 au lait?", "Is it caf\u00e9 au lait?"),
    # A first letter's case is no difference, though the other text also has the word in
    # capitals elsewhere.
    ("What does WHAT stand for?", "what does WHAT stand for?"),
    # One line that looks like code is prose: its line break is no difference.
    ("If I write\nx = 5, what is x squared?", "If I write x = 5, what is x squared?"),
])
def test_spelling_differs_not(a, b):
    """spelling_differs: refused for other case beyond the first letter, other accents, or
    (text laid out as code: two such lines) other line breaks; none of those here."""
    for x, y in ((a, b), (b, a)):
        assert spelling_differs(x, y) == ""
        assert spelling_differs(x, y, case_and_accents=False) == ""


# ---- the defect the audit found ------------------------------------------------------------

@pytest.mark.parametrize(("query", "cached"), [
    ("Is 5 million USD a lot for a house?", "Is $5 million a lot for a house?"),
    ("Is 40k USD a good salary?", "Is $40k a good salary?"),
    ("Is twenty USD enough for lunch?", "Is $20 enough for lunch?"),
    ("Is two GB of RAM enough?", "Is 2 gigabytes of RAM enough?"),
    ("Is -10 C cold for a dog?", "Is -10 degrees Celsius cold for a dog?"),
])
def test_a_unit_after_any_number_is_the_numbers_not_an_entity(query, cached):
    """_entities: "A unit after its number ("500 MB", "20 USD") is the number's, compared with it
    in any spelling", and a number is digits, signed, or number words (rule 1), a scale word
    included. Only a number starting with a digit was read so: "5 million USD" / "$5 million"
    was refused, "USD" an entity the other text lacked (as was "-10 C" / "-10 degrees
    Celsius")."""
    _passed(query, cached)


@pytest.mark.parametrize(("query", "cached", "check"), [
    ("Is 5 million USD a lot for a house?", "Is 5 million EUR a lot for a house?", "numbers"),
    ("Is twenty USD enough for lunch?", "Is twenty GBP enough for lunch?", "numbers"),
    ("Is -10 C cold for a dog?", "Is -10 F cold for a dog?", "numbers"),
    # "one" after "which" is no number (_numbers skips it): what follows stays an entity.
    ("Which one GB card should I buy?", "Which one TB card should I buy?", "entities"),
    # "k" is a thousand only after digits ("40k"): after "fifty" it holds no unit.
    ("Is fifty k USD a good salary?", "Is fifty k EUR a good salary?", "entities"),
])
def test_that_unit_is_compared_with_its_number(query, cached, check):
    """Rule 1: the units written after the numbers differ; the unit the entity check leaves out
    is compared by the number check, so only a unit `_numbers` reads with its number is left
    out."""
    _refused(query, cached, f"{check} differ")


@pytest.mark.parametrize(("query", "cached"), [
    ("Are five MS patients enough for a trial?", "Are five patients enough for a trial?"),
    ("Are 5 MS patients enough for a trial?", "Are 5 patients enough for a trial?"),
    ("Why did two SEC filings get delayed?", "Why did two filings get delayed?"),
    ("I have ten H bombs", "I have ten bombs"),
    ("Is the one Year plan good?", "Is the one plan good?"),
])
def test_a_capitalised_unit_a_bare_number_matches_is_also_a_name(query, cached):
    """A unit after its number is the number's, but one a bare number agrees with ("3" / "3
    years", numbers_agree) and written with a capital is also an entity the other text must
    have: else "five MS patients" / "five patients" passed both checks (the review of the
    number-word unit fix)."""
    _refused(query, cached, "entities differ")


@pytest.mark.parametrize(("query", "cached"), [
    ("Is it true that no, one GB is enough?", "Is it true that no, one is enough?"),
    ("Which, one GB or two?", "Which, one or two?"),
])
def test_a_unit_after_a_pronoun_one_behind_a_comma_is_an_entity(query, cached):
    """The entity check reads the word before a unit as the number rule does, punctuation
    skipped: "no, one GB" has no number ("no one"), so GB is no number's unit but a name the
    other text lacks."""
    _refused(query, cached, "entities differ")


@pytest.mark.parametrize(("query", "cached"), [
    ("Is 5 Years enough to learn the piano?", "Is 5 years enough to learn the piano?"),
    ("Is one Day enough to see Rome?", "Is 1 day enough to see Rome?"),
])
def test_a_capitalised_unit_the_other_text_also_writes_passes(query, cached):
    """The capitalised unit is an entity only the other text's words must hold: written there
    in lower case, the pair passes."""
    _passed(query, cached)


def test_the_swap_check_of_a_long_text_compares_only_close_places() -> None:
    """Every place of a number or entity is an item of the swap check (the k-th paired with
    the k-th): comparing every two items made an 8 KB text of 4,000 numbers cost 0.6 s a
    check, where its analysis costs 35 ms. Only items within SWAP_GAP words in the query can
    be a swap; the check must stay linear in the items (counted as reads of their places, not
    timed: every pair compared reads at least two). The swap itself is still found."""
    from services.semantic.guard import SWAP_GAP, Span, _swapped

    reads = [0]

    class Counted(Span):
        @property
        def first(self) -> int:  # type: ignore[override]
            reads[0] += 1
            return tuple.__getitem__(self, 1)

    n = 2000
    far = [(Counted("a", k, k), Counted("a", k, k)) for k in range(0, n * (SWAP_GAP + 1),
                                                                   SWAP_GAP + 1)]
    assert not _swapped(far)
    assert reads[0] < 20 * n  # pair by pair: about n * n reads
    end = far[-1][0][2]  # the last item's place: one word after it in q, one before in c
    assert _swapped(far + [(Span("x", end + 1, end + 1), Span("x", end - 1, end - 1))])
    body = " ".join("1 2" for _ in range(2000))
    q, c = text_facts("values " + body + " a"), text_facts("values " + body + " b")
    assert ParaphraseGuard().check_facts(q, c)[0].ok


def test_the_guard_runs_in_strict_and_standard_by_default_and_not_in_relaxed(cache_factory):
    """docs/architecture.md step 3: a hit needs the guard only in the guarded tiers (strict and
    standard by default); the relaxed tier serves a negated question at the same similarity.
    (The doc once said every hit needed the guard's agreement.)"""
    from services.semantic.config import SemanticConfig
    from tests.semantic.test_cache_edges import A, FixedEmbedder

    emb = FixedEmbedder()
    emb.at("Is it safe to take aspirin while pregnant?", 1.0, 1)
    emb.at("Is it not safe to take aspirin while pregnant?", 1.0, 1)
    assert SemanticConfig().guard_tiers == ("strict", "standard")
    c = cache_factory(emb, verifier_tiers=())
    c.store_entry(A, "Is it safe to take aspirin while pregnant?", "Ask your doctor.")
    negated = "Is it not safe to take aspirin while pregnant?"
    for tier in ("strict", "standard"):
        r = c.lookup(A, negated, tier=tier)
        assert not r.hit and r.guard_rejected and "negation" in r.guard_reason
    assert c.lookup(A, negated, tier="relaxed").hit
