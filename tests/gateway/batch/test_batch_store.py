"""Both stores keep the same promises, with their records signed (a key) or
not: ownership by tenant, idempotent results by line, leases that exclude
another owner until they expire, everything there again after the store is
reopened (a gateway restart), files listed newest first and deleted whole.
Tampering with signed records: test_batch_signing.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.batch.records import new_batch, new_file_record
from gateway.batch.store import DirectoryStore, RedisStore

BATCH = "batch_" + "a" * 32
FILE = "file-" + "b" * 32


KEY = bytes(range(32))


@pytest.fixture(params=["directory", "redis", "directory-signed", "redis-signed"])
def open_store(request, tmp_path):
    """A factory: each call opens the same store anew, as a restarted gateway would."""
    kind, _, signed = request.param.partition("-")
    key = KEY if signed else None
    if kind == "directory":
        return lambda: DirectoryStore(tmp_path / "store", key)
    server = request.getfixturevalue("redis_server")
    return lambda: RedisStore(server.url, "test:batch:", key)


def test_files_batches_and_results_survive_reopening(open_store):
    async def write():
        store = open_store()
        await store.put_file("alice", new_file_record(FILE, "in.jsonl", 3, "batch"), b"abc")
        await store.put_batch("alice", new_batch(BATCH, FILE, "/v1/completions", None))
        await store.put_result(BATCH, 0, {"custom_id": "a", "n": 1})
        await store.put_result(BATCH, 0, {"custom_id": "a", "n": 2})  # a retried line replaces, never adds
        await store.put_result(BATCH, 1, {"custom_id": "b"})
        await store.close()

    async def read():
        store = open_store()
        try:
            assert (await store.get_file("alice", FILE))["bytes"] == 3
            assert await store.file_content("alice", FILE) == b"abc"
            assert await store.count_files("alice") == 1
            assert [b["id"] for b in await store.list_batches("alice")] == [BATCH]
            assert await store.active_batches() == [("alice", BATCH)]
            assert await store.results(BATCH) == {0: {"custom_id": "a", "n": 2}, 1: {"custom_id": "b"}}
            # Another tenant sees nothing of alice's.
            assert await store.get_file("bob", FILE) is None
            assert await store.file_content("bob", FILE) is None
            assert await store.get_batch("bob", BATCH) is None
            assert await store.list_batches("bob") == []
            await store.put_batch("alice", {**(await store.get_batch("alice", BATCH)), "status": "completed"})
            await store.set_inactive("alice", BATCH)
            assert await store.active_batches() == []
        finally:
            await store.close()

    asyncio.run(write())
    asyncio.run(read())


def test_a_lease_excludes_others_until_it_expires(open_store):
    async def main():
        store = open_store()
        try:
            assert await store.claim(BATCH, "one", 0.5)
            assert await store.claim(BATCH, "one", 0.5)  # renewing
            assert not await store.claim(BATCH, "two", 0.5)
            time.sleep(0.7)
            assert await store.claim(BATCH, "two", 5)  # the first owner died: its lease expired
            await store.release(BATCH, "one")  # not its lease any more: nothing happens
            assert not await store.claim(BATCH, "one", 5)
            await store.release(BATCH, "two")
            assert await store.claim(BATCH, "one", 5)
        finally:
            await store.close()

    asyncio.run(main())


def _file(n: int, created_at: int, purpose: str = "batch") -> dict:
    return {**new_file_record(f"file-{n:032x}", f"f{n}.jsonl", 1, purpose), "created_at": created_at}


def test_files_are_listed_newest_first_and_deleted_whole(open_store):
    async def main():
        store = open_store()
        try:
            # Out of order on purpose; two in the same second are ordered by id.
            for n, created in ((1, 100), (3, 300), (2, 200), (4, 300)):
                await store.put_file("alice", _file(n, created), b"x")
            await store.put_file("bob", _file(9, 999), b"y")
            assert [f["id"][-1] for f in await store.list_files("alice")] == ["4", "3", "2", "1"]
            assert [f["id"][-1] for f in await store.list_files("bob")] == ["9"]
            assert await store.list_files("carol") == []
            # Another tenant's file is not theirs to delete; an unknown one is no file.
            assert not await store.delete_file("bob", _file(3, 0)["id"])
            assert not await store.delete_file("alice", "file-" + "e" * 32)
            assert await store.delete_file("alice", _file(3, 0)["id"])
            assert not await store.delete_file("alice", _file(3, 0)["id"])  # gone: a second delete finds nothing
            assert await store.get_file("alice", _file(3, 0)["id"]) is None
            assert await store.file_content("alice", _file(3, 0)["id"]) is None
            assert await store.count_files("alice") == 3  # the quota counts what is left
            assert [f["id"][-1] for f in await store.list_files("alice")] == ["4", "2", "1"]
        finally:
            await store.close()

    asyncio.run(main())


def test_a_slow_disk_never_blocks_the_event_loop(tmp_path, monkeypatch):
    """Every directory-store write fsyncs; on a busy disk that takes long, and on the
    event loop it would stall every interactive request of the gateway meanwhile."""
    import os

    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (time.sleep(0.3), real_fsync(fd)))

    async def main():
        store = DirectoryStore(tmp_path)
        gaps = []

        async def ticker():
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        await asyncio.gather(*(store.put_result("batch_" + "0" * 32, i, {"i": i}) for i in range(3)))
        await asyncio.sleep(0.05)  # the ticker's turn after the writes: a stall shows as its gap
        tick.cancel()
        assert (await store.results("batch_" + "0" * 32)).keys() == {0, 1, 2}
        await store.close()
        return gaps

    gaps = asyncio.run(main())
    assert max(gaps) < 0.2, f"the loop stalled {max(gaps):.2f} s"
