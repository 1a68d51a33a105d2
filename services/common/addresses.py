"""Shard addresses as placement sees them: one spelling per shard, and a fingerprint of a list.

Shards are placed on a consistent-hash ring keyed by their address, and each side that places
(kvpool publishing chains, the orchestrator looking them up) builds its own ring from its own
configuration. Keyed by the text as written, `prefix-0.prefix:50053` on one side and
`dns:///Prefix-0.prefix.:50053` on the other were two different shards: chains went to one and
their lookups to another, without an error. `canonical_address` folds the spellings that name
the same target for certain (whitespace, letter case of a host name, a trailing dot, a `dns:`
or `ipv4:`/`ipv6:` scheme, the spelling of an IPv6 address, leading zeros of a port); the
address is still dialed as given. Names that may or may not resolve to the same host
(`localhost` and `127.0.0.1`, a short and a fully qualified name) stay apart: only the
configuration can say, and `shard_fingerprint` lets a shard see when two sides disagree.
"""

from __future__ import annotations

import ipaddress
import string
from collections.abc import Iterable
from hashlib import blake2b

from services.common.ring import HashRing


def canonical_address(address: str) -> str:
    """`address` in the one spelling placement uses (see the module docstring); something
    that is not host:port comes back only stripped (validation refuses it elsewhere).

    `dns:[//authority/]host:port`, `ipv4:` and `ipv6:` name the host:port after them (the
    authority is the DNS server asked, not the shard); other schemes (`xds:`) are kept.
    Only ASCII letters are folded: DNS compares no others without regard to case (RFC 4343),
    and `\u212a` (the Kelvin sign) folds to an ASCII `k`.
    """
    stripped = a = address.strip()
    scheme, _, rest = a.partition(":")
    scheme = scheme.lower()
    if ":" in rest:  # else `dns:53` is the host "dns", port 53
        if scheme == "xds":
            return a
        named = target_host(a)
        if named == "":  # dns://host:port: an authority and no host (gRPC refuses it)
            return stripped
        if named is not None:
            a = named
    host, sep, port = a.rpartition(":")
    if not (sep and host and port.isascii() and port.isdigit()):
        return stripped
    if host.startswith("[") and host.endswith("]"):
        try:
            host = f"[{ipaddress.IPv6Address(host[1:-1]).compressed}]"
        except ValueError:
            host = host.translate(_ASCII_LOWER)
    else:
        host = host.translate(_ASCII_LOWER)
        if len(host) > 1 and host.endswith("."):
            host = host[:-1]  # the DNS root: "name." and "name" are the same fully qualified name
    return f"{host}:{int(port)}"


_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def target_host(target: str) -> str | None:
    """What a gRPC target names after its scheme (`dns:///name`, `dns://dns-server/name`,
    `dns:name`, `ipv4:` and `ipv6:` addresses; the scheme in any case): "" when it names
    nothing (`dns:///`, or `dns://x` whose x is the DNS server to ask); None for another
    scheme, or for none. Given a whole address, the host:port after the scheme; given the part
    before the port, the host."""
    scheme, _, rest = target.partition(":")
    scheme = scheme.lower()
    if scheme == "dns":
        return rest[2:].partition("/")[2] if rest.startswith("//") else rest
    return rest if scheme in ("ipv4", "ipv6") else None


def shard_fingerprint(addresses: Iterable[str]) -> str:
    """A short digest of the shard list as placement sees it (canonical, sorted, each once):
    equal on two sides exactly when both place every key on the same shard."""
    canon = sorted({canonical_address(a) for a in addresses if a.strip()})
    return blake2b("\n".join(canon).encode(), digest_size=8).hexdigest()


class ShardRing:
    """A consistent-hash ring of shard addresses placed by their canonical spelling: `lookup`
    gives the address as configured (the one to dial), so two sides that spell a shard
    differently still place every key on it.

    Raises:
        ValueError: two addresses are the same shard spelled differently (or twice the same).
    """

    def __init__(self, addresses: Iterable[str]) -> None:
        self._given: dict[str, str] = {}
        for a in addresses:
            c = canonical_address(a)
            if c in self._given:
                raise ValueError(f"{self._given[c]!r} and {a!r} are the same shard")
            self._given[c] = a
        self._ring = HashRing(self._given)

    def lookup(self, key: bytes | str) -> str:
        """The configured address of the shard that owns `key`.

        Raises:
            LookupError: the ring is empty.
        """
        return self._given[self._ring.lookup(key)]
