"""Consistent hashing of prompt prefixes onto pods: where the bounded router
expects a prefix to be cached.

Each pod address owns VIRTUAL_NODES points on a 64-bit ring; a key's owner
is the pod of the first point at or after the key's position. The ring is
a pure function of the set of addresses, so gateway replicas that see the
same pods agree on every owner without sharing anything, and a pod joining
or leaving moves only the keys it wins or owned. Finding an owner is a
binary search: the cost of routing a request does not grow with the fleet
(rendezvous hashing, the alternative, hashes the key with every pod).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

# Points per pod: the share of keys a pod owns varies by about 1/sqrt(this)
# (12% here) around 1/pods; building a 256-pod ring takes ~16k hashes.
VIRTUAL_NODES = 64


def ring_position(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, addresses: Sequence[str], virtual_nodes: int = VIRTUAL_NODES) -> None:
        if not addresses:
            raise ValueError("a hash ring needs at least one address")
        self.addresses = tuple(addresses)
        points = sorted((ring_position(f"{address}#{i}".encode()), address, index)
                        for index, address in enumerate(self.addresses) for i in range(virtual_nodes))
        self._positions = [p for p, _, _ in points]
        self._owners = [index for _, _, index in points]

    def owner_index(self, key: bytes) -> int:
        """The index (into the addresses it was built from) of the key's owner."""
        at = bisect.bisect_left(self._positions, ring_position(key))
        return self._owners[at % len(self._owners)]

    def owner(self, key: bytes) -> str:
        return self.addresses[self.owner_index(key)]
