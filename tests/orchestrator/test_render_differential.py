"""A differential review of PromptRenderer (render_chat, render_raw, render_warm and its piece
cache) against the library itself: the real SmolLM2 tokenizer and its chat template.

The reference: `tok.apply_chat_template(..., tokenize=False, add_generation_prompt=True)` then
`tok.encode(text, add_special_tokens=False)`; for a raw prompt `tok.encode(prompt, ...)`. Where a
message holds a control token's text ("<|im_end|>"), the documented rule (architecture.md, step
2; `encode_messages`) is that it stays plain text: the model splits the library's text at the
added tokens itself, tokenizes each piece alone with the library, keeps the template's control
tokens and spells each typed one with the library's `split_special_tokens=True` (the message
spans come from the SmolLM2 template rebuilt by hand, checked equal to the library's text).
Validation is modelled from the docs (the first bad field, role before content, named
`messages[2].role` style), the piece cache as the docs give it: pieces of 512 characters or
more between control tokens, per tenant, least recently used out past the byte budget, never
one over a quarter of it or longer than a prompt may be; hits, misses, keys in LRU order,
kept ids and bytes compared after every request. The context hash must be equal exactly when
the earlier turns and who said them are (not the last message, not the tenant); raw prompts
share one exactly when their edge whitespace does, and never one with a chat.

Requests are seeded random: 0-13 messages, legal and illegal roles in any order, system or
not, contents built from fragments that stress piece boundaries (edge spaces, tabs, CRLF,
digit runs, CJK, emoji and ZWJ, combining marks, RTL, control texts whole and partial,
private-use U+E000/U+E001 and slot-like "\\ue0003\\ue001", empty and over-long), long texts
around the 512-character threshold repeated across requests, conversations that grow turn by
turn (cache hits) or come back with one earlier speaker or the last message changed (the
hash), budgets of a few pieces (evictions), limits on a prompt's tokens, three tenants, raw
prompts (rendered conversations typed raw among them) and warm prefixes. A second test
renders from four threads through one small cache and balances its books at the end.

Run by hand: 3,000 seeds x 40 requests (120,000) three times as the generator grew, the last
with it as here. Found one defect: a message holding a slot-like text beside a control text
was refused, naming `messages` (fixed in render.py; test_render_detok.py guards it); nothing
else diverged. Mutants, failing seeds of 300 (wrong ids alone in brackets): a piece keyed
without its trailing whitespace 107 (45), a key without the tenant 127, a message span one
character late 116 (116), most recently used out 41, a hit not refreshing recency 85, a
context hash without roles 247, raw edges without the trailing whitespace 257, the
512-character threshold off by one 181; this bounded version fails under each.
ORCH_RENDER_DIFFERENTIAL_SEEDS=N (default 24, ~3 s) runs more:
`ORCH_RENDER_DIFFERENTIAL_SEEDS=3000 pytest tests/orchestrator/test_render_differential.py`.
"""

from __future__ import annotations

import os
import random
import sys
import threading
from collections import OrderedDict

import pytest

from services.common.errors import InvalidArgument
from services.orchestrator import render
from services.orchestrator.render import Message, PromptRenderer
from tests.blank_text import blank

pytestmark = pytest.mark.model  # the real SmolLM2 tokenizer

SEEDS = int(os.environ.get("ORCH_RENDER_DIFFERENTIAL_SEEDS", "24"))
STEPS = 40
ROLES = ("system", "user", "assistant")
BAD_ROLES = ("wizard", "", "User", "tool", " user")
DEFAULT_SYSTEM = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained "
                  "by Hugging Face<|im_end|>\n")
MIN_CHARS = 512

FRAGMENTS = (
    "hello", " world", "Hi", "'s", "'ll", " ", "  ", "\t", "\n", "\n\n", "\r\n", "\r",
    "12345", "007", "3.14", "1,000,000", "中文字", "日本語も", "한국어", "🚀", "👨\u200d👩\u200d👧",
    "e\u0301", "\u0308", "שלום", "مرحبا", "\u200f", "\u202e", "\u00a0", "\u2028", "\x0b",
    "\x0c", "\x85", "\x00", "<|im_start|>", "<|im_end|>", "<|im_", "im_end|>", "<|", "|>",
    "<|endoftext|>", "<filename>", "<repo_name>", "<reponame", "\ue000", "\ue001",
    "\ue0000\ue001", "\ue0003\ue001", "\ue00012\ue001", "\ue000x\ue001", "Ġ", "ĊĊ", "<s>",
    "system\n", "user\n", "assistant\n",
)
PLAIN = tuple(f for f in FRAGMENTS if "<" not in f and not {"\ue000", "\ue001"} & set(f))


class Refused(Exception):
    def __init__(self, field: str) -> None:
        super().__init__(field)
        self.field = field


def _added(tok) -> dict[str, int]:
    return {t.content: i for i, t in tok.added_tokens_decoder.items()}


def split_at_added(text: str, added: dict[str, int]) -> list[tuple[int, int, int | None]]:
    """(start, end, id or None) pieces: leftmost-longest added tokens, plain text between."""
    out, at, i = [], 0, 0
    texts = sorted(added, key=len, reverse=True)
    while i < len(text):
        hit = next((t for t in texts if text.startswith(t, i)), None)
        if hit is None:
            i += 1
            continue
        if at < i:
            out.append((at, i, None))
        out.append((i, i + len(hit), added[hit]))
        i = at = i + len(hit)
    if at < len(text):
        out.append((at, len(text), None))
    return out


class Reference:
    def __init__(self, tok, max_chars: int, max_prompt_tokens: int | None, budget: int) -> None:
        self.tok, self.max_chars, self.mpt, self.budget = tok, max_chars, max_prompt_tokens, budget
        self.added = _added(tok)
        self.controls = set(self.added) | set(tok.all_special_tokens)
        self.pieces: OrderedDict[tuple[str, str], list[int]] = OrderedDict()
        self.bytes = self.hits = self.misses = 0

    def enc(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False)) if text else []

    # ---- validation (architecture.md step 2; render.py's module doc) -------------------
    def check(self, msgs, field: str, last_user: bool) -> None:
        if not msgs:
            raise Refused(field)
        for i, m in enumerate(msgs):
            if m.role not in ROLES:
                raise Refused(f"{field}[{i}].role")
            if blank(m.content) or len(m.content) > self.max_chars:
                raise Refused(f"{field}[{i}].content")
        if last_user and msgs[-1].role != "user":
            raise Refused(f"{field}[{len(msgs) - 1}].role")

    # ---- the template, by hand, with where each message lies ---------------------------
    def template(self, msgs, gen: bool) -> tuple[str, list[tuple[int, int]]]:
        text, spans = "" if msgs[0].role == "system" else DEFAULT_SYSTEM, []
        for m in msgs:
            text += f"<|im_start|>{m.role}\n"
            spans.append((len(text), len(text) + len(m.content)))
            text += m.content + "<|im_end|>\n"
        text += "<|im_start|>assistant\n" if gen else ""
        lib = self.tok.apply_chat_template([{"role": m.role, "content": m.content} for m in msgs],
                                           tokenize=False, add_generation_prompt=gen)
        assert lib == text, "the hand-made template is not the library's"
        return text, spans

    def lookup_pieces(self, text: str, scope: str) -> None:
        """The cache's documented bookkeeping for one prompt tokenized through it."""
        if len(text) < MIN_CHARS:
            return
        for a, b, tid in split_at_added(text, self.added):
            piece = text[a:b]
            if tid is not None or len(piece) < MIN_CHARS:
                continue
            key = (scope, piece)
            if key in self.pieces:
                self.pieces.move_to_end(key)
                self.hits += 1
                continue
            self.misses += 1
            ids = self.enc(piece)
            cost = sys.getsizeof(piece) + 4 * len(ids)
            if cost <= self.budget // 4 and (self.mpt is None or len(ids) <= self.mpt):
                self.pieces[key] = ids
                self.bytes += cost
                while self.bytes > self.budget:
                    (_, old), kept = self.pieces.popitem(last=False)
                    self.bytes -= sys.getsizeof(old) + 4 * len(kept)

    def chat_ids(self, msgs, scope: str, gen: bool) -> list[int]:
        text, spans = self.template(msgs, gen)
        if not any(c in m.content for m in msgs for c in self.controls):
            whole = self.enc(text)
            self.lookup_pieces(text, scope)
            return whole
        ids: list[int] = []
        for a, b, tid in split_at_added(text, self.added):
            if tid is None:
                ids += self.enc(text[a:b])
            elif any(lo <= a and b <= hi for lo, hi in spans):  # typed in a message: text
                ids += self.tok.encode(text[a:b], add_special_tokens=False,
                                       split_special_tokens=True)
            else:
                ids.append(tid)
        return ids

    def chat(self, msgs, scope: str):
        self.check(msgs, "messages", last_user=True)
        return self.chat_ids(msgs, scope, True), ("chat", tuple(
            (m.role, m.content) for m in msgs[:-1]))

    def warm(self, msgs, scope: str) -> list[int]:
        self.check(msgs, "prompts[].messages", last_user=False)
        return self.chat_ids(msgs, scope, False)

    def raw(self, prompt: str, scope: str):
        if blank(prompt) or len(prompt) > self.max_chars:
            raise Refused("prompt")
        self.lookup_pieces(prompt, scope)
        lead = prompt[:len(prompt) - len(prompt.lstrip())]
        return self.enc(prompt), ("raw", lead, prompt[len(prompt.rstrip()):])


class Gen:
    """Random requests; long texts are kept and reused, conversations grow turn by turn."""

    def __init__(self, rng: random.Random, max_chars: int) -> None:
        self.rng, self.max_chars = rng, max_chars
        self.longs: list[str] = []
        self.convs: list[list[Message]] = []

    def short(self, plain: bool = False) -> str:
        r = self.rng
        frags = PLAIN if plain or r.random() < 0.75 else FRAGMENTS
        return "".join(r.choice(frags) for _ in range(r.randrange(0, 8)))

    def long(self) -> str:
        r = self.rng
        if self.longs and (len(self.longs) >= 6 or r.random() < 0.5):
            text = r.choice(self.longs)
            if r.random() < 0.25:  # the same text but for the whitespace at its end
                text = text.rstrip() + r.choice(("", " ", "  ", "\n", "\t", "\r\n"))
            return text
        # Around the 512-character threshold once a role and "\n" are put before it.
        n = r.choice((MIN_CHARS - 8, MIN_CHARS - 7, MIN_CHARS - 5, MIN_CHARS,
                      r.randrange(400, 1400)))
        unit = self.short(plain=r.random() < 0.7) or "word "
        text = (self.short() + unit * (n // len(unit) + 1))[:n]
        if r.random() < 0.1:
            text = text[:n // 2] + r.choice(("<|im_end|>", "<|im_", "\ue0001\ue001", "\r\n"))\
                + text[n // 2:]
        self.longs.append(text)
        return text

    def content(self) -> str:
        r = self.rng
        x = r.random()
        if x < 0.03:
            return r.choice(("", " ", "\n\t", "\u2028", "\u200b", "\x00\u2060"))
        if x < 0.05:
            return "y" * (self.max_chars + r.choice((0, 1)))
        if x < 0.5:
            return self.long()
        return self.short() or "q"

    def role(self) -> str:
        r = self.rng
        return r.choice(BAD_ROLES) if r.random() < 0.03 else r.choice(ROLES)

    def messages(self) -> list[Message]:
        r = self.rng
        if self.convs and r.random() < 0.15:  # the same words, another speaker or last message
            msgs = list(r.choice(self.convs))
            i = r.randrange(len(msgs))
            if i < len(msgs) - 1:
                msgs[i] = Message(r.choice([x for x in ROLES if x != msgs[i].role]),
                                  msgs[i].content)
            else:
                msgs[i] = Message("user", self.content())
            return msgs
        if self.convs and r.random() < 0.5:  # a conversation goes on (its turns are hits)
            base = r.choice(self.convs)
            msgs = base + [Message("assistant", self.content()), Message(
                "user", self.content())]
            if r.random() < 0.1:
                msgs[-1] = Message(self.role(), msgs[-1].content)
        else:
            n = r.choice((0, 1, 1, 2, 2, 3, 4, 5, 6, 7, 8))
            msgs = [Message(self.role(), self.content()) for _ in range(n)]
            if msgs and r.random() < 0.5:
                msgs[0] = Message("system", msgs[0].content)
            if msgs and r.random() < 0.85:
                msgs[-1] = Message("user", msgs[-1].content)
        return msgs

    def raw(self) -> str:
        r = self.rng
        x = r.random()
        if x < 0.3 and self.convs:  # a rendered conversation typed as a raw prompt
            msgs = [m for m in r.choice(self.convs) if m.role in ROLES]
            return "".join(f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n" for m in msgs)
        if x < 0.45:
            return r.choice(("", "  ", "\n")) + self.long() + r.choice(("", " ", "\n", "\t"))
        if x < 0.5:
            return r.choice(("", " \n", "\t"))
        return self.short() + self.long() * r.randrange(0, 2) + self.short()



def _refused_alike(render, given, scope: str, e: Refused, where: str, what) -> None:
    """The renderer (`render(given, scope=scope)`) refuses what the reference refuses, naming
    the same field."""
    with pytest.raises(InvalidArgument) as got:
        render(given, scope=scope)
    assert got.value.field == e.field, (where, what, str(got.value))

def run_seed(tok, seed: int, steps: int = STEPS, books: bool = True) -> int:
    """Runs one seed; AssertionError at the first divergence. Returns the requests compared.
    `books`: compare the cache's books too (False: only what the renderer answers)."""
    rng = random.Random(seed)
    max_chars = rng.choice((300, 3000, 3000, 20_000, 20_000))
    mpt = rng.choice((None, None, None, 150, 600))
    budget = rng.choice((2000, 6000, 12000, 12000, 30000, 32 << 20))
    old = render.PIECE_CACHE_MAX_BYTES
    render.PIECE_CACHE_MAX_BYTES = budget
    try:
        r = PromptRenderer(tok, max_chars=max_chars, max_prompt_tokens=mpt)
        ref = Reference(tok, max_chars, mpt, budget)
        gen = Gen(rng, max_chars)
        hashes: dict[str, tuple] = {}
        keys: dict[tuple, str] = {}
        for step in range(steps):
            scope = rng.choice(("", "", "a", "a", "b"))
            kind = rng.random()
            where = f"seed {seed} step {step}"
            if kind < 0.7:
                msgs = gen.messages()
                what = ("chat", msgs, scope)
                try:
                    want, key = ref.chat(msgs, scope)
                except Refused as e:
                    _refused_alike(r.render_chat, msgs, scope, e, where, what)
                    continue
                try:
                    out = r.render_chat(msgs, scope=scope)
                except InvalidArgument as e:
                    raise AssertionError((where, what, "refused", str(e))) from None
                assert out.token_ids == want, (where, what)
                assert out.query_text == msgs[-1].content
                assert out.continues == any(m.role == "assistant" for m in msgs[:-1])
                if len(msgs) < 12:
                    gen.convs.append(msgs)  # a conversation that may go on
            elif kind < 0.8:
                msgs = [Message(gen.role(), gen.content()) for _ in range(rng.randrange(0, 4))]
                what = ("warm", msgs, scope)
                try:
                    want = ref.warm(msgs, scope)
                except Refused as e:
                    _refused_alike(r.render_warm, msgs, scope, e, where, what)
                    continue
                assert r.render_warm(msgs, scope=scope) == want, (where, what)
                key = None
            else:
                prompt = gen.raw()
                what = ("raw", prompt, scope)
                try:
                    want, key = ref.raw(prompt, scope)
                except Refused as e:
                    _refused_alike(r.render_raw, prompt, scope, e, where, what)
                    continue
                out = r.render_raw(prompt, scope=scope)
                assert out.token_ids == want, (where, what)
                assert out.query_text == prompt and not out.continues
            if key is not None:  # equal exactly when the context is (never the tenant)
                h = out.context_hash
                assert hashes.setdefault(h, key) == key, (where, what, "hash shared")
                assert keys.setdefault(key, h) == h, (where, what, "hash differs")
            if not books:
                continue
            # The cache, as documented, after every request.
            assert (r.piece_hits, r.piece_misses) == (ref.hits, ref.misses), (where, what)
            assert list(r._pieces) == list(ref.pieces), (where, what)
            assert [list(v) for v in r._pieces.values()] == list(ref.pieces.values()), where
            assert r._pieces_bytes == ref.bytes <= budget, (where, what)
        return steps
    finally:
        render.PIECE_CACHE_MAX_BYTES = old


CHUNK = 10


@pytest.mark.parametrize("first", range(0, SEEDS, CHUNK))
def test_the_renderer_gives_the_librarys_ids_under_random_requests(tok, first):
    for seed in range(first, min(first + CHUNK, SEEDS)):
        run_seed(tok, seed)


def test_the_reference_splits_as_the_library_does(tok):
    """The model's premise: text split at added tokens, each piece alone, is the whole text."""
    rng = random.Random(7)
    added = _added(tok)
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randrange(1, 30)))
        ids = []
        for a, b, tid in split_at_added(text, added):
            ids += [tid] if tid is not None else tok.encode(text[a:b], add_special_tokens=False)
        assert ids == tok.encode(text, add_special_tokens=False), repr(text)


def test_threads_sharing_a_small_cache_get_the_librarys_ids(tok, monkeypatch):
    """Renders from several threads at once through one renderer whose budget keeps only a few
    pieces: every answer is the library's, and the cache's books balance at the end (every
    lookup counted once, its bytes those of the pieces it keeps, within the budget)."""
    budget = 6000  # about five of the pieces below
    monkeypatch.setattr(render, "PIECE_CACHE_MAX_BYTES", budget)
    r = PromptRenderer(tok, max_chars=100_000)
    added = _added(tok)
    rng = random.Random(11)
    longs = [f"{i} " + "word " * (100 + 5 * i) + " " * (i % 3) for i in range(8)]
    jobs = []
    for _ in range(4 * max(SEEDS // 2, 10)):
        scope = rng.choice(("a", "b"))
        if rng.random() < 0.7:
            msgs = [Message(rng.choice(ROLES), rng.choice(longs)) for _ in range(rng.randrange(3))]
            msgs.append(Message("user", rng.choice(longs + ["q", " q\n"])))
            if any(c in m.content for m in msgs for c in added):
                continue  # tokenized apart, not through the cache
            text = tok.apply_chat_template([{"role": m.role, "content": m.content}
                                            for m in msgs], tokenize=False,
                                           add_generation_prompt=True)
            jobs.append((scope, msgs, text))
        else:
            text = rng.choice(longs) + rng.choice(("", " ", "\n"))
            jobs.append((scope, None, text))
    want = [tok.encode(text, add_special_tokens=False) for _, _, text in jobs]
    keys = [(scope, text[a:b]) for scope, _, text in jobs if len(text) >= MIN_CHARS
            for a, b, tid in split_at_added(text, added) if tid is None and b - a >= MIN_CHARS]
    bad: list[int] = []

    def work(k: int) -> None:
        for i in range(k, len(jobs), 4):
            scope, msgs, text = jobs[i]
            got = (r.render_chat(msgs, scope=scope) if msgs else r.render_raw(text, scope=scope))
            if got.token_ids != want[i]:
                bad.append(i)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad, [jobs[i] for i in bad[:3]]
    assert r.piece_hits + r.piece_misses == len(keys) and r.piece_hits > 0
    assert 0 < len(r._pieces) < len(set(keys))  # some were let go
    kept = sum(sys.getsizeof(p) + 4 * len(v) for (_, p), v in r._pieces.items())
    assert r._pieces_bytes == kept <= budget
    for (_, p), v in r._pieces.items():
        assert list(v) == tok.encode(p, add_special_tokens=False)
