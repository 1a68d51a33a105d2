"""Rules of `services.common.addresses` that the mutation audit found unguarded: a scheme
other than dns:/ipv4:/ipv6: is kept as written, and a list's fingerprint counts each shard
once however often and however it is spelled."""

from __future__ import annotations

from services.common.addresses import canonical_address, shard_fingerprint


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
