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


@pytest.fixture(params=["directory", "redis", "directory-signed", "redis-signed", "redisacl-signed"])
def open_store(request, tmp_path):
    """A factory: each call opens the same store anew, as a restarted gateway would.
    `redisacl`: as a Redis user allowed only BATCH_REDIS_COMMANDS on the store's
    prefix (docs/security.md), and no command of the test may have been denied."""
    kind, _, signed = request.param.partition("-")
    key = KEY if signed else None
    if kind == "directory":
        return lambda: DirectoryStore(tmp_path / "store", key)
    server = request.getfixturevalue("redis_server")
    if kind == "redis":
        return lambda: RedisStore(server.url, "test:batch:", key)
    url = _confined_user(server, "tessera:team-a/llama:batch:")
    request.addfinalizer(lambda: _assert_nothing_denied(server))
    return lambda: RedisStore(url, "tessera:team-a/llama:batch:", key)


def _confined_user(server, prefix: str) -> str:
    """The URL of a Redis user allowed exactly BATCH_REDIS_COMMANDS on keys under `prefix`."""
    from gateway.batch.store import BATCH_REDIS_COMMANDS

    server.client.execute_command("ACL", "SETUSER", "batch-gateway", "on", ">gateway-password-0123", "resetkeys",
                                  f"~{prefix}*", "resetchannels", "-@all", *[f"+{c}" for c in BATCH_REDIS_COMMANDS])
    return f"redis://batch-gateway:gateway-password-0123@127.0.0.1:{server.port}/0"


def _assert_nothing_denied(server) -> None:
    assert server.client.execute_command("ACL", "LOG") == []


def test_a_confined_batch_user_cannot_touch_another_prefix(redis_server):
    url = _confined_user(redis_server, "tessera:team-a/llama:batch:")
    store = RedisStore(url, "tessera:team-b/llama:batch:", KEY)

    async def run():
        try:
            await store.put_file("t", new_file_record(FILE, "in.jsonl", 1, "batch"), b"x")
        finally:
            await store.close()

    import redis.exceptions

    with pytest.raises(redis.exceptions.NoPermissionError):
        asyncio.run(run())
    assert redis_server.client.keys("*") == []


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


def test_batches_past_their_retention_go_with_their_output_files(open_store):
    from gateway.batch.records import new_batch
    from gateway.batch.retention import remove_expired

    def batch(n: int, status: str, ended: int | None, output: str | None = None) -> dict:
        record = {**new_batch("batch_" + str(n) * 32, FILE, "/v1/completions", None), "status": status,
                  "created_at": 10 + n, "output_file_id": output}
        return {**record, "completed_at": ended} if ended is not None else record

    async def main():
        store = open_store()
        try:
            out_old, out_new = _file(5, 50), _file(6, 60)
            for f in (out_old, out_new, _file(7, 70)):  # 7: the tenant's input file, kept
                await store.put_file("alice", f, b"x")
            await store.put_batch("alice", batch(1, "completed", 100, out_old["id"]))  # ended long ago
            await store.put_batch("alice", batch(2, "completed", 990, out_new["id"]))  # ended recently
            await store.put_batch("alice", batch(3, "in_progress", None))  # never ends by age
            await store.put_batch("bob", batch(4, "completed", 100))  # another tenant's: not touched
            await store.put_result("batch_" + "1" * 32, 0, {"custom_id": "c0"})
            kept = await remove_expired(store, "alice", retention_s=500, now=1000)
            assert [b["id"][-1] for b in kept] == ["3", "2"]
            assert [b["id"][-1] for b in await store.list_batches("alice")] == ["3", "2"]
            assert await store.get_batch("alice", "batch_" + "1" * 32) is None
            assert await store.results("batch_" + "1" * 32) == {}
            assert [f["id"][-1] for f in await store.list_files("alice")] == ["7", "6"]
            assert len(await store.list_batches("bob")) == 1
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


def _round_trip(store) -> None:
    async def main():
        try:
            await store.put_file("alice", new_file_record(FILE, "in.jsonl", 3, "batch"), b"abc")
            assert await store.file_content("alice", FILE) == b"abc"
            assert (await store.get_file("alice", FILE))["bytes"] == 3
        finally:
            await store.close()

    asyncio.run(main())


def test_the_store_of_a_config_whose_redis_url_comes_from_the_environment(tmp_path, caplog):
    """The operator's gateway: a config file with the key prefix alone, the URL (a password in it) in
    TESSERA_BATCH_REDIS_URL. open_store opens that Redis, under that prefix, and says so without the
    password."""
    from gateway.batch.store import open_store
    from gateway.config import load_gateway_config
    from kv_store.local_redis import RedisServer

    server = RedisServer(tmp_path, password="hunter2-batch-pw")
    try:
        path = tmp_path / "gateway.yaml"
        path.write_text("model: {name: m, path: /p}\npods: {static: [{address: 'h:1'}]}\n"
                        "batch: {key_prefix: 'tessera:ml/llama:batch:'}\n")
        config = load_gateway_config(path, {"TESSERA_BATCH_REDIS_URL": server.url}).batch
        with caplog.at_level("INFO", logger="gateway.batch.store"):
            store = open_store(config, KEY)
        assert isinstance(store, RedisStore)
        assert f"127.0.0.1:{server.port}" in caplog.text and "hunter2" not in caplog.text
        _round_trip(store)
        keys = {k.decode() for k in server.client.keys("*")}
        assert keys and all(k.startswith("tessera:ml/llama:batch:") for k in keys)
    finally:
        server.stop()


def test_a_rediss_store_presents_the_configured_tls_files(tmp_path):
    """batch.redis_ca_file, redis_cert_file, redis_key_file reach redis.asyncio as the KV store's Redis
    tier passes its own: a Redis demanding client certificates serves the store, and refuses it
    without the client certificate."""
    import shutil
    import subprocess

    import redis as redis_py

    from gateway.batch.store import open_store
    from gateway.config import gateway_config_from_dict
    from kv_store.local_redis import _wait_ping
    from tessera.child_process import free_port
    from tests.kv_store.test_redis_tier import _make_tls_files

    files = _make_tls_files(tmp_path)
    port = free_port()
    server = subprocess.Popen(
        [shutil.which("redis-server"), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", files["server.crt"], "--tls-key-file", files["server.key"],
         "--tls-ca-cert-file", files["ca.crt"], "--tls-auth-clients", "yes", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ping(redis_py.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=files["ca.crt"],
                                  ssl_certfile=files["client.crt"], ssl_keyfile=files["client.key"],
                                  socket_timeout=0.5))
        base = {"model": {"name": "m", "path": "/p"}, "pods": {"static": [{"address": "h:1"}]}}
        env = {"TESSERA_BATCH_REDIS_URL": f"rediss://127.0.0.1:{port}/0"}
        tls = {"redis_ca_file": files["ca.crt"], "redis_cert_file": files["client.crt"],
               "redis_key_file": files["client.key"]}
        _round_trip(open_store(gateway_config_from_dict({**base, "batch": tls}, env).batch, KEY))
        no_cert = gateway_config_from_dict({**base, "batch": {"redis_ca_file": files["ca.crt"]}}, env).batch
        with pytest.raises(redis_py.ConnectionError):
            _round_trip(open_store(no_cert, KEY))
    finally:
        server.kill()
        server.wait()
