import dataclasses
import json
import time

import pytest

from services.common.errors import ResourceExhausted, Unauthenticated
from services.orchestrator.tenants import TenantRegistry
from tests.waits import holds_within

KEY = b"k"


def reg(**kw):
    base = dict(tokens_file="", tokens="", key=KEY, max_prompt_tokens=100, max_tokens=50,
                max_concurrent=2)
    base.update(kw)
    return TenantRegistry.build(**base)


def limited(r: TenantRegistry):
    """`r`'s first tenant limited to 1 request/s with a burst of 3, and the test clock `r`
    now reads (at 100 s)."""
    from tests.clock import Clock

    r.clock = clock = Clock(100.0)
    t = dataclasses.replace(r.by_token[next(iter(r.by_token))], rate_per_s=1.0, burst=3)
    r._current[t.name] = t  # the limits in force, as a reload of the tokens file sets them
    return t, clock


def tenant_of(r: TenantRegistry, token: str) -> str | None:
    """The tenant `token` authenticates as in `r`; None when it is refused."""
    try:
        return r.authenticate({"authorization": f"Bearer {token}"}).name
    except Unauthenticated:
        return None


def test_no_tokens_means_default_tenant_without_auth():
    r = reg()
    assert r.authenticate({}).name == "default"


def test_tokens_map_to_tenants_with_distinct_salts(tmp_path):
    f = tmp_path / "tokens.json"
    f.write_text(json.dumps({"tok-b": {"tenant": "b", "max_concurrent": 1}}))
    r = reg(tokens="tok-a=a", tokens_file=str(f))
    a = r.authenticate({"authorization": "Bearer tok-a"})
    b = r.authenticate({"authorization": "bearer tok-b"})
    assert (a.name, b.name) == ("a", "b")
    assert a.cache_salt != b.cache_salt
    assert b.max_concurrent == 1 and a.max_concurrent == 2
    # The salt is keyed: knowing the tenant name is not enough to derive it.
    assert TenantRegistry.salt_for("a", b"other") != a.cache_salt


@pytest.mark.parametrize("md,msg", [({}, "missing"), ({"authorization": "Basic x"}, "Bearer"),
                                    ({"authorization": "Bearer nope"}, "unknown token"),
                                    ({"authorization": "Bearer "}, "expected 'Bearer <token>'")])
def test_bad_credentials_are_unauthenticated(md, msg):
    with pytest.raises(Unauthenticated, match=msg):
        reg(tokens="tok-a=a").authenticate(md)


def test_bearer_and_its_token_may_be_parted_by_several_spaces():
    """A live walk: `authorization: Bearer  tok` (two spaces) was refused as "unknown token",
    the token read as " tok". RFC 7235 parts the scheme from the credentials by 1*SP, and no
    token begins with a space (the tokens file refuses one): accepted. A tab is no SP."""
    r = reg(tokens="tok-a=a")
    assert r.authenticate({"authorization": "Bearer  tok-a"}).name == "a"
    assert r.authenticate({"authorization": "bearer   tok-a"}).name == "a"
    with pytest.raises(Unauthenticated, match="expected 'Bearer <token>'"):
        r.authenticate({"authorization": "Bearer\ttok-a"})
    with pytest.raises(Unauthenticated, match="expected 'Bearer <token>'"):
        r.authenticate({"authorization": "Bearer   "})

def test_two_bearer_tokens_are_refused_whichever_is_valid():
    """gRPC metadata may repeat a key: the last token counted here, while a proxy in front
    may check the first, so a call could pass the proxy as one tenant and be served as
    another."""
    r = reg(tokens="tok-a=a,tok-b=b")
    for pairs in ([("authorization", "Bearer tok-a"), ("authorization", "Bearer tok-b")],
                  [("authorization", "Bearer nope"), ("authorization", "Bearer tok-a")]):
        with pytest.raises(Unauthenticated, match="given more than once"):
            r.authenticate(pairs)
    assert r.authenticate([("x-request-id", "1"), ("authorization", "Bearer tok-b")]).name == "b"


def test_limits():
    r = reg(tokens="t=a")
    a = r.authenticate({"authorization": "Bearer t"})
    with pytest.raises(ResourceExhausted, match="prompt"):
        r.check_limits(a, 101, 10)
    with pytest.raises(ResourceExhausted, match="^messages: 101 tokens"):
        r.check_limits(a, 101, 10, "messages")  # named as the request gave its prompt
    with pytest.raises(ResourceExhausted, match="sampling.max_tokens"):
        r.check_limits(a, 10, 51)
    r.check_limits(a, 100, 50)  # at the limits is allowed
    r.acquire(a)
    r.acquire(a)
    with pytest.raises(ResourceExhausted, match="concurrent"):
        r.acquire(a)
    r.release(a)
    r.acquire(a)


def test_malformed_tokens_setting_is_rejected():
    with pytest.raises(ValueError, match="TIERCACHE_ORCHESTRATOR_TOKENS"):
        reg(tokens="justatoken")


def test_a_forged_entry_reference_with_non_ascii_characters_is_just_unknown():
    r = reg(tokens="tok-a=a")
    a = r.authenticate({"authorization": "Bearer tok-a"})
    ref = r.entry_ref(a, "abc")
    assert r.entry_id(a, ref) == "abc"
    assert r.entry_id(a, "abc.é") is None
    assert r.entry_id(a, "abc.\u00e9" + ref[-15:]) is None


@pytest.mark.parametrize("entry,field", [
    ({"tenant": "a", "admin": "false"}, "admin"),  # a truthy string made anyone admin
    ({"tenant": "a", "admin": 1}, "admin"),
    ({"tenant": "a", "max_concurrent": 0}, "max_concurrent"),
    ({"tenant": "a", "max_prompt_tokens": -5}, "max_prompt_tokens"),
    ({"tenant": "a", "max_tokens": None}, "max_tokens"),
    ({"tenant": "a", "max_tokens": 2.5}, "max_tokens"),
    ({"tenant": "a", "max_tokens": True}, "max_tokens"),
    ({"tenant": "a", "rate_per_s": "inf"}, "rate_per_s"),
    ({"tenant": "a", "rate_per_s": -1}, "rate_per_s"),
    ({"tenant": "a", "burst": 0}, "burst"),
    # Taken, then float(burst) overflowed in the bucket: every call of the tenant INTERNAL.
    ({"tenant": "a", "rate_per_s": 1, "burst": 10 ** 400}, "burst"),
    ({"tenant": "a", "max_tokens": 10 ** 400}, "max_tokens"),
    ({"tenant": "a", "rate_per_s": 10 ** 400}, "rate_per_s"),  # an OverflowError at start
    ({"tenant": "a", "rate_per_s": 1e-320}, "rate_per_s"),  # refused with "retry in infs"
    ({"tenant": "a", "max_concurent": 4}, "unknown field"),
    ({"tenant": ""}, "tenant"),
    ({"max_tokens": 5}, "tenant"),  # a KeyError traceback at start before
    (None, "tenant name"),  # became a tenant named "None"
    (["a"], "tenant name"),
])
def test_malformed_token_entries_are_refused_naming_the_field(tmp_path, entry, field):
    f = tmp_path / "tokens.json"
    f.write_text(json.dumps({"secret-token": entry}))
    with pytest.raises(ValueError, match=field) as ei:
        reg(tokens_file=str(f))
    assert "secret-token" not in str(ei.value)  # positions, never the token itself
    assert "entry 1" in str(ei.value)


def test_a_configured_tokens_file_without_tokens_does_not_open_the_api(tmp_path):
    f = tmp_path / "tokens.json"
    f.write_text("{}")
    with pytest.raises(ValueError, match="no tokens"):
        reg(tokens_file=str(f))
    with pytest.raises(ValueError, match="names no token"):
        reg(tokens=" , ")


def test_limits_belong_to_the_tenant_whichever_token_it_uses(tmp_path):
    """Each token built its own Tenant while counters are per tenant name: a second token let
    a tenant with max_concurrent 1 run two requests, and an env token replaced the file's
    whole spec (admin and limits) for the same token."""
    f = tmp_path / "tokens.json"
    f.write_text(json.dumps({"t1": {"tenant": "a", "max_concurrent": 1, "admin": True}}))
    r = reg(tokens_file=str(f), tokens="t2=a,t1=a")
    t1 = r.authenticate({"authorization": "Bearer t1"})
    t2 = r.authenticate({"authorization": "Bearer t2"})
    assert t1 == t2 and t1.max_concurrent == 1 and t1.admin
    r.acquire(t1)
    with pytest.raises(ResourceExhausted):
        r.acquire(t2)
    f.write_text(json.dumps({"t1": {"tenant": "a", "max_concurrent": 1},
                             "t3": {"tenant": "a", "max_concurrent": 5}}))
    with pytest.raises(ValueError, match="different limits"):
        reg(tokens_file=str(f))
    f.write_text(json.dumps({"t1": {"tenant": "a"}}))
    with pytest.raises(ValueError, match="file's token of tenant 'a'"):
        reg(tokens_file=str(f), tokens="t1=b")


def test_whole_numbers_written_as_json_floats_are_accepted(tmp_path):
    f = tmp_path / "tokens.json"
    f.write_text('{"t": {"tenant": "a", "burst": 10.0, "max_tokens": 1e3, "rate_per_s": 2}}')
    t = reg(tokens_file=str(f)).authenticate({"authorization": "Bearer t"})
    assert (t.burst, t.max_tokens, t.rate_per_s) == (10, 1000, 2.0)
    assert type(t.burst) is int and type(t.max_tokens) is int


@pytest.mark.parametrize("name,msg", [(" acme", "whitespace"), ("acme\t", "whitespace"),
                                      ("t" * 65, "65 characters; at most 64")])
def test_tenant_names_the_semantic_tier_would_refuse_or_split_fail_at_boot(tmp_path, name, msg):
    """A 300-character name turned the tenant's semantic cache off without a word (the tier
    refuses the namespace); " acme" and "acme" were two tenants with two salts."""
    f = tmp_path / "tokens.json"
    f.write_text(json.dumps({"tok": {"tenant": name}}))
    with pytest.raises(ValueError, match=msg):
        reg(tokens_file=str(f))
    assert reg(tokens_file="", tokens="tok=" + "t" * 64).authenticate(
        {"authorization": "Bearer tok"}).name == "t" * 64


def test_a_token_ending_in_base64_padding_keeps_its_padding():
    """The pair split at its first '=': "c2VjcmV0==" + "=acme" became the token "c2VjcmV0"
    of a tenant named "==acme" (another salt, another namespace), and the real token was
    unknown."""
    r = reg(tokens="c2VjcmV0LXRva2Vu===acme,dG9rLWI==b")
    assert r.authenticate({"authorization": "Bearer c2VjcmV0LXRva2Vu=="}).name == "acme"
    assert r.authenticate({"authorization": "Bearer dG9rLWI="}).name == "b"
    with pytest.raises(Unauthenticated, match="unknown token"):
        r.authenticate({"authorization": "Bearer c2VjcmV0LXRva2Vu"})


@pytest.mark.parametrize("token", ["tök-1", "tok-2 ", " tok-3", "tok\tx4"])
def test_a_token_no_client_can_send_is_refused_at_start(tmp_path, token):
    """A non-ASCII token was accepted at start and every call with it failed in the gRPC
    client ("Invalid metadata"); one with surrounding spaces worked over raw gRPC only (the
    CLI strips them). Both are refused at start, naming the entry, never the token."""
    f = tmp_path / "tokens.json"
    f.write_text(json.dumps({"ok": "a", token: "b"}))
    with pytest.raises(ValueError, match="entry 2: the token must be printable ASCII") as e:
        reg(tokens_file=str(f))
    assert token.strip() not in str(e.value)
    with pytest.raises(ValueError, match="printable ASCII"):
        reg(tokens=f"{token.strip()}x\u00e9=b")


def test_a_tenant_name_that_is_not_text_is_refused_naming_the_entry(tmp_path):
    """A lone surrogate (JSON "b\\ud800") passed the checks, then failed deriving the salt
    with a message naming neither the file nor the entry."""
    f = tmp_path / "tokens.json"
    f.write_text('{"tok1": {"tenant": "acme"}, "tok2": {"tenant": "b\\ud800"}}')
    with pytest.raises(ValueError, match=r"tokens.json: entry 2: 'tenant' is not valid Unicode"):
        reg(tokens_file=str(f))


def test_a_call_worth_more_prefills_than_the_bucket_allows_is_refused_up_front():
    """A security review: the debt's floor (-burst) bounded the wait after a Warm, not the
    Warm: 32 prefills cost a tenant limited to 1 request/s a ~4 s wait (~8 prefills a
    second). Now a call that would go past the floor is refused before any prefill, its own
    request given back; one past 2 x burst can never run, and is told so."""
    from services.common.errors import Overloaded

    r = reg(tokens="t=a")
    t, clock = limited(r)
    r.check_rate(t)  # the Warm itself: 2 left
    r.afford(t, 5)  # 2 - 5 = -3: at the floor, allowed
    r.charge(t, 5)
    clock.t += 4.0  # -3 + 4 = 1
    r.check_rate(t)  # 0 left
    with pytest.raises(Overloaded, match=r"needs 5 prefills.*: 4 now; retry in 1\.00s"):
        r.afford(t, 4)
    assert r._buckets["a"].tokens == 1.0  # its own request given back
    clock.t += 2.0
    with pytest.raises(ResourceExhausted, match="at most 6 per call") as e:
        r.check_rate(t)
        r.afford(t, 31)
    assert not isinstance(e.value, Overloaded)  # retrying cannot help
    assert r._buckets["a"].tokens == 3.0
    unlimited = reg(tokens="t=a")
    assert unlimited.afford(unlimited.by_token["t"], 10_000) == 0  # no rate limit: no cost


def test_a_changed_tokens_file_is_read_again_and_a_bad_one_leaves_the_old_tokens(tmp_path,
                                                                                  caplog):
    """A security review: a token removed from the file was accepted until every orchestrator
    restarted. Requests under way and rate buckets stay (by tenant)."""
    import logging
    import threading

    from services.orchestrator.tenants import watch_tokens_file

    f = tmp_path / "tokens.json"
    f.write_text(json.dumps({"tok-a": {"tenant": "a"}, "tok-b": {"tenant": "b"}}))
    r = reg(tokens_file=str(f))
    a = r.authenticate({"authorization": "Bearer tok-a"})
    r.acquire(a)  # a request under way across the reload
    stop = threading.Event()

    def refused(token):
        return tenant_of(r, token) is None

    with caplog.at_level(logging.INFO, logger="services.orchestrator.tenants"):
        watch_tokens_file(r, lambda: reg(tokens_file=str(f)), str(f), 0.02, stop)
        time.sleep(0.1)  # the watcher has read the first version
        f.write_text(json.dumps({"tok-a": {"tenant": "a"}, "tok-c": {"tenant": "c"}}))
        assert holds_within(lambda: refused("tok-b"))  # removed: refused
        assert r.authenticate({"authorization": "Bearer tok-c"}).name == "c"  # added
        assert r._active["a"] == 1  # the request under way is still counted
        f.write_text("{not json")  # a bad version: said, the tokens in force stay
        assert holds_within(lambda: "was not taken" in caplog.text)
        f.write_text("{}")  # emptied: never "no tokens, no authentication"
        assert holds_within(lambda: caplog.text.count("was not taken") >= 2)
        assert not refused("tok-a") and not refused("tok-c") and refused("tok-b")
        f.unlink()
        assert holds_within(lambda: "is gone" in caplog.text)
        assert not refused("tok-a")
    stop.set()
    r.release(a)


def test_a_passing_read_error_is_retried_not_taken_as_the_version_seen(tmp_path):
    """A deploy review: a version whose read failed once (EMFILE) was marked seen and never
    taken: the removed token kept working until the file changed again."""
    import threading

    from services.orchestrator.tenants import watch_tokens_file

    f = tmp_path / "tokens.json"
    f.write_text(json.dumps({"tok-a": {"tenant": "a"}}))
    r = reg(tokens_file=str(f))
    failures = [OSError(24, "Too many open files")]

    def build():
        if failures:
            raise failures.pop()
        return reg(tokens_file=str(f))

    stop = threading.Event()
    watch_tokens_file(r, build, str(f), 0.02, stop)
    time.sleep(0.1)
    f.write_text(json.dumps({"tok-b": {"tenant": "b"}}))
    holds_within(lambda: tenant_of(r, "tok-b") is not None)
    stop.set()
    assert not failures
    assert r.authenticate({"authorization": "Bearer tok-b"}).name == "b"
    with pytest.raises(Unauthenticated):
        r.authenticate({"authorization": "Bearer tok-a"})


def test_the_watcher_survives_any_bad_version_and_misses_no_change_after_its_read(tmp_path):
    """A diff review: a file of 200,000 "[" raised RecursionError, which killed the watcher
    (a token removed later kept working); and a change between the start's read and the
    watcher's first look was never read."""
    import threading

    from services.orchestrator.tenants import file_version, watch_tokens_file

    f = tmp_path / "tokens.json"
    f.write_text(json.dumps({"tok-a": {"tenant": "a"}}))
    version = file_version(str(f))  # taken before the start's read, as the app does
    r = reg(tokens_file=str(f))
    f.write_text(json.dumps({"tok-b": {"tenant": "b"}}))  # changed before the watcher starts
    stop = threading.Event()
    t = watch_tokens_file(r, lambda: reg(tokens_file=str(f)), str(f), 0.02, stop, seen=version)

    assert holds_within(lambda: tenant_of(r, "tok-b") == "b")
    f.write_text("[" * 200_000)
    time.sleep(0.2)
    assert t.is_alive()
    f.write_text(json.dumps({"tok-c": {"tenant": "c"}}))
    assert holds_within(lambda: tenant_of(r, "tok-c") == "c")
    with pytest.raises(Unauthenticated):
        r.authenticate({"authorization": "Bearer tok-b"})
    stop.set()


def test_a_tokens_file_under_the_home_folder_is_read_as_checked(tmp_path, monkeypatch):
    """The start's check expanded "~", the read did not: the start failed with a bare
    OSError naming "~/t.json"."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "t.json").write_text(json.dumps({"tok-a": {"tenant": "a"}}))
    assert reg(tokens_file="~/t.json").authenticate(
        {"authorization": "Bearer tok-a"}).name == "a"


def test_a_refund_never_lifts_the_bucket_past_its_burst():
    """A mutation audit: a refund added its request back without the burst's cap, so a call
    refused after the bucket had refilled left the tenant more than `burst` requests to
    spend at once."""
    r = reg(tokens="t=a")
    t, clock = limited(r)
    r.check_rate(t)  # 2 left
    clock.t += 5.0  # refilled to the burst: 3
    r.refund(t)  # the request given back finds the bucket already full
    assert r._buckets["a"].tokens == 3.0


def test_a_call_needing_exactly_twice_the_burst_is_told_to_retry_not_refused_for_good():
    """A mutation audit: `need > 2 * burst` is the line between "retry later" and "never":
    a call needing exactly 2 x burst prefills fits once the bucket is full (burst now, down to
    -burst after), so it must be Overloaded (retryable), not a final RESOURCE_EXHAUSTED."""
    from services.common.errors import Overloaded

    r = reg(tokens="t=a")
    t, _ = limited(r)
    r.check_rate(t)
    r.check_rate(t)  # 1 left
    with pytest.raises(Overloaded, match=r"needs 6 prefills.*retry in "):
        r.afford(t, 5)  # 1 - 5 = -4, past the floor -3; 6 prefills = 2 x burst
    assert r._buckets["a"].tokens == 2.0  # its own request given back


def test_the_watcher_follows_a_tokens_file_under_the_home_folder(tmp_path, monkeypatch):
    """A mutation audit: the watcher must expand "~" as the start's read does; unexpanded,
    "~/t.json" was never readable to it, so every later version went unseen and a token
    removed from the file kept working until a restart."""
    import threading

    from services.orchestrator.tenants import watch_tokens_file

    monkeypatch.setenv("HOME", str(tmp_path))
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"tok-a": {"tenant": "a"}}))
    r = reg(tokens_file="~/t.json")
    stop = threading.Event()
    watch_tokens_file(r, lambda: reg(tokens_file="~/t.json"), "~/t.json", 0.02, stop)
    try:
        time.sleep(0.1)  # the watcher has read the first version
        f.write_text(json.dumps({"tok-b": {"tenant": "b"}}))  # tok-a removed
        holds_within(lambda: tenant_of(r, "tok-a") is None)
        with pytest.raises(Unauthenticated):
            r.authenticate({"authorization": "Bearer tok-a"})
        assert r.authenticate({"authorization": "Bearer tok-b"}).name == "b"
    finally:
        stop.set()


def test_a_short_tenant_token_is_warned_about_naming_only_its_tenant(caplog):
    """A mutation audit: with no weak token ever collected the start said nothing about a
    5-character token anyone may guess. Named by tenant (a), the long token's tenant (b) not
    named, and never the token itself."""
    import logging

    with caplog.at_level(logging.WARNING, logger="services.orchestrator.tenants"):
        reg(tokens="short=a," + "a" * 28 + "=b")
    warned = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert "shorter than 16 characters" in warned[0]
    assert warned[0].endswith("tenants a")
    assert "short" not in warned[0].replace("shorter", "")


def test_a_call_authenticated_before_a_reload_is_held_to_the_limits_read_since(tmp_path):
    """A concurrency review: a call authenticated just before the tokens file was read again
    kept the Tenant it was given, and its acquire compared the tenant's requests under way
    with the old limit: 2 under way with the limit lowered to 1. Its rate went by the old
    one too. Its size limits stay those it was authenticated under (a review of the fix:
    checked against the new ones, a request that never set max_tokens, fitted to the old
    limit, was refused)."""
    from services.common.errors import Overloaded
    from tests.clock import Clock

    f = tmp_path / "tokens.json"
    f.write_text(json.dumps({"tok-c-0123456789abcdef": {"tenant": "c", "max_concurrent": 2}}))
    r = reg(tokens_file=str(f))
    md = {"authorization": "Bearer tok-c-0123456789abcdef"}
    held = r.authenticate(md)
    r.acquire(held)  # one request under way
    late = r.authenticate(md)  # the next call, authenticated before the reload
    f.write_text(json.dumps({"tok-c-0123456789abcdef": {
        "tenant": "c", "max_concurrent": 1, "max_tokens": 8, "rate_per_s": 1, "burst": 1}}))
    r.adopt(reg(tokens_file=str(f)))
    with pytest.raises(Overloaded, match=r"limit 1\)"):
        r.acquire(late)
    assert r._active["c"] == 1
    # Its size limits stay those it was authenticated under: the server fitted an unset
    # max_tokens to them (50), and a reload since must not refuse it.
    r.check_limits(late, 10, 50)
    r.clock = Clock(100.0)
    r.check_rate(late)  # the bucket of the rate read since: one request, then empty
    with pytest.raises(Overloaded, match="rate limit of 1 requests/s"):
        r.check_rate(late)
    r.release(held)
    r.acquire(late)  # a slot free again: the same call is admitted
    assert r._active["c"] == 1


def test_a_call_authenticated_before_its_tenant_was_renamed_is_held_to_the_new_name(tmp_path):
    """A review of the fix above: a reload that moved the token to another tenant name left a
    call authenticated just before under the old name's limit and count, past the new cap
    (acme-eu 1 and acme 1 under way, limit 1). Its slot is released under the name it was
    counted under."""
    from services.common.errors import Overloaded

    tok = "tok-acme-0123456789ab"
    f = tmp_path / "tokens.json"
    f.write_text(json.dumps({tok: {"tenant": "acme", "max_concurrent": 4}}))
    r = reg(tokens_file=str(f))
    md = {"authorization": f"Bearer {tok}"}
    late = r.authenticate(md)  # authenticated before the reload
    early = r.acquire(r.authenticate(md))
    assert early.name == "acme"
    f.write_text(json.dumps({tok: {"tenant": "acme-eu", "max_concurrent": 1}}))
    r.adopt(reg(tokens_file=str(f)))
    fresh = r.acquire(r.authenticate(md))
    assert fresh.name == "acme-eu"
    with pytest.raises(Overloaded, match=r"tenant acme-eu: 1 concurrent requests \(limit 1\)"):
        r.acquire(late)
    r.release(fresh)
    assert r.acquire(late).name == "acme-eu"  # counted under the name it has now
    r.release(early)
    assert r._active == {"acme-eu": 1}  # acme's count left with its last request
    # Renamed again: the first name follows to the last.
    f.write_text(json.dumps({tok: {"tenant": "acme-us", "max_concurrent": 2}}))
    r.adopt(reg(tokens_file=str(f)))
    assert r.acquire(late).name == "acme-us"


def test_a_rename_whose_new_name_is_removed_is_forgotten_and_never_followed_to_a_newcomer(
        tmp_path):
    """Review: `_renamed` kept acme -> acme-eu after acme-eu left the file, for as long as the
    process ran, and a tenant given the name acme-eu later took the limits of the calls
    authenticated as acme: those calls go by the limits they were authenticated with, as a
    removed tenant's do."""
    from services.common.errors import Overloaded

    tok, other = "tok-acme-0123456789ab", "tok-other-0123456789ab"
    f = tmp_path / "tokens.json"

    def load(entries):
        f.write_text(json.dumps(entries))
        return reg(tokens_file=str(f))

    r = load({tok: {"tenant": "acme", "max_concurrent": 2}})
    late = r.authenticate({"authorization": f"Bearer {tok}"})
    r.adopt(load({tok: {"tenant": "acme-eu", "max_concurrent": 1}}))
    assert r._renamed == {"acme": "acme-eu"}
    r.adopt(load({other: {"tenant": "z"}}))  # acme-eu removed
    assert r._renamed == {}
    r.adopt(load({other: {"tenant": "acme-eu", "max_concurrent": 1}}))  # another tenant
    assert [r.acquire(late).name for _ in range(2)] == ["acme", "acme"]  # its own limit, 2
    with pytest.raises(Overloaded, match=r"tenant acme: 2 concurrent requests \(limit 2\)"):
        r.acquire(late)


def test_a_rename_whose_old_name_comes_back_is_forgotten(tmp_path):
    """A rename a -> b stays only while `_now` may follow it: once the file names a tenant a
    again, a's calls go by that tenant (found by name first), and the entry left would send
    them to b's limits once that a is removed."""
    tok, back = "tok-acme-0123456789ab", "tok-back-0123456789ab"
    f = tmp_path / "tokens.json"

    def load(entries):
        f.write_text(json.dumps(entries))
        return reg(tokens_file=str(f))

    r = load({tok: {"tenant": "a"}})
    r.adopt(load({tok: {"tenant": "b"}}))
    assert r._renamed == {"a": "b"}
    r.adopt(load({tok: {"tenant": "b"}, back: {"tenant": "a"}}))
    assert r._renamed == {}
    newcomer = r.authenticate({"authorization": f"Bearer {back}"})
    r.adopt(load({tok: {"tenant": "b", "max_concurrent": 1}}))  # the new a removed
    assert [r.acquire(newcomer).name for _ in range(2)] == ["a", "a"]  # not b's limit of 1


def test_a_removed_tenants_rejection_series_made_after_the_reload_goes_at_the_next(tmp_path):
    """Review: a call authenticated before its tenant was removed and refused after for a
    server-wide reason (server_streams, replicas_busy) made a rejections series of the
    removed name, which no later reload dropped (it dropped only the names the file read
    last had and those with limiter state). The next reload drops every name not in the
    file; the tenants kept keep theirs."""
    from services.orchestrator.tenants import REJECTED
    from tests.metric_sample import sample_value

    tok_a, tok_b = "tok-gone-0123456789ab", "tok-kept-0123456789ab"
    f = tmp_path / "tokens.json"

    def load(entries):
        f.write_text(json.dumps(entries))
        return reg(tokens_file=str(f))

    def series(name, reason):
        return sample_value("tiercache_orchestrator_rejections_total",
                            {"tenant": name, "reason": reason})

    r = load({tok_a: {"tenant": "gone-t"}, tok_b: {"tenant": "kept-t"}})
    late = r.authenticate({"authorization": f"Bearer {tok_a}"})
    r.adopt(load({tok_b: {"tenant": "kept-t"}}))
    REJECTED.labels(late.name, "server_streams").inc()  # as the servicer counts it
    REJECTED.labels(late.name, "replicas_busy").inc()  # as the pipeline does
    REJECTED.labels("kept-t", "replicas_busy").inc()
    r.adopt(load({tok_b: {"tenant": "kept-t"}}))
    assert series("gone-t", "server_streams") is None
    assert series("gone-t", "replicas_busy") is None
    assert series("kept-t", "replicas_busy") == 1
    REJECTED.remove_by_labels({"tenant": "kept-t"})  # the suite's other tests see none


def test_a_tenant_removed_from_the_file_leaves_its_limiter_state_and_rejection_series(
        tmp_path):
    """Review: a tenant removed from the tokens file kept its rate bucket, its concurrency
    count and its tiercache_orchestrator_rejections_total series for as long as the
    orchestrator ran. The reload drops them (a request still under way keeps its count until
    it ends); the tenants kept keep theirs."""
    from services.common.errors import Overloaded
    from services.orchestrator.tenants import REJECTED
    from tests.clock import Clock
    from tests.metric_sample import sample_value

    tok_a, tok_b = "tok-gone-0123456789ab", "tok-kept-0123456789ab"
    f = tmp_path / "tokens.json"
    limits = {"rate_per_s": 1, "burst": 1}
    f.write_text(json.dumps({tok_a: {"tenant": "gone-t", **limits},
                             tok_b: {"tenant": "kept-t", **limits}}))
    r = reg(tokens_file=str(f))
    r.clock = Clock(100.0)
    gone, kept = (r.authenticate({"authorization": f"Bearer {t}"}) for t in (tok_a, tok_b))
    for t in (gone, kept):
        r.check_rate(t)
        with pytest.raises(Overloaded):
            r.check_rate(t)  # counted: reason rate_limit
    held = r.acquire(gone)  # a request of the removed tenant still under way
    r.release(r.acquire(gone))  # and one that ended: an idle count of 0

    def series(name):
        return sample_value("tiercache_orchestrator_rejections_total",
                            {"tenant": name, "reason": "rate_limit"})

    assert series("gone-t") == 1 and series("kept-t") == 1
    f.write_text(json.dumps({tok_b: {"tenant": "kept-t", **limits}}))
    r.adopt(reg(tokens_file=str(f)))
    assert series("gone-t") is None and series("kept-t") == 1
    assert set(r._buckets) == {"kept-t"}
    assert r._active == {"gone-t": 1}  # still under way
    r.release(held)
    assert r._active == {}
    REJECTED.remove_by_labels({"tenant": "kept-t"})  # the suite's other tests see none


def test_a_retry_after_the_wait_an_afford_refusal_names_passes():
    """A differential review: a refused `afford` said "retry in (need - burst - tokens) /
    rate s", but a retry takes its own request (a whole token) before its prefills. With the
    bucket left in debt by another call meanwhile, the retry at that time was refused by its
    rate check (told "retry in 1.00s", then "retry in 2.00s"), and "1 now" counted a prefill
    no call could have. Retried after the wait named, it passes."""
    from services.common.errors import Overloaded

    r = reg(tokens="t=a")
    t, clock = limited(r)
    r.check_rate(t)  # this Warm's request: 2 left
    r.charge(t, 5)  # another Warm of the tenant, charged meanwhile: -3, the floor
    with pytest.raises(Overloaded, match=r"needs 2 prefills.*: 0 now; retry in 3\.00s"):
        r.afford(t, 1)  # -4 is past the floor: refused, its request given back (-2)
    clock.t += 3.0
    r.check_rate(t)
    assert r.afford(t, 1) == 1


def test_a_debt_run_up_before_a_reload_is_waited_out_under_the_limits_read_since(tmp_path):
    """A differential review: the bucket kept a debt run up under a burst a reload then
    lowered, refilled at the new rate: a tenant cut from 4/s and a burst of 8 to 0.25/s and 1
    after a Warm of 15 prefills waited 36 s, past `charge`'s bound of (burst + 1) / rate_per_s
    (8 s). The debt's floor is the burst now."""
    from services.common.errors import Overloaded
    from tests.clock import Clock

    tok = "tok-a-0123456789abcdef"
    f = tmp_path / "tokens.json"
    f.write_text(json.dumps({tok: {"tenant": "a", "rate_per_s": 4, "burst": 8}}))
    r = reg(tokens_file=str(f))
    r.clock = clock = Clock(100.0)
    t = r.authenticate({"authorization": f"Bearer {tok}"})
    r.check_rate(t)  # 7 left
    assert r.afford(t, 15) == 15  # -8: the floor of a burst of 8
    f.write_text(json.dumps({tok: {"tenant": "a", "rate_per_s": 0.25, "burst": 1}}))
    r.adopt(reg(tokens_file=str(f)))
    with pytest.raises(Overloaded, match=r"retry in 8\.00s"):
        r.check_rate(t)  # -1 now, the new floor: 2 requests' worth at 0.25/s
    clock.t += 8.0
    r.check_rate(t)
