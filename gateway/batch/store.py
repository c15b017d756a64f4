"""Where the Batch API keeps files and batches: one small async interface,
two implementations. `DirectoryStore` (one gateway replica; a directory that
survives restarts, every write a temp file renamed into place, so a crash
leaves the old record or the new, never half of one) and `RedisStore`
(several replicas share it; keys under a prefix).

Records are JSON objects (the API's own File and Batch objects plus the
store's few fields); file contents are bytes. A batch's progress is one
result per input line, keyed by the line's index: recording a line twice
overwrites, so a line retried after a restart is never duplicated.

Leases: a runner claims a batch for `lease_s` and renews the claim while it
runs it; a claim not renewed (its replica died) expires and another runner
takes the batch over.

Signing: given a `mac_key`, both stores seal every File record, batch record
and line result with an HMAC tag (gateway/batch/signing.py) and treat a record
that does not verify as absent, so whoever can write to the store without the
key cannot forge or alter one. A File record's tag also covers the SHA-256 of
the file's bytes. Without a key, records are plain JSON.
"""

from __future__ import annotations

import abc
import asyncio
import functools
import json
import logging
import os
import re
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gateway.batch.signing import RecordSigner, Sealed, dump_json
from kv_store.redis_tier import redact_url, ssl_options

# Ids the API hands out: anything else names nothing (and never reaches a path or key).
FILE_ID_RE = re.compile(r"^file-[0-9a-f]{32}$")
BATCH_ID_RE = re.compile(r"^batch_[0-9a-f]{32}$")


class BatchStore(abc.ABC):
    """Files and batches keyed by tenant; results and leases keyed by batch id."""

    @abc.abstractmethod
    async def put_file(self, tenant: str, record: dict, content: bytes) -> None:
        """A new file: its File object and its bytes."""

    @abc.abstractmethod
    async def get_file(self, tenant: str, file_id: str) -> dict | None:
        """The tenant's File object, or None (unknown, or another tenant's)."""

    @abc.abstractmethod
    async def file_content(self, tenant: str, file_id: str) -> bytes | None:
        """The tenant's file's bytes, or None."""

    @abc.abstractmethod
    async def count_files(self, tenant: str) -> int:
        """How many files the tenant keeps."""

    @abc.abstractmethod
    async def list_files(self, tenant: str) -> list[dict]:
        """The tenant's File objects, newest first."""

    @abc.abstractmethod
    async def delete_file(self, tenant: str, file_id: str) -> bool:
        """Remove the file's record and bytes; False if the tenant had no such file."""

    @abc.abstractmethod
    async def put_batch(self, tenant: str, record: dict) -> None:
        """A batch's record, new or updated (the whole record replaces the old)."""

    @abc.abstractmethod
    async def get_batch(self, tenant: str, batch_id: str) -> dict | None:
        """The tenant's batch record, or None."""

    @abc.abstractmethod
    async def list_batches(self, tenant: str) -> list[dict]:
        """The tenant's batches, newest first."""

    @abc.abstractmethod
    async def active_batches(self) -> list[tuple[str, str]]:
        """(tenant, batch id) of every batch not yet in a final status."""

    @abc.abstractmethod
    async def set_inactive(self, tenant: str, batch_id: str) -> None:
        """The batch reached a final status: runners no longer look at it."""

    @abc.abstractmethod
    async def delete_batch(self, tenant: str, batch_id: str) -> None:
        """The batch's record, results and marks, gone (its files are the caller's to delete)."""

    @abc.abstractmethod
    async def put_result(self, batch_id: str, index: int, result: dict) -> None:
        """The outcome of input line `index` (idempotent: a second write replaces the first)."""

    @abc.abstractmethod
    async def results(self, batch_id: str) -> dict[int, dict]:
        """Every recorded outcome of the batch, by input line index."""

    @abc.abstractmethod
    async def request_cancel(self, batch_id: str) -> None:
        """Mark the batch for cancelling (its runner stops starting lines)."""

    @abc.abstractmethod
    async def cancel_requested(self, batch_id: str) -> bool:
        """Whether a cancel was asked for."""

    @abc.abstractmethod
    async def claim(self, batch_id: str, owner: str, lease_s: float) -> bool:
        """Take or renew the lease on a batch: True if `owner` holds it now
        (it was free, expired, or already `owner`'s)."""

    @abc.abstractmethod
    async def release(self, batch_id: str, owner: str) -> None:
        """Give the lease up, if `owner` holds it."""

    async def close(self) -> None:  # noqa: B027 - most stores hold nothing to free
        """Free connections."""


def file_name(tenant: str, file_id: str) -> str:
    """A File record's name in its tag: the tenant's, under this id."""
    return f"file:{tenant}:{file_id}"


def batch_name(tenant: str, batch_id: str) -> str:
    return f"batch:{tenant}:{batch_id}"


def result_name(batch_id: str, index: int) -> str:
    return f"result:{batch_id}:{index}"


def _newest_first(records: list[dict]) -> list[dict]:
    return sorted(records, key=lambda r: (r["created_at"], r["id"]), reverse=True)


def _atomic_write(path: Path, data: bytes) -> None:
    """The whole of `data` at `path`, or what was there before: a temp file in
    the same directory, flushed, renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with _suppress_os_error():
            os.unlink(tmp)
        raise


class _suppress_os_error:
    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        return kind is not None and issubclass(kind, OSError)


def _read_json(path: Path) -> dict | None:
    raw = _read_bytes(path)
    return None if raw is None else json.loads(raw)


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _off_loop(method):
    """A DirectoryStore method run on the store's own thread, awaited."""
    @functools.wraps(method)
    async def run(self, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, functools.partial(method, self, *args))
    return run


class DirectoryStore(BatchStore):
    """One replica's store: root/tenants/<tenant>/{files,batches}/, root/runs/<batch id>/.
    Tenant names are plain (gateway/tenants.py) and ids are checked by the API, so no
    path is built from anything a client chose freely. Leases here only keep one
    process's runner from racing itself and a restarted process from taking over
    before the dead one's lease expires: replicas need RedisStore."""

    def __init__(self, root: str | Path, mac_key: bytes | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._signer = RecordSigner(mac_key)
        # Every file system call runs here: an fsync never blocks the event loop (and the
        # interactive requests on it), and one thread keeps a lease's read and write together.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-store")

    def _tenant(self, tenant: str) -> Path:
        return self.root / "tenants" / tenant

    def _run(self, batch_id: str) -> Path:
        return self.root / "runs" / batch_id

    def _files(self, tenant: str) -> Path:
        return self._tenant(tenant) / "files"

    def _open_file(self, tenant: str, file_id: str) -> Sealed | None:
        return self._signer.open(file_name(tenant, file_id), _read_bytes(self._files(tenant) / f"{file_id}.json"))

    def _open_batch(self, tenant: str, batch_id: str) -> dict | None:
        raw = _read_bytes(self._tenant(tenant) / "batches" / f"{batch_id}.json")
        sealed = self._signer.open(batch_name(tenant, batch_id), raw)
        return None if sealed is None else sealed.record

    @_off_loop
    def put_file(self, tenant: str, record: dict, content: bytes) -> None:
        base = self._files(tenant)
        _atomic_write(base / f"{record['id']}.data", content)
        # The record last: it makes the file exist.
        _atomic_write(base / f"{record['id']}.json", self._signer.seal(file_name(tenant, record["id"]), record,
                                                                       content))

    @_off_loop
    def get_file(self, tenant: str, file_id: str) -> dict | None:
        sealed = self._open_file(tenant, file_id)
        return None if sealed is None else sealed.record

    @_off_loop
    def file_content(self, tenant: str, file_id: str) -> bytes | None:
        sealed = self._open_file(tenant, file_id)
        if sealed is None:
            return None
        content = _read_bytes(self._files(tenant) / f"{file_id}.data")
        return content if self._signer.content_matches(file_name(tenant, file_id), sealed, content) else None

    @_off_loop
    def count_files(self, tenant: str) -> int:
        base = self._files(tenant)
        return len(list(base.glob("*.json"))) if base.exists() else 0

    @_off_loop
    def list_files(self, tenant: str) -> list[dict]:
        base = self._files(tenant)
        sealed = [self._open_file(tenant, p.stem) for p in base.glob("*.json")] if base.exists() else []
        return _newest_first([s.record for s in sealed if s is not None])

    @_off_loop
    def delete_file(self, tenant: str, file_id: str) -> bool:
        record = self._files(tenant) / f"{file_id}.json"
        try:
            record.unlink()  # the record first: without it the file does not exist, whatever is left
        except FileNotFoundError:
            return False
        with _suppress_os_error():
            (self._files(tenant) / f"{file_id}.data").unlink()
        return True

    @_off_loop
    def put_batch(self, tenant: str, record: dict) -> None:
        _atomic_write(self._tenant(tenant) / "batches" / f"{record['id']}.json",
                      self._signer.seal(batch_name(tenant, record["id"]), record))
        if record.get("status") not in FINAL_STATUSES:
            _atomic_write(self.root / "active" / f"{tenant}@{record['id']}", b"")

    @_off_loop
    def get_batch(self, tenant: str, batch_id: str) -> dict | None:
        return self._open_batch(tenant, batch_id)

    @_off_loop
    def list_batches(self, tenant: str) -> list[dict]:
        base = self._tenant(tenant) / "batches"
        records = [r for p in base.glob("*.json") if (r := self._open_batch(tenant, p.stem)) is not None] \
            if base.exists() else []
        return _newest_first(records)

    @_off_loop
    def active_batches(self) -> list[tuple[str, str]]:
        base = self.root / "active"
        if not base.exists():
            return []
        return [tuple(p.name.split("@", 1)) for p in base.iterdir() if "@" in p.name]

    @_off_loop
    def set_inactive(self, tenant: str, batch_id: str) -> None:
        with _suppress_os_error():
            (self.root / "active" / f"{tenant}@{batch_id}").unlink()

    @_off_loop
    def delete_batch(self, tenant: str, batch_id: str) -> None:
        for path in (self._tenant(tenant) / "batches" / f"{batch_id}.json",
                     self.root / "active" / f"{tenant}@{batch_id}"):
            with _suppress_os_error():
                path.unlink()
        shutil.rmtree(self._run(batch_id), ignore_errors=True)

    @_off_loop
    def put_result(self, batch_id: str, index: int, result: dict) -> None:
        _atomic_write(self._run(batch_id) / "results" / f"{index}.json",
                      self._signer.seal(result_name(batch_id, index), result))

    @_off_loop
    def results(self, batch_id: str) -> dict[int, dict]:
        base = self._run(batch_id) / "results"
        if not base.exists():
            return {}
        out = {}
        for p in base.glob("*.json"):
            if not p.stem.isdigit():
                continue  # no index of ours
            sealed = self._signer.open(result_name(batch_id, int(p.stem)), _read_bytes(p))
            if sealed is not None:  # a result that does not verify is no result: the line runs again
                out[int(p.stem)] = sealed.record
        return out

    @_off_loop
    def request_cancel(self, batch_id: str) -> None:
        _atomic_write(self._run(batch_id) / "cancel", b"")

    @_off_loop
    def cancel_requested(self, batch_id: str) -> bool:
        return (self._run(batch_id) / "cancel").exists()

    @_off_loop
    def claim(self, batch_id: str, owner: str, lease_s: float) -> bool:
        path = self._run(batch_id) / "lease"
        lease = _read_json(path)
        if lease is not None and lease["owner"] != owner and lease["expires"] > time.time():
            return False
        _atomic_write(path, dump_json({"owner": owner, "expires": time.time() + lease_s}))
        return True

    @_off_loop
    def release(self, batch_id: str, owner: str) -> None:
        path = self._run(batch_id) / "lease"
        lease = _read_json(path)
        if lease is not None and lease["owner"] == owner:
            with _suppress_os_error():
                path.unlink()

    async def close(self) -> None:
        self._thread.shutdown(wait=True)


# Renew or take a lease atomically: free, or already ours.
_CLAIM_LUA = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


# Every command RedisStore sends (pipelines are MULTI/EXEC transactions; the lease scripts run
# by EVALSHA, loaded by SCRIPT LOAD when Redis lacks them): what a Redis ACL user confined to
# the batch key prefix needs (docs/security.md).
BATCH_REDIS_COMMANDS = ("get", "set", "mget", "exists", "del", "hset", "hgetall", "sadd", "srem", "smembers",
                        "scard", "zadd", "zrem", "zrevrange", "multi", "exec", "evalsha", "script|load")


class RedisStore(BatchStore):
    """Shared by every replica. Keys (under `prefix`): file:<t>:<id> (record),
    filedata:<t>:<id>, files:<t> (set of ids), batch:<t>:<id>, batches:<t>
    (sorted by creation), active (set of "<t>@<id>"), results:<id> (hash:
    index -> outcome), cancel:<id>, lease:<id> (the owner, expiring)."""

    def __init__(self, url: str, prefix: str, mac_key: bytes | None = None, *, ca_file: str | None = None,
                 cert_file: str | None = None, key_file: str | None = None) -> None:
        """`ca_file`, `cert_file`, `key_file`: TLS files for a rediss:// `url` (BatchConfig's
        redis_ca_file ...), passed to redis-py as the KV store's Redis tier passes its own."""
        import redis.asyncio as aioredis

        self._signer = RecordSigner(mac_key)

        # Every call has a deadline: a Redis that stops answering fails the call, not the gateway.
        self._redis = aioredis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5,
                                              **ssl_options(ca_file, cert_file, key_file))
        self._p = prefix
        self._claim = self._redis.register_script(_CLAIM_LUA)
        self._release = self._redis.register_script(_RELEASE_LUA)

    def _k(self, *parts: str) -> str:
        return self._p + ":".join(parts)

    async def put_file(self, tenant: str, record: dict, content: bytes) -> None:
        sealed = self._signer.seal(file_name(tenant, record["id"]), record, content)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self._k("filedata", tenant, record["id"]), content)
            pipe.set(self._k("file", tenant, record["id"]), sealed)
            pipe.sadd(self._k("files", tenant), record["id"])
            await pipe.execute()

    async def get_file(self, tenant: str, file_id: str) -> dict | None:
        sealed = self._signer.open(file_name(tenant, file_id), await self._redis.get(self._k("file", tenant, file_id)))
        return None if sealed is None else sealed.record

    async def file_content(self, tenant: str, file_id: str) -> bytes | None:
        raw, content = await self._redis.mget([self._k("file", tenant, file_id), self._k("filedata", tenant, file_id)])
        name = file_name(tenant, file_id)
        sealed = self._signer.open(name, raw)
        if sealed is None or not self._signer.content_matches(name, sealed, content):
            return None
        return content

    async def count_files(self, tenant: str) -> int:
        return await self._redis.scard(self._k("files", tenant))

    async def list_files(self, tenant: str) -> list[dict]:
        ids = [i.decode() for i in await self._redis.smembers(self._k("files", tenant))]
        if not ids:
            return []
        raws = await self._redis.mget([self._k("file", tenant, i) for i in ids])
        sealed = [self._signer.open(file_name(tenant, i), raw) for i, raw in zip(ids, raws)]
        return _newest_first([s.record for s in sealed if s is not None])

    async def delete_file(self, tenant: str, file_id: str) -> bool:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._k("file", tenant, file_id), self._k("filedata", tenant, file_id))
            pipe.srem(self._k("files", tenant), file_id)
            deleted, removed = await pipe.execute()
        return bool(deleted or removed)

    async def put_batch(self, tenant: str, record: dict) -> None:
        sealed = self._signer.seal(batch_name(tenant, record["id"]), record)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self._k("batch", tenant, record["id"]), sealed)
            pipe.zadd(self._k("batches", tenant), {record["id"]: record["created_at"]})
            if record.get("status") not in FINAL_STATUSES:
                pipe.sadd(self._k("active"), f"{tenant}@{record['id']}")
            await pipe.execute()

    def _open_batch(self, tenant: str, batch_id: str, raw: bytes | None) -> dict | None:
        sealed = self._signer.open(batch_name(tenant, batch_id), raw)
        return None if sealed is None else sealed.record

    async def get_batch(self, tenant: str, batch_id: str) -> dict | None:
        return self._open_batch(tenant, batch_id, await self._redis.get(self._k("batch", tenant, batch_id)))

    async def list_batches(self, tenant: str) -> list[dict]:
        ids = [i.decode() for i in await self._redis.zrevrange(self._k("batches", tenant), 0, -1)]
        if not ids:
            return []
        raws = await self._redis.mget([self._k("batch", tenant, i) for i in ids])
        records = [self._open_batch(tenant, i, raw) for i, raw in zip(ids, raws)]
        return [r for r in records if r is not None]

    async def active_batches(self) -> list[tuple[str, str]]:
        members = await self._redis.smembers(self._k("active"))
        return [tuple(m.decode().split("@", 1)) for m in members]

    async def set_inactive(self, tenant: str, batch_id: str) -> None:
        await self._redis.srem(self._k("active"), f"{tenant}@{batch_id}")

    async def delete_batch(self, tenant: str, batch_id: str) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._k("batch", tenant, batch_id), self._k("results", batch_id),
                        self._k("cancel", batch_id), self._k("lease", batch_id))
            pipe.zrem(self._k("batches", tenant), batch_id)
            pipe.srem(self._k("active"), f"{tenant}@{batch_id}")
            await pipe.execute()

    async def put_result(self, batch_id: str, index: int, result: dict) -> None:
        await self._redis.hset(self._k("results", batch_id), str(index),
                               self._signer.seal(result_name(batch_id, index), result))

    async def results(self, batch_id: str) -> dict[int, dict]:
        raw = await self._redis.hgetall(self._k("results", batch_id))
        out = {}
        for key, value in raw.items():
            if not key.isdigit():
                continue  # no index of ours: whoever wrote it had no business here
            sealed = self._signer.open(result_name(batch_id, int(key)), value)
            if sealed is not None:  # a result that does not verify is no result: the line runs again
                out[int(key)] = sealed.record
        return out

    async def request_cancel(self, batch_id: str) -> None:
        await self._redis.set(self._k("cancel", batch_id), b"1")

    async def cancel_requested(self, batch_id: str) -> bool:
        return bool(await self._redis.exists(self._k("cancel", batch_id)))

    async def claim(self, batch_id: str, owner: str, lease_s: float) -> bool:
        return bool(await self._claim(keys=[self._k("lease", batch_id)], args=[owner, int(lease_s * 1000)]))

    async def release(self, batch_id: str, owner: str) -> None:
        await self._release(keys=[self._k("lease", batch_id)], args=[owner])

    async def close(self) -> None:
        await self._redis.aclose()


FINAL_STATUSES = frozenset({"failed", "completed", "expired", "cancelled"})


def open_store(config, mac_key: bytes | None) -> BatchStore:
    """The store a BatchConfig names: Redis if it gives a URL (the config loader has put
    TESSERA_BATCH_REDIS_URL's there when the file had none), else its directory.
    `mac_key`: the key its records are signed with (signing.batch_mac_key); None: unsigned."""
    if config.redis_url:
        # Where the URL came from (the file or the environment) is not told apart: say which store it is.
        logging.getLogger(__name__).info("batch: files and batches in Redis at %s, keys under %r",
                                         redact_url(config.redis_url), config.key_prefix)
        return RedisStore(config.redis_url, config.key_prefix, mac_key, ca_file=config.redis_ca_file,
                          cert_file=config.redis_cert_file, key_file=config.redis_key_file)
    return DirectoryStore(config.directory, mac_key)
