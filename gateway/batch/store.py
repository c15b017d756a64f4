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
"""

from __future__ import annotations

import abc
import asyncio
import json
import os
import re
import tempfile
import time
from pathlib import Path

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
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        return None


def _dump(record: dict) -> bytes:
    return json.dumps(record, separators=(",", ":")).encode()


class DirectoryStore(BatchStore):
    """One replica's store: root/tenants/<tenant>/{files,batches}/, root/runs/<batch id>/.
    Tenant names are plain (gateway/tenants.py) and ids are checked by the API, so no
    path is built from anything a client chose freely. Leases here only keep one
    process's runner from racing itself and a restarted process from taking over
    before the dead one's lease expires: replicas need RedisStore."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _tenant(self, tenant: str) -> Path:
        return self.root / "tenants" / tenant

    def _run(self, batch_id: str) -> Path:
        return self.root / "runs" / batch_id

    async def put_file(self, tenant: str, record: dict, content: bytes) -> None:
        base = self._tenant(tenant) / "files"
        await asyncio.to_thread(_atomic_write, base / f"{record['id']}.data", content)
        _atomic_write(base / f"{record['id']}.json", _dump(record))  # the record last: it makes the file exist

    async def get_file(self, tenant: str, file_id: str) -> dict | None:
        return _read_json(self._tenant(tenant) / "files" / f"{file_id}.json")

    async def file_content(self, tenant: str, file_id: str) -> bytes | None:
        if await self.get_file(tenant, file_id) is None:
            return None
        return await asyncio.to_thread((self._tenant(tenant) / "files" / f"{file_id}.data").read_bytes)

    async def count_files(self, tenant: str) -> int:
        base = self._tenant(tenant) / "files"
        return len(list(base.glob("*.json"))) if base.exists() else 0

    async def put_batch(self, tenant: str, record: dict) -> None:
        _atomic_write(self._tenant(tenant) / "batches" / f"{record['id']}.json", _dump(record))
        if record.get("status") not in FINAL_STATUSES:
            _atomic_write(self.root / "active" / f"{tenant}@{record['id']}", b"")

    async def get_batch(self, tenant: str, batch_id: str) -> dict | None:
        return _read_json(self._tenant(tenant) / "batches" / f"{batch_id}.json")

    async def list_batches(self, tenant: str) -> list[dict]:
        base = self._tenant(tenant) / "batches"
        records = [r for p in base.glob("*.json") if (r := _read_json(p)) is not None] if base.exists() else []
        return sorted(records, key=lambda r: (r["created_at"], r["id"]), reverse=True)

    async def active_batches(self) -> list[tuple[str, str]]:
        base = self.root / "active"
        if not base.exists():
            return []
        return [tuple(p.name.split("@", 1)) for p in base.iterdir() if "@" in p.name]

    async def set_inactive(self, tenant: str, batch_id: str) -> None:
        with _suppress_os_error():
            (self.root / "active" / f"{tenant}@{batch_id}").unlink()

    async def put_result(self, batch_id: str, index: int, result: dict) -> None:
        _atomic_write(self._run(batch_id) / "results" / f"{index}.json", _dump(result))

    async def results(self, batch_id: str) -> dict[int, dict]:
        base = self._run(batch_id) / "results"
        if not base.exists():
            return {}
        return {int(p.stem): r for p in base.glob("*.json") if (r := _read_json(p)) is not None}

    async def request_cancel(self, batch_id: str) -> None:
        _atomic_write(self._run(batch_id) / "cancel", b"")

    async def cancel_requested(self, batch_id: str) -> bool:
        return (self._run(batch_id) / "cancel").exists()

    async def claim(self, batch_id: str, owner: str, lease_s: float) -> bool:
        path = self._run(batch_id) / "lease"
        lease = _read_json(path)
        if lease is not None and lease["owner"] != owner and lease["expires"] > time.time():
            return False
        _atomic_write(path, _dump({"owner": owner, "expires": time.time() + lease_s}))
        return True

    async def release(self, batch_id: str, owner: str) -> None:
        path = self._run(batch_id) / "lease"
        lease = _read_json(path)
        if lease is not None and lease["owner"] == owner:
            with _suppress_os_error():
                path.unlink()


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


class RedisStore(BatchStore):
    """Shared by every replica. Keys (under `prefix`): file:<t>:<id> (record),
    filedata:<t>:<id>, files:<t> (set of ids), batch:<t>:<id>, batches:<t>
    (sorted by creation), active (set of "<t>@<id>"), results:<id> (hash:
    index -> outcome), cancel:<id>, lease:<id> (the owner, expiring)."""

    def __init__(self, url: str, prefix: str) -> None:
        import redis.asyncio as aioredis

        # Every call has a deadline: a Redis that stops answering fails the call, not the gateway.
        self._redis = aioredis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)
        self._p = prefix
        self._claim = self._redis.register_script(_CLAIM_LUA)
        self._release = self._redis.register_script(_RELEASE_LUA)

    def _k(self, *parts: str) -> str:
        return self._p + ":".join(parts)

    async def put_file(self, tenant: str, record: dict, content: bytes) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self._k("filedata", tenant, record["id"]), content)
            pipe.set(self._k("file", tenant, record["id"]), _dump(record))
            pipe.sadd(self._k("files", tenant), record["id"])
            await pipe.execute()

    async def get_file(self, tenant: str, file_id: str) -> dict | None:
        raw = await self._redis.get(self._k("file", tenant, file_id))
        return None if raw is None else json.loads(raw)

    async def file_content(self, tenant: str, file_id: str) -> bytes | None:
        return await self._redis.get(self._k("filedata", tenant, file_id))

    async def count_files(self, tenant: str) -> int:
        return await self._redis.scard(self._k("files", tenant))

    async def put_batch(self, tenant: str, record: dict) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self._k("batch", tenant, record["id"]), _dump(record))
            pipe.zadd(self._k("batches", tenant), {record["id"]: record["created_at"]})
            if record.get("status") not in FINAL_STATUSES:
                pipe.sadd(self._k("active"), f"{tenant}@{record['id']}")
            await pipe.execute()

    async def get_batch(self, tenant: str, batch_id: str) -> dict | None:
        raw = await self._redis.get(self._k("batch", tenant, batch_id))
        return None if raw is None else json.loads(raw)

    async def list_batches(self, tenant: str) -> list[dict]:
        ids = await self._redis.zrevrange(self._k("batches", tenant), 0, -1)
        if not ids:
            return []
        raws = await self._redis.mget([self._k("batch", tenant, i.decode()) for i in ids])
        return [json.loads(r) for r in raws if r is not None]

    async def active_batches(self) -> list[tuple[str, str]]:
        members = await self._redis.smembers(self._k("active"))
        return [tuple(m.decode().split("@", 1)) for m in members]

    async def set_inactive(self, tenant: str, batch_id: str) -> None:
        await self._redis.srem(self._k("active"), f"{tenant}@{batch_id}")

    async def put_result(self, batch_id: str, index: int, result: dict) -> None:
        await self._redis.hset(self._k("results", batch_id), str(index), _dump(result))

    async def results(self, batch_id: str) -> dict[int, dict]:
        raw = await self._redis.hgetall(self._k("results", batch_id))
        return {int(k): json.loads(v) for k, v in raw.items()}

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


def open_store(config) -> BatchStore:
    """The store a BatchConfig names: Redis if it gives a URL, else its directory."""
    if config.redis_url:
        return RedisStore(config.redis_url, config.key_prefix)
    return DirectoryStore(config.directory)
