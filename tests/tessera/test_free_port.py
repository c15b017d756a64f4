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
