"""`tiercache` — command-line client.

    tiercache chat "What is a KV cache?"            # streams the answer
    tiercache chat --session s1 "And a radix tree?"  # multi-turn (history kept in ~/.cache)
    tiercache chat - < question.txt                  # the question from stdin
    tiercache warm --system "You are a helpful assistant. Answer briefly and clearly."
    tiercache feedback <entry-id> --bad
    tiercache stats
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import ipaddress
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

# gRPC's core reads this once, as it loads (as services/__init__.py sets it for the services):
# left unset, a failed TLS handshake wrote its own plain-text INFO line ("I1208 ...
# ssl_transport_security.cc:2563] Handshake failed ...") to stderr before the CLI's error.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc  # noqa: E402
from google.protobuf.json_format import MessageToDict  # noqa: E402
from tiercache.v1 import common_pb2, orchestrator_pb2  # noqa: E402

from clients.python.client import (  # noqa: E402
    NO_HTTP2,
    TLS_HANDSHAKE_FAILED,
    IncompleteStream,
    TierCacheClient,
    _ClientBase,
    checked_token,
    float32_problem,
    retry_later,
)
from services.common.config import is_host_port  # noqa: E402
from services.common.errors import blank  # noqa: E402
from services.common.grpc_client import ca_problem, key_pair_problem, pem_problem  # noqa: E402
from services.common.logs import isatty, package_version  # noqa: E402
from services.semantic.policy import HIT_TOLERANCE  # noqa: E402


def session_name(text: str) -> str:
    """An argparse type for --session: it names a file under the sessions folder, so no path
    separator or NUL, no leading dot, at most 200 bytes of UTF-8 (file names stop at 255)."""
    if not text:
        return text  # "" = no session (the default)
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("not valid UTF-8") from None
    if any(c in text for c in "/\\\0") or text.startswith(".") or size > 200:
        raise argparse.ArgumentTypeError(
            f"{text[:40]!r}: a session name is a file name: no / \\ or NUL, not starting "
            "with '.', at most 200 bytes")
    return text


def _history_path(session: str) -> Path:
    # Empty means the default (it wrote ./sessions/ wherever the command ran); `~` expanded.
    raw = os.environ.get("TIERCACHE_CLI_HOME", "").strip()
    base = Path(raw).expanduser() if raw else Path.home() / ".cache" / "tiercache"
    return base / "sessions" / f"{session}.json"


# Control characters a terminal acts on (ESC sequences clear the screen, set its title):
# model text, and cached answers shared between requests, are shown with them replaced.
_CONTROL = {c: "\ufffd" for c in range(32) if chr(c) not in "\n\t"} | {0x7F: "\ufffd"}
# gRPC's own words for a request over the server's size limit, refused before any handler:
# they name no setting, and the orchestrator logs nothing of it.
_REQUEST_TOO_LARGE = "SERVER: Received message larger than max ("


def shown(text: str, stream=None) -> str:
    """`text` as the terminal gets it: control characters replaced when `stream` (stdout by
    default) is one. On stderr too: the server's words there (status details, a report's
    replica id and route) reached a terminal with their control characters acting on it."""
    tty = isatty(sys.stdout if stream is None else stream)
    return text.translate(_CONTROL) if tty else text


def _load_history(path: Path) -> list[dict[str, str]]:
    """A session's messages; SystemExit naming the file when it is not a list of messages."""
    try:
        if not path.exists():
            return []
        messages = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # nesting too deep: RecursionError
        raise SystemExit(f"error: session history {path} is unreadable: {e} (--new starts "
                         "the session over)") from None
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) and _utf8(m["role"]) and _utf8(m["content"])
            for m in messages):
        raise SystemExit(f"error: session history {path} is not a list of "
                         '{"role": ..., "content": ...} messages (delete it to start over)')
    return messages


def _save_history(path: Path, messages: list[dict[str, str]]) -> None:
    """Written whole or not at all (a temporary file renamed over the old one). The temporary
    file has a name of its own (mkstemp): with one fixed name, two turns of one session at
    once wrote the same file, and one renamed away the other's, which then failed (or saved
    the other's half-written text). Its name starts with a dot, as no session's can."""
    tmp: str | None = None
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # A conversation is private: readable by this user only (a folder made before keeps
        # its mode through mkdir).
        if path.parent.stat().st_mode & 0o077:
            path.parent.chmod(0o700)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(messages, ensure_ascii=False))
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        raise SystemExit(f"error: cannot save session history {path}: {e}") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@contextlib.contextmanager
def _one_turn_at_a_time(path: Path | None) -> Iterator[None]:
    """Holds the session's lock from loading its history to saving it: two turns of one
    session at once each saved their own turn over the other's, and one was lost without a
    word. A second turn waits (its history then holds the first's answer)."""
    if path is None:
        yield
        return
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        f = open(path.parent / f".{path.name}.lock", "a")  # noqa: SIM115 - held below
    except OSError as e:
        # Before the request: a turn whose answer could not be kept is not asked.
        raise SystemExit(f"error: cannot save session history {path}: {e}") from None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            sys.stderr.write("waiting for another turn of this session to end\n")
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def cmd_chat(c: TierCacheClient, a: argparse.Namespace) -> int:
    hist = _history_path(a.session) if a.session else None
    with _one_turn_at_a_time(hist):
        return _chat_turn(c, a, hist)


def _chat_turn(c: TierCacheClient, a: argparse.Namespace, hist: Path | None) -> int:
    messages, had_history = _turn_messages(a, hist)
    out, final = _stream_answer(c, a, hist, messages, had_history)
    sys.stdout.write("\n")
    if final is None:
        # Ended without its final message (a proxy or connection cut reported as OK): the
        # answer may be cut short, as TierCacheClient.generate says too.
        sys.stderr.write("error: the stream ended without a final message (the answer may be "
                         "incomplete)" + (f"; session {a.session!r} left unchanged" if hist
                                          else "") + "\n")
        _not_started_over(a, hist)
        return 1
    # Saved as generated, not stripped: the next turn renders it back into the prompt, and an
    # answer ending in a newline, stripped, no longer matched the tokens the replica cached
    # for it (the rest of the conversation was computed again).
    answer = "".join(out)
    # Saved before the report line: with stderr closed or full, writing it failed and the
    # answered turn was lost without a word.
    # Blank as the server reads it (only whitespace, zero-width, format, control or other
    # characters that draw nothing):
    # it refuses such an assistant turn, so saved it failed every later turn of the session.
    if hist is not None and not blank(answer):
        messages.append({"role": "assistant", "content": answer})
        _save_history(hist, messages)
    if not a.quiet:
        _say_report(a, final)
    if hist is not None and blank(answer):
        # An empty assistant turn is invalid input for every later request of the session:
        # keep the history as it was (the question can be asked again).
        sys.stderr.write(f"empty answer: session {a.session!r} left unchanged\n")
        _not_started_over(a, hist)
    return 0


def _turn_messages(a: argparse.Namespace,
                   hist: Path | None) -> tuple[list[dict[str, str]], bool]:
    """The turn's messages (the session's history, a new one's system prompt, the question),
    and whether the session had history."""
    messages: list[dict[str, str]] = []
    if hist is not None and not a.new:
        messages = _load_history(hist)
    had_history = bool(messages)
    if had_history and not a.quiet:
        # An earlier user's session of the same name went out silently as this question's
        # history (a 125-token prompt for a 10-word question).
        turns = sum(m["role"] == "user" for m in messages)
        sys.stderr.write(f"continuing session {a.session!r} ({turns} earlier turn"
                         f"{'s' if turns != 1 else ''}; --new starts it over)\n")
    if a.system and had_history:
        sys.stderr.write(f"note: --system ignored: session {a.session!r} keeps the system "
                         "prompt it began with (--new starts it over)\n")
    if a.system and not messages:
        messages.append({"role": "system", "content": a.system})
    messages.append({"role": "user", "content": a.text})
    return messages, had_history


def _stream_answer(c: TierCacheClient, a: argparse.Namespace, hist: Path | None,
                   messages: list[dict[str, str]],
                   had_history: bool) -> tuple[list[str], orchestrator_pb2.GenerateFinal | None]:
    """Stream the answer to stdout; its pieces, and its final message (None: the stream
    ended without one)."""
    # A model without a chat template (a base model) takes only a raw `prompt`: chat was
    # refused FAILED_PRECONDITION there, with no flag to send one (--raw has no session).
    raw = getattr(a, "raw", False)
    out, final = [], None
    try:
        for ch in c.stream(a.text if raw else messages, raw=raw, max_tokens=a.max_tokens,
                           temperature=a.temperature, top_p=a.top_p, seed=a.seed,
                           session_id=a.session or "",
                           cache_policy=_policy(a)):
            sys.stdout.write(shown(ch.text))
            sys.stdout.flush()
            out.append(ch.text)
            if ch.final is not None:
                final = ch.final
    except IncompleteStream:
        final = None  # said by `_chat_turn`
    except KeyboardInterrupt:
        _end_line(out)
        _not_started_over(a, hist)  # as for a failed turn: a next turn would continue them
        raise
    except grpc.RpcError as e:
        _end_line(out)  # the error is not glued to the partial answer
        _not_started_over(a, hist)
        _say_turn_failed(e, a, hist, had_history)
        raise
    return out, final


def _say_turn_failed(e: grpc.RpcError, a: argparse.Namespace, hist: Path | None,
                     had_history: bool) -> None:
    """The notes on a failed turn: --raw for a model without a chat template, and a session
    grown too long for the model."""
    # Only the prompt's own size: "messages: N tokens exceed the limit of M", "messages:
    # prompt (N tokens) + sampling.max_tokens (M) exceed the model context (C)", "messages:
    # N characters cannot fit in the limit of M prompt tokens", or the tenant's own limit
    # (RESOURCE_EXHAUSTED "messages: N tokens exceed tenant limit M"), or with max_tokens
    # unset "messages: prompt (N tokens) leaves no room for an answer in the model context".
    details = e.details() or ""
    if e.code() == grpc.StatusCode.FAILED_PRECONDITION and "chat template" in details:
        sys.stderr.write("note: --raw sends the text as a raw prompt\n")
    if (hist is not None and had_history
            and e.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                             grpc.StatusCode.RESOURCE_EXHAUSTED)
            and (details.startswith("messages:")
                 # "leaves no room": the prompt alone fills the context (max_tokens unset,
                 # the CLI's default), which every later turn only makes longer.
                 and ("exceed" in details or "cannot fit" in details
                      or "leaves no room" in details)
                 # Past the largest KV pool: every later turn needs more blocks still.
                 or details.startswith("prompt (rendered messages):")
                 and "KV blocks" in details)):
        # The conversation outgrew the prompt limit or the model's context: every later
        # turn would fail the same way, unless only the answer's room is short.
        room = _room_left(details)
        sys.stderr.write(
            f"note: session {a.session!r} has grown too long for the model; "
            + (f"--max-tokens {room} or less fits this turn; " if room else "")
            + f"start it over with --new, or delete {hist}\n")


def _say_report(a: argparse.Namespace, final: orchestrator_pb2.GenerateFinal) -> None:
    """The cache report line, and a note when the answer was cut at its token limit."""
    sys.stderr.write(shown(format_report(final.cache_report, final.request_id),
                           sys.stderr) + "\n")
    if final.finish_reason == common_pb2.FINISH_REASON_LENGTH:
        # Cut at its token limit, not ended by the model: nothing said so, and a half
        # sentence read as the whole answer.
        sys.stderr.write(f"note: the answer was cut at {final.usage.completion_tokens} "
                         "tokens (" + ("--max-tokens" if a.max_tokens else
                                       "the server's default max_tokens, or the room the "
                                       "model's context leaves; --max-tokens asks for more")
                         + ")\n")


def _not_started_over(a: argparse.Namespace, hist: Path | None) -> None:
    """After a `--new` turn that failed or answered nothing: the session's saved turns are
    still there (no answer replaced them), and a next turn without --new would continue them."""
    if hist is not None and a.new and hist.exists():
        sys.stderr.write(f"note: session {a.session!r} was not started over: its saved turns "
                         "stay until a --new turn is answered\n")


_CONTEXT = re.compile(r"prompt \((\d+) tokens\) \+ sampling\.max_tokens \((\d+)\) exceed the "
                      r"model context \((\d+)\)")


# A replica's KV pool refusal (through the orchestrator) says what would fit, when anything
# would: "...; sampling.max_tokens of at most 222 fits".
_POOL_ROOM = re.compile(r"sampling\.max_tokens of at most (\d+) fits")


def _room_left(details: str) -> int:
    """The answer's room in the context, or in the largest KV pool, when only max_tokens
    overflowed it (0: none)."""
    m = _CONTEXT.search(details)
    if not m:
        # Past the pool, the note said only "start it over" where a smaller answer fit.
        pool = _POOL_ROOM.search(details)
        return int(pool.group(1)) if pool else 0
    prompt, _, context = map(int, m.groups())
    return max(0, context - prompt)


def _as_dict(message) -> dict:
    """`message` as JSON, zero values included: proto3 JSON leaves them out, so a fresh
    server's stats printed {} and prompt 0's Warm result had no promptIndex (scripts reading
    those keys broke)."""
    return MessageToDict(message, always_print_fields_with_no_presence=True)


def _policy(a: argparse.Namespace):
    """The request's cache policy from chat's flags (None: the server's defaults)."""
    if not (a.tier or a.threshold or a.no_semantic or a.no_prefix_cache):
        return None
    return common_pb2.CachePolicy(semantic_tier=a.tier, semantic_threshold=a.threshold,
                                  skip_semantic_lookup=a.no_semantic,
                                  skip_semantic_store=a.no_semantic,
                                  skip_prefix_cache=a.no_prefix_cache)


def shown_similarity(sim: float) -> str:
    """A similarity to 3 decimals, rounded down, within the semantic tier's float32 tolerance
    (`HIT_TOLERANCE`): rounded to nearest, a miss at 0.9696 in the strict tier (0.97) read
    "nearest entry 0.970", at the threshold, and a user checking a threshold saw a miss
    where the figure said hit. Now a figure at or above a 3-decimal threshold is a hit."""
    return f"{math.floor((sim + HIT_TOLERANCE) * 1000) / 1000:.3f}"


# CacheReport.semantic_not_served's reasons, as the report line says them.
_NOT_SERVED = {"too_short": "the stored answer is shorter than asked",
               "sampled": "a sampled request (serve_sampled off)",
               "ignore_eos": "ignore_eos, and the stored answer ended at end of sequence"}


def format_report(r, request_id: str = "") -> str:
    """One line for a stream's CacheReport: which tier answered and what it reused; then
    `request_id`, the id every service's log lines of the call carry (a user had none to
    quote in a ticket)."""
    sim = r.semantic_similarity
    # What the similarity was held to, and a refusal above it: "nearest entry 0.962" alone
    # did not say whether it missed the threshold or the guard or verifier refused it. Only
    # where an entry was compared (an empty namespace has the tier's threshold, and no
    # similarity: the threshold alone read as a candidate that missed it).
    # A request's own threshold (--threshold) read as its tier's: "standard threshold 0.900".
    source = ("the request's " if r.semantic_threshold_from_request
              else f"{r.semantic_tier} " if r.semantic_tier else "")
    held = (f"{source}threshold {r.semantic_threshold:.3f}"
            if r.semantic_threshold and sim else "")
    refused = (f"refused: {r.semantic_guard_reason or 'by the guard'}"
               if r.semantic_guard_rejected else "")
    # A hit the orchestrator declined read as a similarity past the threshold, no refusal and
    # a model answer, with nothing saying why.
    declined = (f"hit not served: "
                f"{_NOT_SERVED.get(r.semantic_not_served, r.semantic_not_served)}"
                if r.semantic_not_served else "")
    if r.semantic_hit:
        said = ", ".join(x for x in (held, refused and f"a closer entry {refused}") if x)
        tier = ("semantic hit" + (f" {shown_similarity(sim)}" if sim else "")
                + (f" ({said})" if said else ""))
    else:
        said = ", ".join(x for x in (f"nearest entry {shown_similarity(sim)}" if sim else "",
                                     held, refused, declined) if x)
        tier = "model" + (f" ({said})" if said else "")
    return (f"[{tier} | "
            + (f"route {r.route}, " if r.route else "")
            + f"prompt {r.prompt_tokens} tok, cached {r.cached_tokens}"
            # The replica had evicted part of what the index said it held.
            + (f" (index expected {r.index_matched_tokens})"
               if r.index_matched_tokens > r.cached_tokens + 1 else "")
            + f", replica {r.replica_id or '-'}, ttft {r.ttft_ms:.0f} ms"
            + (f", draft {r.draft_tokens_accepted}/{r.draft_tokens_proposed} accepted"
               + (f" ({r.lookup_tokens_accepted} by prompt lookup)"
                  if r.lookup_tokens_accepted else "")
               if r.draft_tokens_proposed else "")
            + (f", draft from {r.draft_entry_id}" if r.draft_entry_id else "")
            + (f", entry {r.semantic_entry_id}" if r.semantic_entry_id else "")
            # Its tokens came from an identical request's model run in flight (coalescing).
            + (f", coalesced with {r.coalesced_with}" if r.coalesced_with else "")
            + (f", degraded: {' '.join(r.degradations)}" if r.degradations else "")
            + (f", request {request_id}" if request_id else "") + "]")


def cmd_warm(c: TierCacheClient, a: argparse.Namespace) -> int:
    resp = c.warm([a.system] if a.system else [], top_k=a.top_k, owners_only=a.owners,
                  pin_ttl_seconds=a.ttl, raw=a.raw)
    print(json.dumps(_as_dict(resp), indent=2))
    if not resp.results:
        if a.system:
            sys.stderr.write("nothing was warmed: no healthy replica (or owner) to warm\n")
        else:
            # The reply does not say which: nothing to do, or nobody to do it.
            sys.stderr.write("nothing was warmed: the hot prefixes are already held where asked, "
                             "or no healthy replica or prefix index is available\n")
        return 1
    return 0 if all(not r.error for r in resp.results) else 1


def cmd_feedback(c: TierCacheClient, a: argparse.Namespace) -> int:
    resp = c.feedback(a.entry_id, good=not a.bad)
    print(json.dumps(_as_dict(resp), indent=2))  # as every other reply (one line was its own)
    if a.bad and not resp.invalidated:
        sys.stderr.write("the entry was already gone (expired, evicted or invalidated): it is "
                         "not served\n")
    return 0


def _erase_confirmed(tenant: str) -> bool:
    """Destructive and not undoable: asked at a terminal (a script, whose stdin is no
    terminal, or --yes goes on). A no, end of input and Ctrl-C each say "not erased" on a
    line of its own (after them the question's line was left open)."""
    sys.stderr.write(f"erase every cached answer and KV block of tenant {tenant!r} on every "
                     "semantic shard and kvpool replica? [y/N] ")
    sys.stderr.flush()
    try:
        answer = sys.stdin.readline()  # "" at end of input: a no
    except KeyboardInterrupt:
        sys.stderr.write("\nnot erased\n")
        raise
    if answer.strip().lower() in ("y", "yes"):
        return True
    sys.stderr.write(("" if answer.endswith("\n") else "\n") + "not erased\n")
    return False


def cmd_erase_tenant(c: TierCacheClient, a: argparse.Namespace) -> int:
    if not a.yes and isatty(sys.stdin) and not _erase_confirmed(a.tenant):
        return 1
    resp = c.erase_tenant(a.tenant)
    print(json.dumps(_as_dict(resp), indent=2))
    for line in resp.not_reached:
        # Every one said, on its own line: the tenant's data there stays.
        sys.stderr.write(f"not reached: {shown(line, sys.stderr)}\n")
    if resp.not_reached:
        sys.stderr.write(f"{len(resp.not_reached)} not reached: the tenant's data stays there; "
                         "run erase-tenant again once they are back\n")
    if resp.kv_blocks_in_use:
        sys.stderr.write(f"{resp.kv_blocks_in_use} KV blocks kept: a running request reads "
                         "them; remove the tenant's tokens, then run erase-tenant again once "
                         "its requests have ended\n")
    # Not zero unless everything was erased: a script's `&&` must not take a part for all.
    return 1 if resp.not_reached or resp.kv_blocks_in_use else 0


# What to do about a tier's shard-list mismatch: the server's note names the two lists only
# (the fix was in the shard's log alone), and during a planned change of the shards it is
# expected and outlives the change (docs/deploy.md, "Scale each tier").
MISMATCH_FIX = {
    "semantic": "list the same semantic shards, by the same names, in every orchestrator's "
                "TIERCACHE_ORCHESTRATOR_SEMANTIC_ADDRESS (after a change of the shards, "
                "expected until about 10 minutes after the old list's last call)",
    "prefix": "list the same prefix shards, by the same names, in every kvpool's "
              "TIERCACHE_KVPOOL_PREFIX_ADDRESS and every orchestrator's "
              "TIERCACHE_ORCHESTRATOR_PREFIX_ADDRESSES (after a change of the shards, "
              "expected until 5 minutes after the last pod rolled)",
}


def cmd_stats(c: TierCacheClient, a: argparse.Namespace) -> int:
    resp = c.stats()
    print(json.dumps(_as_dict(resp), indent=2))
    if not resp.model_id:
        # Every orchestrator of this version reports its model id (its setting or folder's
        # name; never empty): "" is an older one, which has no such field. Printed alone it
        # read as an orchestrator serving no model, beside replicas reporting theirs.
        sys.stderr.write("modelId: not reported (an orchestrator older than this client; "
                         "replicas[].modelId are the models routed to)\n")
    tiers = {d.name for d in resp.dependencies}
    for tier, st in (("semantic", resp.semantic), ("prefix", resp.prefix)):
        if not resp.HasField(tier):
            # No shard answered: the tier's figures are left out of the JSON altogether (its
            # key is missing), which said nothing here, while "1 of 2 answered" did. A tier
            # that is not configured has no dependency line either: nothing to say.
            if tier in tiers:
                sys.stderr.write(f"{tier}: no figures (it did not answer; see its line in "
                                 "dependencies)\n")
            continue
        # Summed over the shards that answered: said here too, not only in the JSON.
        if st.shards_answered < st.shards_total:
            sys.stderr.write(f"{tier}: {st.shards_answered} of {st.shards_total} shards "
                             "answered; its figures leave out the others'\n")
        if st.shard_list_mismatch:
            # Every call succeeds while lookups go to the wrong shard: the JSON alone hid it.
            # The server's words, shown as the others on stderr are.
            sys.stderr.write(f"{tier}: {shown(st.shard_list_mismatch, sys.stderr)}; "
                             f"{MISMATCH_FIX[tier]}\n")
    return 0


def _end_line(out: list[str]) -> None:
    """Ends the line of an answer cut short (an error, Ctrl-C), if any of it was printed: the
    error, or the shell's prompt, went on the same line."""
    if any(out):
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.write("\n")
            sys.stdout.flush()


def _drop_buffered_output() -> None:
    """Point stdout at /dev/null: the output still buffered must not raise again when Python
    flushes it at exit."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a file (captured, closed)
        pass


def _usage(why: str) -> NoReturn:
    """A usage error found after parsing: exit 2, as argparse's own."""
    sys.stderr.write(f"tiercache: error: {why}\n")
    raise SystemExit(2)


def _loopback(address: str) -> bool:
    """Whether host:port names this machine (a local stack), where plaintext is fine."""
    host = address.rpartition(":")[0].lower()
    if host.startswith(("dns:", "ipv4:", "ipv6:")):
        host = host.split(":", 1)[1].lstrip("/")
    host = host.strip("[]")  # after the scheme: "ipv6:[::1]" kept its "[" and was warned of
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def credentials(a: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """TLS when --ca is given, or --tls (verified against the system's trusted roots); mutual
    TLS with --cert and --key. None = plaintext.

    An empty --ca (or TIERCACHE_TLS_CA="") without --tls forces plaintext even when the client
    certificate variables are exported; --cert/--key without TLS are an error."""
    if a.ca == "" and not a.tls:
        return None
    if not a.ca and not a.tls:
        if a.cert or a.key:
            _usage("--cert/--key need --ca or --tls (TLS)" + _set_by_env(a))
        return None
    if bool(a.cert) != bool(a.key):
        _usage("give --cert and --key together" + _set_by_env(a))
    problem = _tls_files_problem(a)
    if problem:
        raise SystemExit(f"error: {problem}")
    try:
        read = [Path(x).read_bytes() if x else None for x in (a.ca, a.key, a.cert)]
    except OSError as e:  # changed since checked
        raise SystemExit(f"error: cannot read TLS file: {e}") from None
    return grpc.ssl_channel_credentials(root_certificates=read[0], private_key=read[1],
                                        certificate_chain=read[2])


# The variables argparse takes the TLS flags' values from when they are not given.
_TLS_ENV = {"--ca": "TIERCACHE_TLS_CA", "--cert": "TIERCACHE_TLS_CLIENT_CERT",
            "--key": "TIERCACHE_TLS_CLIENT_KEY"}


def _from_env(flag: str, value: str | None) -> bool:
    """Whether `flag`'s value is its variable's (as argparse expanded it): a user who typed no
    --cert was told of "--cert/--key" that an env file had exported."""
    env = os.environ.get(_TLS_ENV[flag])
    return bool(env) and os.path.expanduser(env) == value


def _tls_flag(flag: str, value: str | None) -> str:
    return f"{flag} (env {_TLS_ENV[flag]})" if _from_env(flag, value) else flag


def _set_by_env(a: argparse.Namespace) -> str:
    """" (set by VAR, ...)" for the client pair's values the environment gave."""
    names = [_TLS_ENV[f] for f, v in (("--cert", a.cert), ("--key", a.key)) if _from_env(f, v)]
    return f" (set by {', '.join(names)})" if names else ""


def _tls_files_problem(a: argparse.Namespace) -> str:
    """What is wrong with the TLS files given ("" = nothing), checked as the services check
    theirs at start: gRPC took a file that is no PEM, a key given as the CA, or a key that is
    not the certificate's, and failed every call as "UNAVAILABLE (retry later): ... Failed to
    create security handshaker", which named no file and said to retry what never succeeds."""
    for flag, path in (("--ca", a.ca), ("--cert", a.cert), ("--key", a.key)):
        why = pem_problem(path) if path else ""
        if why:
            return f"{_tls_flag(flag, path)}: {why}"
    why = ca_problem(a.ca) if a.ca else ""
    if why:
        return f"{_tls_flag('--ca', a.ca)} {a.ca}: {why}"
    why = key_pair_problem(a.cert, a.key, server=False) if a.cert else ""
    if why:
        return (f"{_tls_flag('--cert', a.cert)} {a.cert} and {_tls_flag('--key', a.key)} "
                f"{a.key} {why}")
    return ""


def cmd_replay(c: TierCacheClient, a: argparse.Namespace) -> int:
    from collections import Counter

    from benchmarks.workload import load_trace
    from clients.python.replay import replay

    try:
        w = load_trace(a.trace)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise SystemExit(f"error: trace {a.trace}: {type(e).__name__}: {e}") from None
    for i, r in enumerate(w.requests, 1):
        # Checked before anything is sent: a worker thread's KeyError, after requests had
        # gone out, was a traceback.
        prompts = w.system_prompts.get(r.tenant)
        if prompts is None or not 0 <= r.system_index < len(prompts):
            raise SystemExit(f"error: trace {a.trace}: request {i} names tenant {r.tenant!r} "
                             f"system_index {r.system_index}, which its header does not have")
    tokens = a.tenant_tokens
    unknown = sorted(set(tokens) - set(w.system_prompts))
    if unknown:
        # Dropped without a word, its tenant's requests went with --token (another tenant's).
        known = sorted(w.system_prompts)
        _usage(f"--tenant-tokens: tenant {unknown[0]!r} is not in the trace (its tenants: "
               + ", ".join(known[:10]) + (f", ... ({len(known)} in all)" if known[10:] else "")
               + ")")
    clients = {t: TierCacheClient(a.address, token=tokens.get(t, a.token), timeout=a.timeout,
                                  credentials=a.credentials)
               for t in w.system_prompts}

    _say_replay_length(w, a.time_scale)
    tty = isatty(sys.stderr)
    shown = [-1]  # the last tenth of the run reported (not a terminal: a line per tenth)

    def progress(done: int, total: int) -> None:
        if tty:
            sys.stderr.write(f"\r{done}/{total} requests")
        elif done * 10 // max(total, 1) > shown[0]:
            shown[0] = done * 10 // max(total, 1)
            sys.stderr.write(f"{done}/{total} requests\n")  # a log holds no \r rewrites
        sys.stderr.flush()

    try:
        out = replay(w, clients, concurrency=a.concurrency, time_scale=a.time_scale,
                     max_tokens=a.max_tokens, progress=progress)
    finally:
        for cl in clients.values():
            cl.close()
        if tty:  # also on Ctrl-C: the next line does not start after the counter
            sys.stderr.write("\n")
    # The figures are of the answered requests, as the classes: a status after the final
    # message (an error) kept that message's figures, and the sums counted them.
    ok = [o for o in out if not o.error]
    classes = Counter(o.cache_class for o in ok)
    errors = [o for o in out if o.error]
    for text, n in Counter(o.error for o in errors).most_common(5):
        sys.stderr.write(f"error ({n}x): {text}\n")
    print(json.dumps({"requests": len(out), "errors": len(errors), "classes": dict(classes),
                      "cached_tokens": sum(o.cached_tokens for o in ok),
                      "prompt_tokens": sum(o.prompt_tokens for o in ok)}, indent=2))
    return 1 if errors else 0


def _say_replay_length(w, time_scale: float) -> None:
    """A timed replay's length by the trace's timestamps, on stderr before anything is sent
    (as its progress lines, at a terminal or not): a large --time-scale waited hours without a
    word, its counter at 0."""
    last = max((r.at for r in w.requests), default=0.0) * time_scale
    if last > 0:
        sys.stderr.write(f"the last of {len(w.requests)} requests is due {_duration(last)} "
                         f"after the start (the trace's timestamps x --time-scale "
                         f"{time_scale:g}; later, when its session's earlier turns answer "
                         "late)\n")


def _duration(seconds: float) -> str:
    """45.0 s, 30 min 0 s, 2 h 5 min."""
    if round(seconds, 1) < 60:
        return f"{seconds:.1f} s"
    minutes, s = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {s} s"
    return "{} h {} min".format(*divmod(minutes, 60))


def _count(top: int):
    def parse(text: str) -> int:
        """An argparse type for the API's counts (a bad value: usage error, exit 2)."""
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not 0 <= v <= top:
            raise argparse.ArgumentTypeError(f"must be in [0, {top}], got {v}")
        return v
    return parse


# As the proto fields are declared.
uint32, int32, uint64 = _count(2**32 - 1), _count(2**31 - 1), _count(2**64 - 1)


def _float32(text: str, top: float) -> float:
    """A sampling value in [0, top] as its float32 field carries it (the library's rule):
    1e-50 went out as 0 (unset), 1e39 as inf."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    problem = float32_problem(v, top)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return v


def _threshold(text: str) -> float:
    """argparse type: a semantic threshold in (0, 1] (0 = the tier's)."""
    return _float32(text, 1.0)


def _top_p(text: str) -> float:
    """argparse type: a top-p in [0, 1] (0 = off), refused here rather than by the server."""
    return _float32(text, 1.0)


def _up_to_1e6(zero: bool, unit: str = ""):
    """argparse type: a finite number in (0, 1e6], or [0, 1e6] with `zero`. A huge timeout
    expired at once as DEADLINE_EXCEEDED, as did 0 and nan; an infinite time scale
    overflowed a sleep."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (0 <= v <= 1e6 and (zero or v > 0)):
            raise argparse.ArgumentTypeError(
                f"must be in {'[' if zero else '('}0, 1e6]{unit}, got {text!r}")
        return v
    return parse


def _token(text: str) -> str | None:
    """A bearer token, surrounding whitespace dropped (a secret file's trailing newline):
    printable ASCII, as gRPC metadata must be (else an INTERNAL "Invalid metadata" that named
    nothing). Blank = no token (no auth)."""
    t = text.strip()
    if not _utf8(t):
        raise argparse.ArgumentTypeError("not valid UTF-8")
    if not t:
        return None
    try:
        return checked_token(t)  # the library's own rule (inner spaces allowed)
    except ValueError:
        raise argparse.ArgumentTypeError("must be printable ASCII") from None


# --token's default: read TIERCACHE_TOKEN after parsing (argparse would run `_token` on a
# string default, and an empty variable then failed every command).
_FROM_ENV = object()


def _tenant_tokens(text: str) -> dict[str, str]:
    """--tenant-tokens tenant=token,...: a pair without '=' was dropped without a word."""
    out: dict[str, str] = {}
    for pair in filter(None, (s.strip() for s in text.split(","))):
        tenant, sep, tok = pair.partition("=")
        if not sep or not tenant:
            raise argparse.ArgumentTypeError(f"expected tenant=token, got {pair!r}")
        out[tenant] = _token(tok)
    return out


def _temperature(text: str) -> float:
    """argparse type: a finite temperature >= 0 (0 = greedy)."""
    return _float32(text, float("inf"))


def _positive(text: str) -> int:
    v = _count(2**31 - 1)(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


# Arguments sent over the wire: they must be valid UTF-8 (a shell passes undecodable bytes as
# surrogates, which protobuf cannot encode). Not erase-tenant's `tenant`: the client's own
# request check (`_check_args`) refuses it first, naming the character.
_WIRE_ARGS = ("address", "token", "text", "session", "system", "entry_id", "tenant_tokens")


# Arguments a lone "-" reads from stdin, by their names in usage errors: a question or system
# prompt past one argument's limit (128 KiB: "Argument list too long"), or kept in a file
# (`chat - < question.txt`). `chat -` asked the model "-".
_STDIN_ARGS = {"text": "text", "system": "--system"}


def _read_stdin_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Replace the argument given as "-" by stdin's text (trailing newlines dropped, as
    `"$(cat file)"` drops them)."""
    names = [n for n in _STDIN_ARGS if getattr(a, n, None) == "-"]
    if len(names) > 1:
        p.error("text and --system cannot both be - (stdin)")
    for name in names:
        setattr(a, name, _stdin_text(p, _STDIN_ARGS[name]))


def _stdin_text(p: argparse.ArgumentParser, flag: str) -> str:
    if sys.stdin is None:
        p.error(f"{flag}: - reads stdin, which is closed")
    if isatty(sys.stdin) and sys.stderr is not None:
        sys.stderr.write(f"reading {flag} from stdin (end it with Ctrl-D)\n")
    try:
        data = getattr(sys.stdin, "buffer", sys.stdin).read()
    except KeyboardInterrupt:
        if sys.stderr is not None:
            sys.stderr.write("\n")  # the shell's prompt went after the "^C" echoed
        raise SystemExit(130) from None
    except OSError as e:
        p.error(f"{flag}: cannot read stdin: {e}")
    try:
        text = data if isinstance(data, str) else data.decode("utf-8")
    except UnicodeDecodeError as e:
        p.error(f"{flag} (stdin): not valid UTF-8 (byte {data[e.start]:#04x} at offset "
                f"{e.start})")
    if not text.rstrip("\n"):
        p.error(f"{flag} (stdin): empty")
    return text.rstrip("\n")


# A call refused as busy now, or not reached now, that the same command may get through
# later: the error line says "(retry later)" (`retry_later`). EX_TEMPFAIL (sysexits.h): with
# exit 1 for it too, a script could not tell "send it again later" from a failure that repeats.
EXIT_RETRY_LATER = 75

# What a script can tell apart (nothing said it: a failed call and a usage error were told
# apart by guessing).
_EXIT_STATUSES = (
    "exit status: 0 done; 1 failed (stderr says why: the call failed or was refused, a TLS "
    "file or a session's history is unusable, a warm or erase-tenant did not reach everything, "
    "a replayed request failed); 2 usage error (nothing sent); 75 busy or unreachable now "
    "(the error says '(retry later)': the same command may succeed later); 130 interrupted "
    "(Ctrl-C); 141 stdout closed before the output ended (| head)")


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The CLI's parser, and the subcommand parsers whose usage errors `_check_args` says."""
    p = argparse.ArgumentParser(prog="tiercache", description="TierCache client",
                                epilog=_EXIT_STATUSES)
    # Which release a wheel installed (`tiercache --version` read "the following arguments
    # are required: cmd").
    p.add_argument("--version", action="version", version=f"tiercache {package_version()}")
    p.add_argument("--address", default=os.environ.get("TIERCACHE_ADDRESS", "localhost:50051"),
                   help="orchestrator host:port (env TIERCACHE_ADDRESS; default %(default)s)")
    p.add_argument("--token", type=_token, default=_FROM_ENV,
                   help="tenant bearer token (env TIERCACHE_TOKEN; none = no auth)")
    p.add_argument("--timeout", type=_up_to_1e6(False, " seconds"), default=300.0,
                   help="seconds per call (default %(default)s)")
    # TLS files `~`-expanded as the services' are (an env file's "~/certs/ca.pem" arrives
    # literally, and so does a flag's "--ca=~/..."; argparse applies `type` to the defaults).
    p.add_argument("--ca", type=os.path.expanduser, default=os.environ.get("TIERCACHE_TLS_CA"),
                   help="CA bundle: speak TLS and verify the server (env TIERCACHE_TLS_CA)")
    p.add_argument("--cert", type=os.path.expanduser,
                   default=os.environ.get("TIERCACHE_TLS_CLIENT_CERT"),
                   help="client certificate for mutual TLS (env TIERCACHE_TLS_CLIENT_CERT)")
    p.add_argument("--key", type=os.path.expanduser,
                   default=os.environ.get("TIERCACHE_TLS_CLIENT_KEY"),
                   help="client key for mutual TLS (env TIERCACHE_TLS_CLIENT_KEY)")
    p.add_argument("--tls", action="store_true",
                   help="speak TLS, verifying the server against the system's trusted roots "
                        "(servers with a public certificate; no --ca needed)")
    sub = p.add_subparsers(dest="cmd", required=True)
    ch = _add_chat(sub)
    w = _add_warm(sub)
    f = sub.add_parser("feedback", help="mark a semantic entry good (verified) or bad")
    f.add_argument("entry_id", help="the entry id a chat's report line names (entry ...)")
    f.add_argument("--bad", action="store_true",
                   help="a wrong answer: invalidate the entry (default: mark it verified)")
    # The shared tiers' figures are the same from any orchestrator; its request and token
    # counts are its own (README): "every tier" read as the cluster's totals.
    sub.add_parser("stats", help="figures of every tier; request and token counts are the "
                                 "answering orchestrator's own, since its start")
    er = _add_erase_tenant(sub)
    _add_replay(sub)
    return p, {"chat": ch, "warm": w, "erase-tenant": er}


def _add_chat(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    ch = sub.add_parser("chat", help="ask a question, stream the answer")
    ch.add_argument("text", help="the question (a user message); - reads it from stdin")
    ch.add_argument("--session", default="", type=session_name,
                    help="conversation id (keeps history)")
    ch.add_argument("--system", default="",
                    help="system prompt for a new conversation (- reads it from stdin)")
    ch.add_argument("--max-tokens", type=int32, default=0,
                    help="0 = the server's default, cut to what the model's context leaves")
    ch.add_argument("--temperature", type=_temperature, default=0.0, help="0 = greedy")
    ch.add_argument("--top-p", type=_top_p, default=0.0, help="nucleus sampling (0 = off)")
    ch.add_argument("--seed", type=uint64, default=0,
                    help="a sampled answer's seed (0 = none): the same seed, the same answer")
    ch.add_argument("-q", "--quiet", action="store_true", help="no cache report on stderr")
    ch.add_argument("--tier", choices=("strict", "standard", "relaxed"), default="",
                    help="semantic tier's threshold (default: the server's)")
    ch.add_argument("--threshold", type=_threshold, default=0.0,
                    help="explicit semantic threshold, from the server's floor to 1 (below "
                         "the floor, 0.85 by default, the call is refused)")
    ch.add_argument("--no-semantic", action="store_true",
                    help="skip the semantic tier (no lookup, no store)")
    ch.add_argument("--no-prefix-cache", action="store_true",
                    help="compute the whole prompt (no KV reuse)")
    ch.add_argument("--new", action="store_true",
                    help="with --session: start the session over (its saved turns dropped)")
    ch.add_argument("--raw", action="store_true",
                    help="send the text as a raw prompt, without the chat template (a model "
                         "without one refuses messages); not with --session or --system")
    return ch


def _add_warm(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    w = sub.add_parser("warm", help="prefill and pin a system prompt on replicas")
    w.add_argument("--system", default="",
                   help="system prompt to prefill and pin (whole 16-token KV blocks only; - "
                        "reads it from stdin)")
    w.add_argument("--top-k", type=uint32, default=0,
                   help="also warm (and pin) this tenant's k hottest prefixes (at most 64)")
    w.add_argument("--owners", action="store_true", help="only the owning replica")
    w.add_argument("--raw", action="store_true",
                   help="send --system as a raw prompt (a model without a chat template)")
    w.add_argument("--ttl", type=uint32, default=0,
                   help="pin lifetime in seconds (0 = the server's default); extends a pin, "
                        "never shortens one")
    return w


def _add_erase_tenant(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    er = sub.add_parser("erase-tenant",
                        help="erase a tenant's cached data on every shard and replica (admin "
                             "token; exit 1 when some were not reached)")
    er.add_argument("tenant", help="the tenant's name, as in the tokens file")
    er.add_argument("--yes", action="store_true",
                    help="do not ask for confirmation (not asked either when stdin is not a "
                         "terminal)")
    return er


def _add_replay(sub: argparse._SubParsersAction) -> None:
    rp = sub.add_parser("replay", help="replay a workload trace (python -m benchmarks.workload)")
    rp.add_argument("trace", help="trace file (JSON lines) that benchmarks.workload wrote")
    rp.add_argument("--concurrency", type=_positive, default=2,
                    help="requests in flight at once (default %(default)s)")
    rp.add_argument("--time-scale", type=_up_to_1e6(True), default=0.0,
                    help="seconds of replay per second of trace (0 = as fast as possible)")
    rp.add_argument("--max-tokens", type=int32, default=32,
                    help="of each answer (default %(default)s; 0 = the server's default)")
    rp.add_argument("--tenant-tokens", type=_tenant_tokens, default={},
                    help="tenant=token,... for auth (tenants not named use --token)")


def _replace_unencodable() -> None:
    """Unencodable output as "?" on stdout and stderr."""
    for stream in (sys.stdout, sys.stderr):
        # A console whose encoding cannot spell the answer (ascii, a Windows code page) gets
        # "?" for what it cannot show, not a UnicodeEncodeError traceback mid-answer.
        try:
            stream.reconfigure(errors="replace")
        except (AttributeError, ValueError, OSError):  # not a text file (captured, closed)
            pass


def _check_args(p: argparse.ArgumentParser, subs: dict[str, argparse.ArgumentParser],
                a: argparse.Namespace) -> None:
    """Usage errors parsing alone does not find (exits 2, as argparse does)."""
    w, ch, er = subs["warm"], subs["chat"], subs["erase-tenant"]
    if a.token is _FROM_ENV:  # no --token given (an empty one means no auth)
        try:
            a.token = _token(os.environ.get("TIERCACHE_TOKEN", ""))
        except argparse.ArgumentTypeError as e:
            p.error(f"TIERCACHE_TOKEN: {e}")
    if not is_host_port(a.address.strip(), dialed=True):
        # gRPC dialed 127.0.0.1:99999 as port 34463 (modulo 65536), and "localhost" as 443.
        p.error(f"--address (env TIERCACHE_ADDRESS): {a.address!r} is not host:port (port "
                "1..65535; an IPv6 address in brackets)")
    a.address = a.address.strip()
    if a.cmd == "warm" and not a.system and not a.top_k:
        w.error("give --system PROMPT or --top-k K")  # not the wire's "prompts or top_k"
    if a.cmd == "chat" and a.new and not a.session:
        ch.error("--new starts a --session over: give --session NAME")  # else ignored unsaid
    if a.cmd == "chat" and a.raw and (a.session or a.system):
        # A raw prompt is the whole prompt: no system message, no earlier turns to carry.
        ch.error("--raw sends the text alone: not with --session or --system")
    if a.cmd == "erase-tenant":
        try:
            _ClientBase._erase_request(a.tenant)  # the client's own checks, as usage errors
        except (TypeError, ValueError) as e:
            er.error(str(e))
    # Last of the usage errors that need no text: one of them said only after the user typed
    # a whole question at a terminal was typed for nothing. ("-" counts as given above.)
    _read_stdin_args(p, a)
    for name in _WIRE_ARGS:
        value = getattr(a, name, None)
        if isinstance(value, str) and not _utf8(value):
            p.error(f"{name.replace('_', '-')}: not valid UTF-8")


# gRPC's words for this call's deadline passing; mid-stream either (the second one alone was
# missed).
_DEADLINE_WORDS = ("Deadline Exceeded", "Stream removed (Deadline Exceeded)")


def _say_rpc_error(e: grpc.RpcError, a: argparse.Namespace) -> int:
    """The one line a failed call ends the CLI with; returns the CLI's exit status, 75 where
    the line says "(retry later)", else 1 (one decision for both)."""
    # Any call the same request may succeed later: UNAVAILABLE too (a replica or the
    # orchestrator restarting), not after part of an answer was printed.
    again = retry_later(e)
    later = " (retry later)" if again else ""
    details = e.details() or ""
    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and details in _DEADLINE_WORDS:
        # gRPC's own words for this call's deadline: say which setting set it.
        said = ("the answer did not end" if getattr(e, "chunks_received", 0)
                else "no answer")
        details += f" ({said} within --timeout {a.timeout:g} s)"
    if e.code() == grpc.StatusCode.UNIMPLEMENTED and details == "Method not found!":
        # gRPC's own words for a server without the RPC: most often the port beside the
        # orchestrator's, a shard's (a walk: "Method not found!" named nothing to check).
        details += (f" ({a.address} serves no tiercache.v1.Orchestrator: --address names an "
                    "orchestrator, not a semantic, prefix or kvpool shard)")
    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith(
            _REQUEST_TOO_LARGE):
        details += (" (bytes: the request's vs. the orchestrator's limit, "
                    "TIERCACHE_ORCHESTRATOR_MAX_REQUEST_BYTES; send less, or raise it)")
    if e.code() == grpc.StatusCode.UNAVAILABLE:
        details += _connect_hint(details, a)
    # The id the servers logged the call under (a ticket quotes it); none for an error
    # raised before anything was sent.
    rid = getattr(e, "request_id", "")
    sys.stderr.write(f"error: {e.code().name}{later}: {shown(details, sys.stderr)}"
                     + (f" (request {rid})" if rid else "") + "\n")
    return EXIT_RETRY_LATER if again else 1


def _connect_hint(details: str, a: argparse.Namespace) -> str:
    """What to check when a call failed to connect for TLS, or to a server speaking no gRPC
    ("": nothing points at either). gRPC's words named an OpenSSL or HTTP/2 error and no flag,
    and the CLI said to retry what fails again."""
    if NO_HTTP2 in details:
        return f" ({a.address} is no gRPC server: --address names the orchestrator's gRPC port)"
    if TLS_HANDSHAKE_FAILED in details and "WRONG_VERSION_NUMBER" in details:
        return f" ({a.address} does not speak TLS: leave out --tls and {_tls_flag('--ca', a.ca)})"
    if TLS_HANDSHAKE_FAILED in details and "CERTIFICATE_VERIFY_FAILED" in details:
        trusted = f"{_tls_flag('--ca', a.ca)} {a.ca}" if a.ca else "the system's trusted roots"
        return (f" (the server's certificate is not signed by {trusted}: give --ca the CA "
                "that signed it)")
    # A server that ends the handshake says only this, and only as the connection is made (a
    # stream the server dropped mid-answer says "Stream removed (Socket closed)").
    if not (details.startswith("failed to connect") and "Socket closed" in details):
        return ""
    if a.credentials is None:
        return " (a server that speaks TLS closes a plaintext connection: --ca or --tls)"
    if not a.cert:
        return (" (a server that requires a client certificate closes a connection without "
                "one: --cert and --key)")
    return ""


def main(argv: list[str] | None = None) -> int:
    p, subs = _parser()
    a = p.parse_args(argv)
    _replace_unencodable()
    _check_args(p, subs, a)
    cmds = {"chat": cmd_chat, "warm": cmd_warm, "feedback": cmd_feedback, "stats": cmd_stats,
            "erase-tenant": cmd_erase_tenant, "replay": cmd_replay}
    if sys.stdout is None or sys.stderr is None:
        # Closed (`>&-`): a traceback after the request had been sent and answered.
        if sys.stderr is not None:
            sys.stderr.write("tiercache: error: stdout is closed\n")
        return 1
    a.credentials = credentials(a)  # files read once; replay's per-tenant clients share it
    if a.token and a.credentials is None and not _loopback(a.address):
        # Said, not refused (a trusted network, a sidecar proxy): the bearer token goes out in
        # clear text to another host.
        sys.stderr.write(f"tiercache: warning: sending the token in plaintext to {a.address} "
                         "(no --ca/--tls)\n")
    try:
        with TierCacheClient(a.address, token=a.token, timeout=a.timeout,
                             credentials=a.credentials) as c:
            rc = cmds[a.cmd](c, a)
            # Here, not at exit: a pipe closed or a disk full while Python flushed stdout at
            # exit was "Exception ignored ..." and status 120, past the handlers below.
            sys.stdout.flush()
            return rc
    except grpc.RpcError as e:
        return _say_rpc_error(e, a)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`| head -1`): stop quietly, as a Unix filter does.
        _drop_buffered_output()
        return 141
    except OSError as e:  # e.g. the output cannot be written (a full disk): one line
        if e.errno in (errno.ENOSPC, errno.EIO, errno.EFBIG, errno.EDQUOT):
            _drop_buffered_output()  # it could not be written either: no second traceback
        sys.stderr.write(f"error: {e}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
