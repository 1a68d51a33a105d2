"""A differential review of `services.common.addresses` (`canonical_address`, `shard_fingerprint`,
`ShardRing`) with the start-up check of address lists (`config.require_addresses`), against a
model of the module docstring: seeded random shard targets, each written in random spellings.

The model names a target by what it is, not by its text: a host name by its labels with ASCII
letters folded (DNS compares only those without regard to case, RFC 4343) and a trailing dot
dropped; an IPv4 address as written (a leading zero may be octal to some resolvers: not
folded); a bracketed IPv6 address by `ipaddress.IPv6Address` (zone kept); an `xds:` target by
its text; a port by its number. A spelling of a target adds surrounding whitespace, random
ASCII case of a name, a trailing dot, `dns:`, `dns:///` or `dns://server/` (or `ipv4:`,
`ipv6:` for an address), any IPv6 spelling (exploded, upper case, leading zeros, dotted IPv4
tail) and leading zeros of the port. Targets are drawn from small pools so that near misses
are frequent: `localhost` and `127.0.0.1`, `prefix-0` and `prefix-0.prefix`, names differing
in one label or one non-ASCII letter's case (the Kelvin sign K and k), `::1` and `::2`.

Checked: every spelling passes the start-up check; all spellings of a target have one
canonical form and two targets never share one; a list's fingerprint is equal on two sides
exactly when their sets of targets are equal (any spellings, order, repeats, blank entries),
and then every key lands on the same target on both sides' ShardRing; a list naming one target
twice in any spelling is refused (ShardRing and the start-up check), one naming distinct
targets is not. Addresses that are not host:port (empty host or port, a non-digit port, a
port past 65535, a space, comma, semicolon or slash in the host, a bare IPv6 address, a URL)
are refused at start, and `canonical_address` gives them back only stripped (its docstring).

Run: 20,000 seeds (1,000 here, about 1 s), 0 divergent after the fix; before it 1,093 of 3,000.
Found, fixed in addresses.py/config.py and guarded in tests/test_addresses_rules.py: a host's
non-ASCII letters were case-folded (`\\u212a-0:1`, the Kelvin sign, was the same shard as
`k-0:1`, another DNS name); `dns://host:port` (an authority and no host, which gRPC refuses:
"no server name supplied in dns URI") passed the start-up check, and its canonical form was ""
for every host, so two of them were "the same shard"; what is not host:port after a scheme came
back without the scheme, not only stripped. Not changed (the docs say so): a trailing dot is
folded, though `name.` skips the resolver's search list (`localhost.` did not resolve here).
Injected bugs caught (seeds of 1,000): no trailing-dot strip (724), IPv6 exploded (192), the
dns authority kept (968), port zeros kept (979), `ipv4:` kept (500), the fingerprint unsorted
(368), str.lower() for the ASCII fold (10), the ring keyed by the given text (782). More seeds:
TIERCACHE_ADDRESSES_DIFF_SEEDS=20000, or `python tests/test_addresses_differential.py START
COUNT`.
"""

from __future__ import annotations

import ipaddress
import os
import random

import pytest

from services.common.addresses import ShardRing, canonical_address, shard_fingerprint
from services.common.config import ConfigError, require_addresses

SEEDS = int(os.environ.get("TIERCACHE_ADDRESSES_DIFF_SEEDS", "1000"))

NAMES = ["prefix-0", "prefix-0.prefix", "prefix-1.prefix", "prefix-0.prefix.svc",
         "localhost", "kv", "kv-0", "k-0", "\u212a-0", "\u00e4-0", "\u00c4-0", "semantic-0.x",
         "a", "b.c", "xn--4ca-0"]
IPV4 = ["127.0.0.1", "127.0.0.2", "10.0.0.1", "0.0.0.1", "127.0.0.01"]
IPV6 = ["::1", "::2", "fd00::1", "fd00::1:0", "2001:db8::1", "2001:db8:0:0:1::1",
        "::ffff:1.2.3.4", "::ffff:1.2.3.5", "fe80::1%eth0", "fe80::1%eth1", "1:2:3:4:5:6:7:8"]
XDS = ["xds:///Prefix-Svc", "xds:///prefix-svc", "xds:///a"]
PORTS = [1, 53, 50053, 50054, 65535]


# ---------------------------------------------------------------- the model


def target(rng: random.Random) -> tuple:
    """A shard as the model names it: (kind, identity, port)."""
    kind = rng.choice(["name", "name", "v4", "v6", "xds"])
    port = rng.choice(PORTS)
    if kind == "name":
        labels = rng.choice(NAMES).split(".")
        return ("name", tuple(_ascii_lower(x) for x in labels), port)
    if kind == "v4":
        return ("v4", rng.choice(IPV4), port)
    if kind == "v6":
        return ("v6", ipaddress.IPv6Address(rng.choice(IPV6)), port)
    return ("xds", rng.choice(XDS), port)


def _ascii_lower(s: str) -> str:
    return "".join(c.lower() if "A" <= c <= "Z" else c for c in s)


def _random_case(rng: random.Random, s: str) -> str:
    return "".join(c.upper() if "a" <= c <= "z" and rng.random() < 0.4 else c for c in s)


def _v6_spelling(rng: random.Random, ip: ipaddress.IPv6Address) -> str:
    zone = ip.scope_id
    base = ipaddress.IPv6Address(int(ip)).exploded  # (exploded fails on a zone in 3.11)
    groups = base.split(":")
    r = rng.random()
    if r < 0.25:
        s = str(ipaddress.IPv6Address(base))
    elif r < 0.5:
        s = ":".join(g.lstrip("0").rjust(rng.randint(1, 4), "0") or "0" for g in groups)
    elif r < 0.7 and ip.ipv4_mapped is not None:
        s = f"::ffff:{ip.ipv4_mapped}"
    else:  # compress one random run of zero groups
        zeros = [i for i, g in enumerate(groups) if int(g, 16) == 0]
        if zeros:
            a = rng.choice(zeros)
            b = a
            while b + 1 < 8 and int(groups[b + 1], 16) == 0 and rng.random() < 0.8:
                b += 1
            s = ":".join(groups[:a]) + "::" + ":".join(groups[b + 1:])
        else:
            s = base
    if rng.random() < 0.5:
        s = s.upper()
    return s + (f"%{zone}" if zone else "")


def spell(rng: random.Random, t: tuple) -> str:
    """One random spelling of target `t` (a valid address to dial)."""
    kind, ident, port = t
    if kind == "xds":  # kept as written: only whitespace around it
        return f"{_ws(rng)}{ident}:{port}{_ws(rng)}"
    port_text = "0" * rng.choice([0, 0, 1, 3]) + str(port)
    if kind == "name":
        host = _random_case(rng, ".".join(ident))
        if rng.random() < 0.3:
            host += "."
        schemes = ["", "dns:", "dns:///", "dns://8.8.8.8/", "dns://[::1]:53/"]
    elif kind == "v4":
        host = ident
        schemes = ["", "dns:", "dns:///", "ipv4:"]
    else:
        host = f"[{_v6_spelling(rng, ident)}]"
        schemes = ["", "dns:///", "ipv6:"]
    return f"{_ws(rng)}{rng.choice(schemes)}{host}:{port_text}{_ws(rng)}"


def _ws(rng: random.Random) -> str:
    return rng.choice(["", "", "", " ", "\t", "  \n"])


def bad_address(rng: random.Random) -> str:
    """Something that is not host:port (refused at start)."""
    host = rng.choice(["kv", "[::1]", "127.0.0.1", "dns:///kv"])
    return rng.choice([
        f"{host}:", f":{rng.choice(PORTS)}", f"{host}:x1",
        f"{host}:1 2", "kv 1:1", "kv,1:1", "a:1;b:2", "a/b:1", "http://kv:1", "fd00::1:50054",
        f"{host}:\u0661", "kv", "", "unix:/tmp/sock:1",
        f"dns://{rng.choice(['kv', '[::1]', '127.0.0.1', 'Kv.'])}:{rng.choice(PORTS)}",
    ])


# ---------------------------------------------------------------- the comparison


def _refused(addresses) -> bool:
    try:
        require_addresses(addresses, "demo", "peers", allow_none=False)
    except ConfigError:
        return True
    return False


def check_seed(seed: int) -> None:
    rng = random.Random(seed)
    pool = {target(rng) for _ in range(rng.randint(2, 12))}
    canon: dict[str, tuple] = {}
    by_target: dict[tuple, set] = {}
    for t in pool:
        for _ in range(rng.randint(1, 4)):
            s = spell(rng, t)
            assert not _refused([s]), s
            c = canonical_address(s)
            assert canon.setdefault(c, t) == t, (s, c, t, canon[c])  # distinct never collide
            by_target.setdefault(t, set()).add(c)
    for t, cs in by_target.items():
        assert len(cs) == 1, (t, cs)  # one target, one canonical form

    targets = sorted(pool, key=repr)
    a = set(rng.sample(targets, rng.randint(1, len(targets))))
    b = set(a) if rng.random() < 0.5 else set(rng.sample(targets, rng.randint(1, len(targets))))
    model_of: dict[str, tuple] = {}  # each spelling's target, as the model knows it

    def spelled(t: tuple) -> str:
        x = spell(rng, t)
        model_of[x] = t
        return x

    side_a = [spelled(t) for t in a]
    side_b = [spelled(t) for t in b]
    rng.shuffle(side_a)
    rng.shuffle(side_b)
    noisy_b = side_b + [spelled(rng.choice(sorted(b, key=repr)))
                        for _ in range(rng.randint(0, 2))] + rng.choice([[], [""], ["  "]])
    rng.shuffle(noisy_b)
    assert (shard_fingerprint(side_a) == shard_fingerprint(noisy_b)) == (a == b)
    if a == b:
        ra, rb = ShardRing(side_a), ShardRing(side_b)
        for k in range(40):
            key = f"key-{seed}-{k}"
            assert model_of[ra.lookup(key)] == model_of[rb.lookup(key)]
            assert ra.lookup(key) in side_a and rb.lookup(key) in side_b
    if len(noisy_b) - sum(not x.strip() for x in noisy_b) > len(b):  # a target twice
        with pytest.raises(ValueError):
            ShardRing([x for x in noisy_b if x.strip()])
        assert _refused(noisy_b)
    else:
        assert not _refused(noisy_b)

    for _ in range(3):
        bad = _ws(rng) + bad_address(rng) + _ws(rng)
        assert _refused([bad]) or not bad.strip(), bad
        assert canonical_address(bad) == bad.strip(), bad
    for port in (0, 65536, 10**6):  # host:port, its port past the range: only refused
        host = rng.choice(["kv", "[::1]", "127.0.0.1", "dns:///kv", "ipv4:127.0.0.1"])
        assert _refused([f"{host}:{port}"])


@pytest.mark.parametrize("chunk", range(2))
def test_spellings_fold_and_targets_stay_apart(chunk):
    for seed in range(chunk, SEEDS, 2):
        try:
            check_seed(seed)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}") from None


if __name__ == "__main__":
    import sys

    start, n = int(sys.argv[1]), int(sys.argv[2])
    fails = 0
    for seed in range(start, start + n):
        try:
            check_seed(seed)
        except (Exception, pytest.fail.Exception) as e:  # noqa: BLE001 - counted and shown
            fails += 1
            if fails <= 8:
                print(f"seed {seed}: {type(e).__name__} {e}"[:300])
    print(f"{fails} of {n} seeds failed")
