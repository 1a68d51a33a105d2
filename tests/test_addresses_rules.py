"""Rules of `services.common.addresses` that the mutation audit found unguarded: a scheme
other than dns:/ipv4:/ipv6: is kept as written, and a list's fingerprint counts each shard
once however often and however it is spelled. And those test_addresses_differential.py found
broken: non-ASCII letters folded, `dns://host:port` passed as a shard (all of them one)."""

from __future__ import annotations

import pytest

from services.common.addresses import canonical_address, shard_fingerprint
from services.common.config import ConfigError, is_host_port, require_addresses


def test_an_xds_target_is_kept_as_written():
    """`xds:` names a resource the control plane resolves, not a host: its letter case and
    its spelling are kept, port and all."""
    assert canonical_address("xds:///Prefix-Svc:50053") == "xds:///Prefix-Svc:50053"
    assert canonical_address(" XDS:///Prefix-Svc:050053 ") == "XDS:///Prefix-Svc:050053"


def test_a_fingerprint_counts_each_shard_once():
    """Canonical, sorted, each once: a shard named twice (or two spellings of it) fingerprints
    as the list that names it once."""
    one = shard_fingerprint(["prefix-0:1", "prefix-1:1"])
    assert shard_fingerprint(["prefix-1:1", "prefix-0:1", "PREFIX-0.:1"]) == one
    assert shard_fingerprint(["prefix-0:1", "prefix-0:1", "prefix-1:1"]) == one
    assert shard_fingerprint(["prefix-0:1"]) != one


def test_only_ascii_letters_of_a_host_are_folded():
    """DNS compares only ASCII letters without regard to case (RFC 4343): the Kelvin sign
    (which str.lower() turns into an ASCII k) and an upper-case umlaut name other hosts."""
    assert canonical_address("\u212a-0:1") != canonical_address("k-0:1")
    assert canonical_address("\u00c4-0:1") != canonical_address("\u00e4-0:1")
    assert canonical_address("PREFIX-\u00c4:1") == "prefix-\u00c4:1"


def test_a_dns_target_with_an_authority_and_no_host_is_refused_not_one_shard():
    """`dns://x:1` reads x:1 as the DNS server and names no host (gRPC: "no server name
    supplied in dns URI"): refused at start, and given back as written, not as "" for all."""
    assert canonical_address(" dns://kv-0:1 ") == "dns://kv-0:1"
    assert canonical_address("dns://kv-0:1") != canonical_address("dns://kv-1:1")
    with pytest.raises(ConfigError, match="three slashes"):
        require_addresses(["dns://kv-0:1"], "demo", "peers", allow_none=False)
    require_addresses(["dns://10.0.0.10:53/kv-0:1"], "demo", "peers", allow_none=False)


def test_what_is_not_host_port_comes_back_only_stripped():
    """A scheme is not taken off something that is not host:port after it."""
    for a in ("dns:///kv:", "ipv4:kv:x", "dns:///kv:1 2"):
        assert canonical_address(f"  {a}\t") == a


@pytest.mark.parametrize(("target", "with_host"), [
    ("dns:///:1", "dns:///h:1"), ("dns://10.0.0.10:53/:1", "dns://10.0.0.10:53/h:1"),
    ("dns::1", "dns:h:1"), ("ipv4::1", "ipv4:10.0.0.1:1")])
def test_a_target_naming_no_host_is_refused_at_start(target, with_host):
    """A gRPC target with nothing between its scheme (and DNS server) and its port passed the
    start-up check, and failed only when dialed, once the model had loaded."""
    assert not is_host_port(target)
    with pytest.raises(ConfigError, match="names no host before its port"):
        require_addresses([target], "demo", "peers", allow_none=False)
    assert is_host_port(with_host)
