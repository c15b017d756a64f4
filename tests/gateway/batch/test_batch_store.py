"""Both stores keep the same promises: ownership by tenant, idempotent
results by line, leases that exclude another owner until they expire, and
everything there again after the store is reopened (a gateway restart)."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.batch.records import new_batch, new_file_record
from gateway.batch.store import DirectoryStore, RedisStore

BATCH = "batch_" + "a" * 32
FILE = "file-" + "b" * 32


@pytest.fixture(params=["directory", "redis"])
def open_store(request, tmp_path):
    """A factory: each call opens the same store anew, as a restarted gateway would."""
    if request.param == "directory":
        return lambda: DirectoryStore(tmp_path / "store")
    server = request.getfixturevalue("redis_server")
    return lambda: RedisStore(server.url, "test:batch:")


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
