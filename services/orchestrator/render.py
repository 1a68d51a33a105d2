"""Turning a request's chat messages into token ids, and naming its semantic context.

Validation happens here, before any cache or model is touched, so a bad request leaves no
state behind. Errors name the field as the client sent it (`messages[2].role`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.errors import FailedPrecondition, InvalidArgument, blank, shown
from services.common.metrics import counter

ROLES = ("system", "user", "assistant")
# Stand-ins for message contents while the chat template renders (private-use characters).
# Only the stand-ins go through that rendering, never what the messages say, so a message may
# hold these characters too (it was refused, beside a control text, for no reason).
_SLOT = "\ue000{}\ue001"
_SLOT_RE = re.compile("\ue000([0-9]+)\ue001")
# Text between added tokens at least this long is kept tokenized (a system prompt of ~1,400
# tokens took 2.5 ms to tokenize on every request, a quarter of a semantic hit's time); at
# most this many bytes of texts and ids in all, least recently used out first. (A budget of
# 4 M characters, ids kept as tuples of ints, held 138 MB for CJK texts of ~2.7 tokens a
# character.)
PIECE_CACHE_MIN_CHARS = 512
PIECE_CACHE_MAX_BYTES = 32 * 1024 * 1024
# The help says the length: docs/metrics.md named the constant, and a live check's system
# prompts of ~200 characters left the counter absent, read as the cache not working.
PIECES = counter("tiercache_orchestrator_prompt_pieces_total",
                 f"Prompt texts between control tokens of {PIECE_CACHE_MIN_CHARS} characters or "
                 "more (system prompts, earlier turns): found tokenized in the renderer's cache "
                 "(kept per tenant), or not; shorter ones are tokenized each time, uncounted",
                 ("result",))
# Texts tokenized whole and piece by piece when the renderer starts: if any differs, the
# tokenizer does not treat text between added tokens on its own, and prompts are tokenized
# whole (see PromptRenderer.encode_prompt).
_PIECE_PROBES = ("a{0}b c{0} d\n\n2. x{1}\n{0}", " {0}  {1}1{0}\tq", "{1}{0}é 中文 42{1} ")


def _piece_bytes(piece: str, n_ids: int) -> int:
    """What a kept piece holds: its text (the key) and its ids (4 bytes each)."""
    return sys.getsizeof(piece) + 4 * n_ids


def _encode_split(text: str, pattern: re.Pattern, added_ids: dict[str, int],
                  encode_piece: Callable[[str], Sequence[int]]) -> list[int]:
    """`text` tokenized as a fast tokenizer does: split at its added tokens (`pattern`), each
    piece between them tokenized alone by `encode_piece`."""
    ids: list[int] = []
    at = 0
    for m in pattern.finditer(text):
        ids += encode_piece(text[at:m.start()])
        ids.append(added_ids[m.group()])
        at = m.end()
    ids += encode_piece(text[at:])
    return ids


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class RenderedPrompt:
    """A prompt ready for the model plus what the semantic tier needs."""

    token_ids: list[int]
    # Text the semantic tier embeds (the last user message, or the raw prompt).
    query_text: str
    # Hash of everything before the query (system prompt + earlier turns); part of the namespace.
    context_hash: str
    # The messages carry an earlier assistant turn: this continues a conversation.
    continues: bool = False


# A message's content or a raw prompt with nothing to read: said alike for both, and alike by
# Generate and Warm.
BLANK = "must not be empty (or only whitespace or invisible characters)"


def _check_message(field: str, m: Message, max_chars: int) -> None:
    """One message's role, content and length; InvalidArgument names `field`.role/.content.
    Generate's and Warm's alike: a warmed prefix with an empty message is one no request
    Generate takes can ever reuse (its pins held blocks for nothing)."""
    if m.role not in ROLES:
        raise InvalidArgument(f"{field}.role",
                              f"unknown role {shown(m.role)}; expected one of {', '.join(ROLES)}")
    if blank(m.content):
        raise InvalidArgument(f"{field}.content", BLANK)
    if len(m.content) > max_chars:
        raise InvalidArgument(f"{field}.content",
                              f"longer than the limit of {max_chars} characters")


def validate_messages(messages: Sequence[Message], max_chars: int) -> None:
    """Raises InvalidArgument naming the first bad field."""
    if not messages:
        raise InvalidArgument("messages", "must not be empty (or give prompt)")
    for i, m in enumerate(messages):
        _check_message(f"messages[{i}]", m, max_chars)
    if messages[-1].role != "user":
        raise InvalidArgument(f"messages[{len(messages) - 1}].role",
                              "the last message must be from the user")


def context_hash(parts: Sequence[Message]) -> str:
    """Stable hash of the conversation context before the query."""
    blob = json.dumps([[m.role, m.content] for m in parts], ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class PromptRenderer:
    """Renders chat messages with the model's own chat template and tokenizes them."""

    def __init__(self, tokenizer: Any, max_chars: int = 100_000,
                 max_prompt_tokens: int | None = None) -> None:
        self.tok = tokenizer
        self.max_chars = max_chars
        # A piece with more tokens than a prompt may have is never kept: its request is refused.
        self.max_prompt_tokens = max_prompt_tokens
        self._max_token_chars: int | None = None
        self._specials: tuple[str, ...] | None = None
        self._bare: Any = False  # False: not built yet (see _bare_tokenizer)
        self._plain_added: tuple[str, ...] = ()
        self._added: tuple[re.Pattern, dict[str, int]] | None | bool = False  # False: not known
        # (scope, piece) -> ids. Scoped by tenant: shared, a repeated piece's faster tokenizing
        # (timed through a refusal right after it) told a tenant what another had sent.
        self._pieces: OrderedDict[tuple[str, str], array] = OrderedDict()
        self._pieces_bytes = 0
        self._pieces_lock = threading.Lock()
        self.piece_hits = self.piece_misses = 0

    @property
    def _added_tokens(self) -> dict[int, Any]:
        """The tokenizer's added tokens by id ({}: none, or a tokenizer that keeps no such
        table)."""
        return getattr(self.tok, "added_tokens_decoder", None) or {}

    @property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token stands for: its longest vocabulary
        entry (byte-level and SentencePiece entries spell each byte or space as at most one
        character; 0 = unknown)."""
        if self._max_token_chars is None:
            vocab = getattr(self.tok, "get_vocab", None)
            self._max_token_chars = max(map(len, vocab()), default=0) if vocab else 0
        return self._max_token_chars

    def check_size(self, field: str, n_messages: int, chars: int, max_tokens: int) -> None:
        """Refuses, before any rendering, what cannot fit in `max_tokens` (`size_problem`).
        (Rendering and tokenizing 12 MB of messages took 20 s, only to refuse.)"""
        why = self.size_problem(n_messages, chars, max_tokens)
        if why:
            raise InvalidArgument(field, why)

    def size_problem(self, n_messages: int, chars: int, max_tokens: int,
                     limit: str = "the limit of") -> str:
        """Why `n_messages` messages of `chars` characters in all cannot fit in `max_tokens`
        prompt tokens ("" = they may): each message takes at least one token, and no token
        stands for more than `max_token_chars` characters. `limit` names the limit."""
        if n_messages > max_tokens:
            return (f"{n_messages} messages exceed {limit} {max_tokens} prompt tokens (one at "
                    "least each)")
        per_token = self.max_token_chars
        if per_token and chars > max_tokens * per_token:
            return f"{chars} characters cannot fit in {limit} {max_tokens} prompt tokens"
        return ""

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    def render_text(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    field: str = "messages") -> str:
        """The messages through the model's chat template; `field` names them in errors.

        Raises:
            FailedPrecondition: the model has no chat template (a base model): send `prompt`.
            InvalidArgument: the template refused the messages (e.g. a role it does not know).
        """
        if not self.has_chat_template:
            raise FailedPrecondition("the model has no chat template (a base model?): send a "
                                     "raw `prompt` instead of `messages`")
        from jinja2 import TemplateError

        try:
            return self.tok.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in messages],
                tokenize=False, add_generation_prompt=add_generation_prompt)
        except (TemplateError, ValueError, TypeError) as exc:
            raise InvalidArgument(field, f"the model's chat template refused them: {exc}"
                                  ) from None

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def encode_literal(self, text: str) -> list[int]:
        """`text` tokenized as plain characters: an added token's text in it ("<|im_end|>",
        "<tool_call>") gives that text's ordinary tokens, never the added token.

        `split_special_tokens` does that for special added tokens (and, in a slow tokenizer,
        for every added token); a fast tokenizer still matches added tokens marked
        `special=False` (Qwen's `<tool_call>`, FIM markers), so text holding one goes through
        a copy of the tokenizer without its added tokens."""
        literal = {"add_special_tokens": False, "split_special_tokens": True}
        bare = self._bare_tokenizer()
        if bare is not None and any(t in text for t in self._plain_added):
            return list(bare.encode(text, add_special_tokens=False).ids)
        return list(self.tok.encode(text, **literal))

    def _bare_tokenizer(self) -> Any:
        """The fast tokenizer's backend without its added tokens, where some added token is
        not special (None: none such, or a slow tokenizer, which `split_special_tokens`
        covers)."""
        if self._bare is False:
            self._bare = None
            added = self._added_tokens
            self._plain_added = tuple(sorted(
                t.content for t in added.values() if t.content and not t.special))
            backend = getattr(self.tok, "backend_tokenizer", None)
            if self._plain_added and backend is not None:
                from tokenizers import Tokenizer

                spec = json.loads(backend.to_str())
                spec["added_tokens"] = []
                self._bare = Tokenizer.from_str(json.dumps(spec))
        return self._bare

    def encode_prompt(self, text: str, scope: str = "") -> list[int]:
        """`encode(text)`, with long pieces between added tokens (a system prompt, earlier
        turns) tokenized once and kept. A fast tokenizer splits its input at added tokens
        before anything else and tokenizes each piece alone, so the ids are the same; where
        that does not hold here (a slow tokenizer, an added token that strips or matches
        whitespace around it, a pre-tokenizer that treats a text's first piece apart: see
        `_added_split`), the text is tokenized whole. Pieces are kept per `scope` (the
        tenant): a piece one tenant sent is never found faster for another."""
        added = self._added_split()
        if added is None or len(text) < PIECE_CACHE_MIN_CHARS:
            return self.encode(text)
        return _encode_split(text, *added, functools.partial(self._piece, scope=scope))

    def _piece(self, piece: str, scope: str = "") -> array | list[int]:
        if len(piece) < PIECE_CACHE_MIN_CHARS:
            return self.encode(piece) if piece else []
        key = (scope, piece)
        with self._pieces_lock:
            ids = self._pieces.get(key)
            if ids is not None:
                self._pieces.move_to_end(key)
                self.piece_hits += 1
                PIECES.labels("hit").inc()
                return ids
            self.piece_misses += 1
            PIECES.labels("miss").inc()
        ids = self.encode(piece)
        cost = _piece_bytes(piece, len(ids))
        if cost <= PIECE_CACHE_MAX_BYTES // 4 and (self.max_prompt_tokens is None
                                                   or len(ids) <= self.max_prompt_tokens):
            with self._pieces_lock:
                if key not in self._pieces:
                    self._pieces[key] = array("I", ids)
                    self._pieces_bytes += cost
                while self._pieces_bytes > PIECE_CACHE_MAX_BYTES:
                    (_, old), kept = self._pieces.popitem(last=False)
                    self._pieces_bytes -= _piece_bytes(old, len(kept))
        return ids

    def forget_scope(self, scope: str) -> int:
        """Drops the pieces kept for `scope` (a tenant erased: its prompts' text stayed in
        this cache until newer pieces pushed it out). Returns how many were dropped."""
        with self._pieces_lock:
            gone = [k for k in self._pieces if k[0] == scope]
            for k in gone:
                self._pieces_bytes -= _piece_bytes(k[1], len(self._pieces.pop(k)))
        return len(gone)

    def _added_split(self) -> tuple[re.Pattern, dict[str, int]] | None:
        """A pattern matching the tokenizer's added tokens (longest first, as its own split
        does) and their ids; None when pieces between them may not be tokenized apart."""
        if self._added is False:
            self._added = self._find_added_split()
        return self._added  # type: ignore[return-value]

    def _find_added_split(self) -> tuple[re.Pattern, dict[str, int]] | None:
        added = self._added_tokens
        if not getattr(self.tok, "is_fast", False) or not added:
            return None
        backend = getattr(self.tok, "backend_tokenizer", None)
        normalizer = getattr(backend, "normalizer", None)
        if any(t.lstrip or t.rstrip or t.single_word or (t.normalized and normalizer is not None)
               for t in added.values()):
            return None
        ids = {t.content: i for i, t in added.items() if t.content}
        pattern = re.compile("|".join(re.escape(c) for c in sorted(ids, key=len, reverse=True)))
        names = sorted(ids, key=ids.get)
        a, b = names[0], names[-1]
        for probe in _PIECE_PROBES:
            text = probe.format(a, b)
            if _encode_split(text, pattern, ids, self.encode) != self.encode(text):
                return None
        return pattern, ids

    @property
    def special_texts(self) -> tuple[str, ...]:
        """The texts the tokenizer turns into added (control) tokens, e.g. "<|im_end|>", and
        those not marked special (`<tool_call>`), which a template may use as structure too."""
        if self._specials is None:
            added = self._added_tokens
            texts = {t.content for t in added.values()}
            texts |= set(getattr(self.tok, "all_special_tokens", None) or ())
            self._specials = tuple(sorted(t for t in texts if t))
        return self._specials

    def encode_messages(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                        field: str = "messages", scope: str = "") -> list[int]:
        """The messages through the chat template, tokenized; what a message says is always
        text. Tokenizing the rendered string whole turned a "<|im_end|>" typed in a message
        into the real control token, so a user could end their turn and write the assistant's
        (or a system) turn themselves.

        Messages without such a text: the rendered string tokenized whole, as before. With
        one: the same, except that each control token found inside a message's text is
        replaced by that text's plain tokens (the tokenizer's offsets say where each token
        came from), so every other token is what whole-string tokenizing gives. A slow
        tokenizer (no offsets) tokenizes template pieces and messages apart instead. `field`
        names the messages in errors (e.g. "prompts[1].messages" for Warm); `scope` is the
        tenant whose tokenized pieces may be reused (`encode_prompt`).
        """
        text = self.render_text(messages, add_generation_prompt, field)
        specials = self.special_texts
        if not any(sp in m.content for m in messages for sp in specials):
            return self.encode_prompt(text, scope)
        slotted = self.render_text([Message(m.role, _SLOT.format(i))
                                    for i, m in enumerate(messages)], add_generation_prompt,
                                   field)
        parts = _SLOT_RE.split(slotted)  # template text, slot index, template text, ...
        spans: list[tuple[int, int]] = []  # where each message's text lies in `text`
        rebuilt: list[str] = []
        at = 0
        for k, part in enumerate(parts):
            piece = part if k % 2 == 0 else messages[int(part)].content
            if k % 2:
                spans.append((at, at + len(piece)))
            rebuilt.append(piece)
            at += len(piece)
        if (sorted(int(i) for i in parts[1::2]) != list(range(len(messages)))
                or "".join(rebuilt) != text):
            # Named by the message and the text it holds (the first control text of the
            # model's list was shown, whatever the message held).
            i, sp = next((i, sp) for i, m in enumerate(messages) for sp in specials
                         if sp in m.content)
            raise InvalidArgument(f"{field}[{i}].content", "holds a control-token text "
                                  f"({shown(sp)}) and the model's chat template does not keep "
                                  "messages verbatim, so it cannot be sent as text")
        try:
            enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        except (NotImplementedError, TypeError, ValueError):  # a slow tokenizer: no offsets
            ids: list[int] = []
            for k, part in enumerate(parts):
                ids += (self.encode(part) if k % 2 == 0
                        else self.encode_literal(messages[int(part)].content))
            return ids
        special_ids = set(self.tok.convert_tokens_to_ids(list(specials)))
        ids = []
        for tid, (a, b) in zip(enc["input_ids"], enc["offset_mapping"], strict=True):
            if tid in special_ids and any(lo <= a and b <= hi for lo, hi in spans):
                ids += self.encode_literal(text[a:b])
            else:
                ids.append(tid)
        return ids

    def render_chat(self, messages: Sequence[Message], scope: str = "") -> RenderedPrompt:
        """`scope`: the tenant (see `encode_prompt`)."""
        validate_messages(messages, self.max_chars)
        ids = self.encode_messages(messages, scope=scope)
        return RenderedPrompt(ids, messages[-1].content, context_hash(messages[:-1]),
                              any(m.role == "assistant" for m in messages[:-1]))

    def render_raw(self, prompt: str, field: str = "prompt", scope: str = "") -> RenderedPrompt:
        """A raw prompt, used as-is; `field` names it in errors (e.g. "prompts[1].prompt");
        `scope`: the tenant (see `encode_prompt`)."""
        if blank(prompt):
            raise InvalidArgument(field, f"{BLANK}; or give messages")
        if len(prompt) > self.max_chars:
            raise InvalidArgument(field, f"longer than the limit of {self.max_chars} characters")
        # The whitespace at its ends is part of the namespace: for a raw completion it is the
        # model's input ("... Earth is" / "... Earth is " continue differently), and the
        # semantic tier reads a text's ends as layout (it served " Mount Everest" to both).
        # None at either end: the namespace raw prompts always had.
        lead, trail = prompt[:len(prompt) - len(prompt.lstrip())], prompt[len(prompt.rstrip()):]
        edges = json.dumps([lead, trail]) if lead or trail else ""
        return RenderedPrompt(self.encode_prompt(prompt, scope), prompt,
                              context_hash([Message("raw", edges)]))

    def render_warm(self, messages: Sequence[Message], field: str = "prompts[]",
                    scope: str = "") -> list[int]:
        """A prefix to warm: rendered without the generation prompt (e.g. a system prompt).
        `field` names the prompt in errors (e.g. "prompts[1]"); `scope`: the tenant."""
        if not messages:
            raise InvalidArgument(f"{field}.messages", "must not be empty (or give prompt)")
        for i, m in enumerate(messages):
            _check_message(f"{field}.messages[{i}]", m, self.max_chars)
        return self.encode_messages(messages, add_generation_prompt=False,
                                    field=f"{field}.messages", scope=scope)
