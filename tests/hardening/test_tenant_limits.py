"""Per-tenant rate limit (token bucket) and the admin-only cluster Stats, without a network."""

from __future__ import annotations

import json

import pytest

from services.common.errors import PermissionDenied, ResourceExhausted
from services.orchestrator.tenants import TenantRegistry
from tests.clock import Clock


def registry(tmp_path, spec: dict) -> TenantRegistry:
    f = tmp_path / "tokens.json"
    f.write_text(json.dumps(spec))
    return TenantRegistry.build(tokens_file=str(f), tokens="", key=b"k", max_prompt_tokens=100,
                                max_tokens=50, max_concurrent=4)


def test_token_bucket_allows_a_burst_then_refills_at_the_rate(tmp_path):
    r = registry(tmp_path, {"t": {"tenant": "a", "rate_per_s": 2, "burst": 3},
                            "u": {"tenant": "b"}})
    r.clock = clock = Clock(100.0)
    a = r.authenticate({"authorization": "Bearer t"})
    b = r.authenticate({"authorization": "Bearer u"})
    for _ in range(3):
        r.check_rate(a)
    with pytest.raises(ResourceExhausted, match="rate limit"):
        r.check_rate(a)
    for _ in range(50):  # another tenant is not metered by a's bucket (and b has no limit)
        r.check_rate(b)
    clock.t += 0.5  # one request's worth at 2/s
    r.check_rate(a)
    with pytest.raises(ResourceExhausted):
        r.check_rate(a)
    clock.t += 100.0  # refills only up to the burst
    for _ in range(3):
        r.check_rate(a)
    with pytest.raises(ResourceExhausted):
        r.check_rate(a)


def test_a_refused_request_does_not_consume_a_token(tmp_path):
    r = registry(tmp_path, {"t": {"tenant": "a", "rate_per_s": 1, "burst": 1}})
    r.clock = clock = Clock(100.0)
    a = r.authenticate({"authorization": "Bearer t"})
    r.check_rate(a)
    for _ in range(5):
        with pytest.raises(ResourceExhausted):
            r.check_rate(a)
    clock.t += 1.0
    r.check_rate(a)  # refusals did not push the next allowed request further away


@pytest.mark.parametrize("spec", [{"tenant": "a", "rate_per_s": -1},
                                  {"tenant": "a", "rate_per_s": 1, "burst": 0}])
def test_bad_rate_settings_fail_at_boot(tmp_path, spec):
    with pytest.raises(ValueError, match="rate_per_s|burst"):
        registry(tmp_path, {"t": spec})


def test_cluster_stats_need_an_admin_token(tmp_path):
    r = registry(tmp_path, {"t": {"tenant": "a"}, "ops": {"tenant": "ops", "admin": True}})
    a = r.authenticate({"authorization": "Bearer t"})
    ops = r.authenticate({"authorization": "Bearer ops"})
    with pytest.raises(PermissionDenied, match="admin"):
        r.require_admin(a, "cluster stats")
    r.require_admin(ops, "cluster stats")
    # An unauthenticated local stack has one caller, who is also its operator.
    local = TenantRegistry.build(tokens_file="", tokens="", key=b"k", max_prompt_tokens=1,
                                 max_tokens=1, max_concurrent=1)
    local.require_admin(local.authenticate({}), "cluster stats")


def test_semantic_entry_references_are_signed_per_tenant(tmp_path):
    r = registry(tmp_path, {"t": {"tenant": "a"}, "u": {"tenant": "b"}})
    a = r.authenticate({"authorization": "Bearer t"})
    b = r.authenticate({"authorization": "Bearer u"})
    ref = r.entry_ref(a, "0123abcd")
    assert r.entry_id(a, ref) == "0123abcd"
    assert r.entry_id(b, ref) is None  # b cannot rate or invalidate a's entry
    assert r.entry_id(a, "0123abcd") is None  # a bare id is not a reference
    assert r.entry_id(b, ref.split(".")[0] + "." + "0" * 16) is None
    assert r.entry_ref(a, "") == ""


def test_a_charge_goes_into_debt_of_at_most_one_burst(tmp_path):
    """A 64-prompt Warm on 4 replicas left a tenant at -246 tokens: every RPC refused for
    four minutes. The debt now stops at -burst."""
    r = registry(tmp_path, {"t": {"tenant": "a", "rate_per_s": 1, "burst": 10}})
    r.clock = clock = Clock(100.0)
    a = r.authenticate({"authorization": "Bearer t"})
    r.check_rate(a)
    r.charge(a, 255)
    clock.t += 10.5  # -10 + 10.5 = 0.5: not yet
    with pytest.raises(ResourceExhausted, match=r"retry in 0\.50s"):
        r.check_rate(a)
    clock.t += 0.5
    r.check_rate(a)
