"""Tenant limits' rules at their edges (pure logic: the real TenantRegistry)."""

from __future__ import annotations

import pytest

from services.common.errors import Overloaded
from services.orchestrator.tenants import TenantRegistry


def registry(tokens_file: str = "", tokens: str = "") -> TenantRegistry:
    """The registry of `tokens_file` or of TIERCACHE_ORCHESTRATOR_TOKENS' `tokens`, under the
    limits the tests here share."""
    return TenantRegistry.build(tokens_file=tokens_file, tokens=tokens, key=b"k",
                                max_prompt_tokens=100, max_tokens=16, max_concurrent=1)


def test_a_tenant_past_its_concurrent_requests_is_told_what_to_do():
    """Every other "retry later" refusal says when ("retry in N s", "retry shortly or on
    another orchestrator", "retry later"); the tenant's concurrency limit named only the
    limit, so a client hitting it in a burst could not tell it from a fixed one by its
    message."""
    reg = registry(tokens="tok-acme=acme")
    acme = reg.authenticate({"authorization": "Bearer tok-acme"})
    held = reg.acquire(acme)
    with pytest.raises(Overloaded, match=r"\(limit 1\); retry when one of them ends$"):
        reg.acquire(acme)
    reg.release(held)
    reg.release(reg.acquire(acme))  # the slot freed: taken again


def test_the_tokens_file_versions_are_named_in_the_reload_lines(tmp_path, caplog):
    """Each reload line names the version it took (sha256sum's first 12 digits), and a
    refused one both versions: "read again: 2 tokens of 2 tenants" read the same for a
    token removed and one changed. An emptied file is said to be empty, not "not JSON". The
    stale gauge says while the file's latest version is not the one in force."""
    import hashlib
    import json
    import logging
    import threading
    from functools import partial

    from services.orchestrator.tenants import watch_tokens_file
    from tests.metric_sample import sample_value
    from tests.waits import wait_until

    f = tmp_path / "tokens.json"
    first = json.dumps({"tok-a": {"tenant": "a"}})
    f.write_text(first)

    build = partial(registry, str(f))

    def tag(text: str) -> str:
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    until = partial(wait_until, timeout=5, what=lambda: caplog.text, every=0.01)

    stop = threading.Event()
    with caplog.at_level(logging.INFO, logger="services.orchestrator.tenants"):
        watch_tokens_file(build(), build, str(f), 0.02, stop)
        second = json.dumps({"tok-b": {"tenant": "b"}})
        f.write_text(second)
        until(lambda: f"read again: 1 tokens of 1 tenants (version {tag(second)})"
              in caplog.text)
        assert sample_value("tiercache_orchestrator_tokens_file_stale") == 0
        f.write_text("")
        until(lambda: f"changed (version {tag('')}) but was not taken" in caplog.text)
        assert sample_value("tiercache_orchestrator_tokens_file_stale") == 1
        f.write_text(second)
        until(lambda: caplog.text.count("read again") >= 2)
        assert sample_value("tiercache_orchestrator_tokens_file_stale") == 0
    stop.set()
    assert f"the file is empty): keeping the tokens read before (version {tag(second)})" \
        in caplog.text
    assert tag(first) not in caplog.text  # the start's version is the app's line


@pytest.mark.parametrize("name", ["\u3164", "\u200b", "\u200b\ufeff", "\u3164 \u3164", "\u2800"])
def test_a_tenant_named_by_only_invisible_characters_is_refused_at_start(tmp_path, name):
    """strip() kept the Hangul filler and zero-width characters: a tenant nobody could read in
    a log line, a metric label or Stats was taken, from the tokens file and from
    TIERCACHE_ORCHESTRATOR_TOKENS alike. Refused as a name with nothing in it; with a visible
    character among them, as a name that prints as another (the character named)."""
    import json

    f = tmp_path / "tokens.json"
    f.write_text(json.dumps({"tok": {"tenant": name}}))
    with pytest.raises(ValueError, match=r"'tenant' must be a non-empty string \(not only "
                                         "whitespace or invisible characters\\)"):
        registry(tokens_file=str(f))
    with pytest.raises(ValueError, match="invisible characters"):
        registry(tokens="tok=" + name)
    with pytest.raises(ValueError, match=f"'tenant' holds U\\+{ord(name[0]):04X} "):
        registry(tokens="tok=a" + name)


def test_a_refused_tokens_file_entry_is_named_by_its_line_too(tmp_path):
    """A refusal named the entry by its position only ("entry 20002", "key 20002 of an object
    repeats an earlier key of it"): in a file of 20,000 tenants, a count no editor shows. It
    names the line the entry starts on, and a repeated token the entry it repeats."""
    import json

    def build(text: str) -> None:
        f = tmp_path / "tokens.json"
        f.write_text(text)
        registry(str(f))

    entries = {f"token-{i:04d}-0123456789abcdef": {"tenant": f"t{i}"} for i in range(300)}
    good = json.dumps(entries, indent=1)  # entry i starts on line 2 + 3 * (i - 1)
    with pytest.raises(ValueError, match=r"entry 301: 'tenant' ' t' has leading or trailing "
                                         r"whitespace \(line 902\)$"):
        build(good[:-2] + ',\n "another-0123456789abcdef": {"tenant": " t"}\n}')
    with pytest.raises(ValueError, match=r"tokens.json: entry 301 \(line 902\) repeats the "
                                         r"token of entry 6 \(line 17\)$"):
        build(good[:-2] + ',\n "token-0005-0123456789abcdef": "x"\n}')
    with pytest.raises(ValueError, match="key 2 of an object repeats an earlier key of it"):
        build('{"token-0123456789abcdef": {"tenant": "a", "tenant": "b"}}')  # not a token
    build(good)


# Each prints as a plain name in a log line, a metric label or Stats: "acme", "café", "ab".
LOOKALIKES = [("acme\u200b", "U+200B (ZERO WIDTH SPACE)"),
              ("cafe\u0301", "not in Unicode NFC form (at U+0301 (COMBINING ACUTE ACCENT))"),
              ("a\nb", "U+000A"), ("a\x1fb", "U+001F"),
              ("a\u202eb", "U+202E (RIGHT-TO-LEFT OVERRIDE)"),
              ("a\u00a0b", "U+00A0 (NO-BREAK SPACE)"),
              # A format character that is drawn (blank() lets it by in a text): a name holds
              # none, as docs/deploy.md says (its "prints as nothing" class is Cf as a whole).
              ("a\u0600b", "U+0600 (ARABIC NUMBER SIGN)")]


@pytest.mark.parametrize(("name", "said"), LOOKALIKES)
def test_a_tenant_name_that_prints_as_another_is_refused_at_start_naming_the_character(
        tmp_path, name, said):
    """"acme\u200b", NFD "café" or a name with a control or direction character inside were
    tenants of their own (their own salts and limits), printed as "acme", "café" or "ab" in
    logs, metric labels and Stats, and an EraseTenant of the name as printed missed them. The
    tokens file (its entry and line named) and TIERCACHE_ORCHESTRATOR_TOKENS refuse them,
    naming the character; a plain space inside a name stays a name."""
    import json
    import re

    f = tmp_path / "tokens.json"
    f.write_text(json.dumps({"tok-x": "x", "tok": {"tenant": name}}, indent=1))
    with pytest.raises(ValueError, match=rf"tokens.json: entry 2: 'tenant' .*"
                                         rf"{re.escape(said)}.* \(line 3\)$"):
        registry(tokens_file=str(f))
    with pytest.raises(ValueError, match=rf"^TIERCACHE_ORCHESTRATOR_TOKENS: 'tenant' .*"
                                         rf"{re.escape(said)}"):
        registry(tokens="tok=" + name)
    reg = registry(tokens="tok=acme corp")
    assert reg.authenticate({"authorization": "Bearer tok"}).name == "acme corp"


def test_a_reload_naming_a_tenant_that_prints_as_another_keeps_the_tokens_before(
        tmp_path, caplog):
    """As a malformed reload: the version is refused, named, and the tokens read before stay
    (the old token still authenticates, the new one does not)."""
    import json
    import logging
    import threading
    from functools import partial

    from services.common.errors import Unauthenticated
    from services.orchestrator.tenants import watch_tokens_file
    from tests.waits import wait_until

    f = tmp_path / "tokens.json"
    f.write_text(json.dumps({"tok-a": "acme"}))

    build = partial(registry, str(f))

    reg, stop = build(), threading.Event()
    with caplog.at_level(logging.INFO, logger="services.orchestrator.tenants"):
        watch_tokens_file(reg, build, str(f), 0.02, stop)
        f.write_text(json.dumps({"tok-a": "acme", "tok-b": "acme\u200b"}))
        wait_until(lambda: "but was not taken" in caplog.text, timeout=5,
                   what=lambda: caplog.text, every=0.01)
    stop.set()
    assert "'tenant' holds U+200B (ZERO WIDTH SPACE)" in caplog.text
    assert reg.authenticate({"authorization": "Bearer tok-a"}).name == "acme"
    with pytest.raises(Unauthenticated):
        reg.authenticate({"authorization": "Bearer tok-b"})
