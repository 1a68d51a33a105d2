import json

import pytest

from services.common.errors import ResourceExhausted, Unauthenticated
from services.orchestrator.tenants import TenantRegistry

KEY = b"k"


def reg(**kw):
    base = dict(tokens_file="", tokens="", key=KEY, max_prompt_tokens=100, max_tokens=50,
                max_concurrent=2)
    base.update(kw)
    return TenantRegistry.build(**base)


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
                                    ({"authorization": "Bearer nope"}, "unknown token")])
def test_bad_credentials_are_unauthenticated(md, msg):
    with pytest.raises(Unauthenticated, match=msg):
        reg(tokens="tok-a=a").authenticate(md)


def test_limits():
    r = reg(tokens="t=a")
    a = r.authenticate({"authorization": "Bearer t"})
    with pytest.raises(ResourceExhausted, match="prompt"):
        r.check_limits(a, 101, 10)
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
