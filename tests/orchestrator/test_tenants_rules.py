"""Tenant limits' rules at their edges (pure logic: the real TenantRegistry)."""

from __future__ import annotations

import pytest

from services.common.errors import Overloaded
from services.orchestrator.tenants import TenantRegistry


def test_a_tenant_past_its_concurrent_requests_is_told_what_to_do():
    """Every other "retry later" refusal says when ("retry in N s", "retry shortly or on
    another orchestrator", "retry later"); the tenant's concurrency limit named only the
    limit, so a client hitting it in a burst could not tell it from a fixed one by its
    message."""
    reg = TenantRegistry.build(tokens_file="", tokens="tok-acme=acme", key=b"k",
                               max_prompt_tokens=100, max_tokens=16, max_concurrent=1)
    acme = reg.authenticate({"authorization": "Bearer tok-acme"})
    held = reg.acquire(acme)
    with pytest.raises(Overloaded, match=r"\(limit 1\); retry when one of them ends$"):
        reg.acquire(acme)
    reg.release(held)
    reg.release(reg.acquire(acme))  # the slot freed: taken again
