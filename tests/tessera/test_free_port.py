"""free_port: ports for children to listen on, distinct within a process and outside the range
outgoing connections draw their source ports from."""

from __future__ import annotations

import socket

from tessera import child_process
from tessera.child_process import free_port


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    start = child_process._ephemeral_start()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(20000 <= p < min(start, 60000) for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_a_machine_without_room_below_the_range_gets_a_kernel_picked_port(monkeypatch):
    real_start = child_process._ephemeral_start()
    monkeypatch.setattr(child_process, "_ephemeral_start", lambda: 20050)
    port = free_port()
    assert port >= real_start  # the kernel's pick, from its ephemeral range
    assert port in child_process._handed_out


def test_ranges_are_disjoint_from_each_other_and_from_single_ports_and_below_the_ephemeral_range():
    start = child_process._ephemeral_start()
    taken: set[int] = set()
    for count in (8, 1, 2, 4, 6, 3):
        for _ in range(10):
            first = child_process.free_port_range(count)
            ports = set(range(first, first + count))
            assert not ports & taken and all(20000 <= p < min(start, 60000) for p in ports)
            taken |= ports
        single = free_port()
        assert single not in taken
        taken.add(single)
    assert child_process.free_port_pair() + 1 not in taken
