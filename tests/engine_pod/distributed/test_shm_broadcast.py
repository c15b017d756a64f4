"""The shared-memory broadcast channel: every reader gets every message, in
order, whole, however it compares with the slot size; a dead peer turns a
wait into an error."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import pickle
import random
import threading

import pytest

from engine_pod.distributed.shm_broadcast import BroadcastReader, BroadcastWriter, ChannelSpec

CTX = mp.get_context("spawn")


def _messages() -> list[object]:
    # Tiny, exactly one slot, just over, many slots (the ring wraps several times).
    rng = random.Random(0)
    return [b"", {"step": 1, "ids": list(range(10))}, b"x" * 1024, rng.randbytes(1025), rng.randbytes(9 * 1024 + 7),
            None]


def test_messages_of_every_size_arrive_in_order_through_a_small_ring():
    writer = BroadcastWriter(CTX, num_readers=1, num_slots=4, slot_bytes=1024)
    reader = BroadcastReader(writer.reader_spec(), 0)
    received = []
    # The writer blocks once the 4 slots are full; a reader thread drains them.
    thread = threading.Thread(target=lambda: received.extend(reader.read() for _ in _messages()))
    thread.start()
    for message in _messages():
        writer.write(message)
    thread.join(10)
    assert received == _messages()
    reader.close()
    writer.close()
    assert not os.path.exists(writer.spec.path)


def test_a_full_ring_with_a_dead_reader_raises_through_check_alive():
    writer = BroadcastWriter(CTX, num_readers=1, num_slots=2, slot_bytes=64)
    writer.write(b"a" * 100)  # fills both slots; nobody reads

    def reader_is_dead():
        raise RuntimeError("reader died")

    with pytest.raises(RuntimeError, match="reader died"):
        writer.write(b"b", check_alive=reader_is_dead)
    writer.close()


def _read_and_digest(spec: ChannelSpec, index: int, count: int, results) -> None:
    reader = BroadcastReader(spec, index)
    digest = hashlib.sha256()
    for _ in range(count):
        digest.update(pickle.dumps(reader.read()))
    results.send(digest.hexdigest())


def test_every_reader_process_receives_the_same_bytes():
    writer = BroadcastWriter(CTX, num_readers=2, num_slots=4, slot_bytes=4096)
    pipes, procs = [], []
    for index in range(2):
        receive, send = CTX.Pipe(duplex=False)
        proc = CTX.Process(target=_read_and_digest, args=(writer.reader_spec(), index, len(_messages()), send))
        proc.start()
        pipes.append(receive)
        procs.append(proc)
    expected = hashlib.sha256()
    for message in _messages():
        writer.write(message)
        expected.update(pickle.dumps(message))
    assert [p.recv() for p in pipes] == [expected.hexdigest()] * 2
    for proc in procs:
        proc.join(10)
        assert proc.exitcode == 0
    writer.close()
