"""The bounded router's consistent-hash ring: an owner is the first point
at or after the key's position; the ring depends on the set of addresses
only; keys spread evenly; a pod joining or leaving moves only its keys."""

from __future__ import annotations

import bisect
import hashlib

import pytest

from gateway.hash_ring import VIRTUAL_NODES, HashRing

ADDRESSES = [f"10.0.{i // 200}.{i % 200 + 1}:50061" for i in range(64)]
KEYS = [hashlib.sha256(str(i).encode()).digest() for i in range(20_000)]


def _position(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def test_the_owner_is_the_first_point_at_or_after_the_key():
    ring = HashRing(ADDRESSES[:8])
    points = sorted((_position(f"{a}#{i}".encode()), a) for a in ADDRESSES[:8] for i in range(VIRTUAL_NODES))
    for key in KEYS[:500]:
        at = bisect.bisect_left([p for p, _ in points], _position(key)) % len(points)
        assert ring.owner(key) == points[at][1]


def test_the_ring_depends_on_the_set_of_addresses_not_their_order():
    forward, backward = HashRing(ADDRESSES), HashRing(ADDRESSES[::-1])
    assert all(forward.owner(k) == backward.owner(k) for k in KEYS[:2000])
    index = forward.owner_index(KEYS[0])
    assert forward.addresses[index] == forward.owner(KEYS[0])


def test_keys_spread_over_the_pods():
    ring = HashRing(ADDRESSES)
    counts = {a: 0 for a in ADDRESSES}
    for key in KEYS:
        counts[ring.owner(key)] += 1
    fair = len(KEYS) / len(ADDRESSES)
    assert min(counts.values()) > 0.5 * fair and max(counts.values()) < 1.6 * fair


def test_a_pod_leaving_or_joining_moves_only_its_own_keys():
    before = HashRing(ADDRESSES)
    after = HashRing(ADDRESSES[1:])  # ADDRESSES[0] left
    for key in KEYS[:5000]:
        if before.owner(key) != ADDRESSES[0]:
            assert after.owner(key) == before.owner(key)
    joined = HashRing([*ADDRESSES, "10.9.9.9:50061"])
    moved = sum(joined.owner(k) != before.owner(k) for k in KEYS)
    assert all(joined.owner(k) == "10.9.9.9:50061" for k in KEYS if joined.owner(k) != before.owner(k))
    assert moved < 3 * len(KEYS) / len(ADDRESSES)  # about a 65th of the keys, not a reshuffle


def test_an_empty_ring_is_refused():
    with pytest.raises(ValueError, match="at least one address"):
        HashRing([])
