"""Signed batch records (gateway/batch/signing.py) in both stores, against a
real redis-server and a directory: a writer who reaches the store but does
not hold the key cannot forge or alter a File record, a batch or a line's
result, nor swap a file's bytes. What does not verify is not served (absent),
and is logged once by name, never by content. Without a key, records are
plain JSON and read as before."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
from pathlib import Path

import pytest

from gateway.batch.records import new_batch, new_file_record
from gateway.batch.signing import batch_mac_key
from gateway.batch.store import DirectoryStore, RedisStore
from tessera.internal_secret import InternalSecret

KEY = b"k" * 32
OTHER_KEY = b"o" * 32
PREFIX = "test:batch:"
FILE = "file-" + "b" * 32
BATCH = "batch_" + "a" * 32
OTHER_BATCH = "batch_" + "c" * 32
RESULT = {"custom_id": "a", "response": {"status_code": 200, "body": {"text": "fine"}}, "error": None}


class Raw:
    """The store's bytes behind its back, as a writer without the key reaches them:
    `what` is ("file" | "filedata" | "batch", tenant, id) or ("result", batch id, index)."""

    def __init__(self, kind: str, root: Path, server) -> None:
        self.kind, self.root, self.server = kind, root, server

    def _path(self, what: tuple) -> Path:
        kind, a, b = what
        if kind == "result":
            return self.root / "runs" / a / "results" / f"{b}.json"
        folder, suffix = {"file": ("files", "json"), "filedata": ("files", "data"), "batch": ("batches", "json")}[kind]
        return self.root / "tenants" / a / folder / f"{b}.{suffix}"

    def get(self, what: tuple) -> bytes | None:
        if self.kind == "directory":
            path = self._path(what)
            return path.read_bytes() if path.exists() else None
        kind, a, b = what
        if kind == "result":
            return self.server.client.hget(f"{PREFIX}results:{a}", str(b))
        return self.server.client.get(f"{PREFIX}{kind}:{a}:{b}")

    def set(self, what: tuple, value: bytes) -> None:
        if self.kind == "directory":
            path = self._path(what)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(value)
            return
        kind, a, b = what
        if kind == "result":
            self.server.client.hset(f"{PREFIX}results:{a}", str(b), value)
        else:
            self.server.client.set(f"{PREFIX}{kind}:{a}:{b}", value)
            if kind == "file":
                self.server.client.sadd(f"{PREFIX}files:{a}", b)  # listed too, as a forger would make it


@pytest.fixture(params=["directory", "redis"])
def kind(request):
    return request.param


@pytest.fixture
def raw(kind, tmp_path, request) -> Raw:
    server = request.getfixturevalue("redis_server") if kind == "redis" else None
    return Raw(kind, tmp_path / "store", server)


@pytest.fixture
def open_store(kind, raw):
    """A factory: a store on the same place, with a key of the caller's choice."""
    def make(key: bytes | None):
        if kind == "directory":
            return DirectoryStore(raw.root, key)
        return RedisStore(raw.server.url, PREFIX, key)
    return make


async def _write_all(store) -> None:
    """One of each record: a file (with its bytes), a batch reading it, one line's result."""
    await store.put_file("alice", new_file_record(FILE, "in.jsonl", 3, "batch"), b"abc")
    await store.put_batch("alice", new_batch(BATCH, FILE, "/v1/completions", None))
    await store.put_result(BATCH, 0, RESULT)


async def _served(store) -> dict:
    """What the store serves of _write_all's records."""
    return {"file": await store.get_file("alice", FILE), "content": await store.file_content("alice", FILE),
            "files": await store.list_files("alice"), "batch": await store.get_batch("alice", BATCH),
            "batches": await store.list_batches("alice"), "results": await store.results(BATCH)}


NOTHING = {"file": None, "content": None, "files": [], "batch": None, "batches": [], "results": {}}


def _run(coro):
    return asyncio.run(coro)


def _altered(value: bytes, old: bytes, new: bytes) -> bytes:
    assert old in value
    return value.replace(old, new)


def test_records_altered_in_the_store_are_not_served(open_store, raw):
    async def main():
        store = open_store(KEY)
        await _write_all(store)
        served = await _served(store)
        assert served["file"]["filename"] == "in.jsonl" and served["content"] == b"abc"
        assert served["batch"]["status"] == "validating" and served["results"] == {0: RESULT}
        # The tags stay; the signed JSON changes under them.
        raw.set(("file", "alice", FILE), _altered(raw.get(("file", "alice", FILE)), b'"in.jsonl"', b'"xx.jsonl"'))
        raw.set(("batch", "alice", BATCH), _altered(raw.get(("batch", "alice", BATCH)), b'"validating"',
                                                    b'"completed"'))
        raw.set(("result", BATCH, 0), _altered(raw.get(("result", BATCH, 0)), b'"fine"', b'"evil"'))
        assert await _served(store) == NOTHING
        await store.close()

    _run(main())


def test_altered_bytes_under_a_valid_file_record_are_not_served(open_store, raw):
    async def main():
        store = open_store(KEY)
        await _write_all(store)
        raw.set(("filedata", "alice", FILE), b"abd")
        assert await store.get_file("alice", FILE) is not None  # the record itself is intact
        assert await store.file_content("alice", FILE) is None
        await store.close()

    _run(main())


def test_records_written_with_another_key_or_none_are_not_served(open_store):
    async def main():
        for writer_key in (OTHER_KEY, None):  # another deployment's key; a writer without one
            writer = open_store(writer_key)
            await _write_all(writer)
            await writer.close()
            store = open_store(KEY)
            assert await _served(store) == NOTHING
            await store.close()

    _run(main())


def test_a_record_copied_under_another_name_is_not_served(open_store, raw):
    """The tag binds the record to its tenant and id (a result to its batch and line)."""
    async def main():
        store = open_store(KEY)
        await _write_all(store)
        raw.set(("file", "bob", FILE), raw.get(("file", "alice", FILE)))
        raw.set(("filedata", "bob", FILE), raw.get(("filedata", "alice", FILE)))
        raw.set(("batch", "alice", OTHER_BATCH), raw.get(("batch", "alice", BATCH)))
        raw.set(("result", BATCH, 1), raw.get(("result", BATCH, 0)))
        raw.set(("result", OTHER_BATCH, 0), raw.get(("result", BATCH, 0)))
        assert await store.get_file("bob", FILE) is None and await store.file_content("bob", FILE) is None
        assert await store.list_files("bob") == []
        assert await store.get_batch("alice", OTHER_BATCH) is None
        assert await store.results(BATCH) == {0: RESULT}
        assert await store.results(OTHER_BATCH) == {}
        await store.close()

    _run(main())


def test_a_refusal_is_logged_once_by_name_never_by_content(open_store, raw, caplog):
    async def main():
        store = open_store(KEY)
        await store.put_file("alice", new_file_record(FILE, "private-plans.jsonl", 3, "batch"), b"abc")
        raw.set(("file", "alice", FILE), _altered(raw.get(("file", "alice", FILE)), b'"processed"', b'"error"'))
        with caplog.at_level(logging.WARNING, logger="gateway.batch.signing"):
            for _ in range(3):
                assert await store.get_file("alice", FILE) is None
        await store.close()

    _run(main())
    [warning] = [r.getMessage() for r in caplog.records if r.name == "gateway.batch.signing"]
    assert f"file:alice:{FILE}" in warning and "does not verify" in warning
    assert "private-plans" not in warning and '"error"' not in warning
    assert KEY.decode() not in warning


def test_without_a_key_records_are_plain_json_as_before(open_store, raw):
    async def main():
        store = open_store(None)
        await _write_all(store)
        assert json.loads(raw.get(("batch", "alice", BATCH)))["id"] == BATCH  # the record itself, no tag
        raw.set(("batch", "alice", BATCH), _altered(raw.get(("batch", "alice", BATCH)), b'"validating"',
                                                    b'"in_progress"'))
        raw.set(("filedata", "alice", FILE), b"abd")
        # Nothing is checked: what is stored is what is served, as before signing.
        assert (await store.get_batch("alice", BATCH))["status"] == "in_progress"
        assert await store.file_content("alice", FILE) == b"abd"
        await store.close()
        # A store opened without the key still reads what a keyed gateway wrote (it cannot check it).
        keyed = open_store(KEY)
        await keyed.put_result(BATCH, 1, RESULT)
        await keyed.close()
        plain = open_store(None)
        assert (await plain.results(BATCH))[1] == RESULT
        await plain.close()

    _run(main())


def test_a_deleted_file_leaves_neither_record_nor_bytes(open_store, raw):
    async def main():
        store = open_store(KEY)
        await _write_all(store)
        assert await store.delete_file("alice", FILE)
        assert raw.get(("file", "alice", FILE)) is None and raw.get(("filedata", "alice", FILE)) is None
        assert await store.count_files("alice") == 0
        await store.close()

    _run(main())


def test_the_key_is_derived_from_the_internal_secret():
    secret = InternalSecret(b"s" * 40)
    key = batch_mac_key(secret)
    assert key == hmac.new(b"s" * 40, b"tessera/batch-records/v1", hashlib.sha256).digest()
    # A key of its own: none of the secret's other keys.
    assert key not in (secret.kv_mac_key, secret.derive("internal-token"), secret.value)
    assert batch_mac_key(None) is None
