"""Consistent-hash ring with virtual nodes and bounded-load lookup.

Each node is placed on a 64-bit ring at `vnodes` points (BLAKE2b-64 of "name#i", i < vnodes, read
big-endian; equal points are ordered by node name). A key belongs to the first point strictly
clockwise from the key's own hash (a point equal to the key's hash is a full turn away):

    0 ──●a──────●b────k──●a──────●c───── 2^64   (k -> a)

Adding or removing one node moves only ~1/N of the keys. `lookup_bounded` is "consistent
hashing with bounded loads" (Mirrokni et al.): walk clockwise from the key and take the first
node whose load, counting this request, stays within (1 + epsilon) x the mean load counting this
request; keys stick to their node until it is overloaded, then spill to the next distinct node.

Used by the orchestrator for session affinity and by the prefix-index client to pick a shard.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Container, Iterable, Iterator, Mapping
from hashlib import blake2b

DEFAULT_VNODES = 100


def load_cap(total: float, nodes: int, epsilon: float) -> int:
    """ceil((1 + epsilon) x total / nodes): the most load a node may reach under the bounded-
    load rule, `total` counting the request being placed. The 1e-9 keeps a product that is
    whole in exact arithmetic from rounding up a whole request (1.1 x 50 / 5 is
    11.000000000000002 in floating point)."""
    return math.ceil((1.0 + epsilon) * total / max(1, nodes) - 1e-9)


def _point(data: bytes) -> int:
    return int.from_bytes(blake2b(data, digest_size=8).digest(), "big")


def _key_bytes(key: bytes | str) -> bytes:
    return key.encode() if isinstance(key, str) else bytes(key)


class HashRing:
    """A ring of named nodes; not thread-safe for concurrent add/remove (lookups are fine)."""

    def __init__(self, nodes: Iterable[str] = (), vnodes: int = DEFAULT_VNODES) -> None:
        if vnodes <= 0:
            raise ValueError("vnodes must be > 0")
        self.vnodes = vnodes
        self._nodes: set[str] = set()
        self._points: list[int] = []  # sorted
        self._owners: list[str] = []  # owner of _points[i]
        for n in nodes:
            self.add(n)

    @property
    def nodes(self) -> list[str]:
        """Node names, sorted."""
        return sorted(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node: object) -> bool:
        return node in self._nodes

    def add(self, node: str) -> None:
        """Place `node` on the ring (no-op if present)."""
        if node in self._nodes:
            return
        self._nodes.add(node)
        for i in range(self.vnodes):
            p = _point(f"{node}#{i}".encode())
            at = bisect.bisect_left(self._points, p)
            # Ties between two nodes' points are broken by name so every ring agrees.
            while at < len(self._points) and self._points[at] == p and self._owners[at] < node:
                at += 1
            self._points.insert(at, p)
            self._owners.insert(at, node)

    def remove(self, node: str) -> None:
        """Take `node` off the ring (no-op if absent)."""
        if node not in self._nodes:
            return
        self._nodes.discard(node)
        keep = [(p, o) for p, o in zip(self._points, self._owners, strict=True) if o != node]
        self._points = [p for p, _ in keep]
        self._owners = [o for _, o in keep]

    def _start(self, key: bytes | str) -> int:
        if not self._nodes:
            raise LookupError("the ring has no nodes")
        at = bisect.bisect_right(self._points, _point(_key_bytes(key)))
        return at if at < len(self._points) else 0

    def lookup(self, key: bytes | str) -> str:
        """The node owning `key`.

        Raises:
            LookupError: the ring is empty.
        """
        return self._owners[self._start(key)]

    def preference(self, key: bytes | str) -> list[str]:
        """Every node once, in clockwise order from `key` (owner first): the failover order."""
        return list(self._walk(key))

    def _walk(self, key: bytes | str) -> Iterator[str]:
        # Lazy: a bounded lookup usually stops at the first or second node; building the whole
        # order costs ~N*ln(N)*vnodes steps (seconds per lookup at hundreds of nodes).
        at = self._start(key)
        seen: set[str] = set()
        n = len(self._points)
        owners = self._owners
        for i in range(n):
            o = owners[(at + i) % n]
            if o not in seen:
                seen.add(o)
                yield o
                if len(seen) == len(self._nodes):
                    return

    def lookup_bounded(self, key: bytes | str, loads: Mapping[str, float],
                       epsilon: float = 0.25, prefer: Container[str] | None = None, *,
                       floor: int = 0, skip: Container[str] = ()) -> str:
        """The first node clockwise from `key` that can take one more request.

        A node qualifies when `loads[node] + 1 <= ceil((1 + epsilon) * (sum(loads) + 1) / N)`, N
        the number of nodes on the ring and the sum over those nodes (nodes missing from `loads`
        count as 0, names in `loads` that are not on the ring are ignored), or when
        `loads[node] <= floor` (a node running that few requests is never full: with many
        nodes and little traffic the ceiling is 1, and one request in flight pushed a session
        off its node). Nodes in `skip` are passed over and not counted (a request's failed
        replicas: removing them from the ring and adding them back rebuilt it). The ceiling is
        the usual bounded-load rule: without it, at low load one request in flight on a node
        (or a stale load figure) would push its sessions elsewhere. With whole-number loads
        some node always qualifies, whatever epsilon (the least loaded one is at most the
        mean); should none (fractional loads, e.g. 100 nodes at 0.9 and epsilon 0.01), the
        least loaded node, the first of those in preference order, is returned. With `prefer`,
        qualifying nodes in it come first (still in clockwise order), then any qualifying node.

        Raises:
            LookupError: the ring is empty.
            ValueError: epsilon < 0.
        """
        if epsilon < 0:
            raise ValueError("epsilon must be >= 0")
        nodes = [n for n in self._nodes if n not in skip] if skip else list(self._nodes)
        if not nodes:
            raise LookupError("every node of the ring is skipped")
        total = sum(float(loads.get(n, 0.0)) for n in nodes) + 1.0
        cap = max(load_cap(total, len(nodes), epsilon), floor + 1)
        fallback = None
        for n in self._walk(key):
            if skip and n in skip:
                continue
            if float(loads.get(n, 0.0)) + 1.0 <= cap + 1e-9:
                if prefer is None or n in prefer:
                    return n
                if fallback is None:  # not `or`: a node may be named ""
                    fallback = n
        if fallback is not None:
            return fallback
        return min((n for n in self.preference(key) if not skip or n not in skip),
                   key=lambda n: float(loads.get(n, 0.0)))

