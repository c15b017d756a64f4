"""The Redis tier: blocks shared by every pod of a model, with a TTL.

One key per block (``tessera:{fingerprint}:{rank}/{tp}:{hash}``): a prompt
that diverges mid-way still shares every block before the divergence, and
MGET / pipelines make a run of blocks one round trip anyway
(docs/benchmarks.md compares the read throughput with redis-benchmark's).

Failures never reach callers as errors: a timeout or a dead server is a
miss (or a dropped write), counted, and the tier backs off for a while so
that each engine step does not wait for another timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import redis
from redis.cluster import RedisCluster

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RedisTierConfig:
    # redis://[[user]:password@]host:port/db, or rediss:// for TLS (certificates
    # via the URL's ssl_* query parameters, as redis-py reads them).
    url: str
    ttl_seconds: int = 3600
    cluster: bool = False
    timeout_seconds: float = 0.25
    max_connections: int = 16
    # After a failure, skip Redis this long before trying again.
    backoff_seconds: float = 2.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"kv_redis_url must start with redis://, rediss:// or unix://, got {self.url!r}")
        if self.ttl_seconds < 1:
            raise ValueError(f"kv_redis_ttl must be >= 1 second, got {self.ttl_seconds}")
        if self.timeout_seconds <= 0:
            raise ValueError("kv_redis_timeout must be positive")


class RedisTier:
    def __init__(self, config: RedisTierConfig, namespace: str) -> None:
        self.config = config
        self.namespace = namespace.encode()
        common = dict(socket_timeout=config.timeout_seconds, socket_connect_timeout=config.timeout_seconds,
                      max_connections=config.max_connections)
        if config.cluster:
            self._client = RedisCluster.from_url(config.url, **common)
        else:
            self._client = redis.Redis.from_url(config.url, **common)
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.errors = 0
        self.available = self._ping()
        if not self.available:
            logger.warning("kv store: Redis at %s is unreachable; serving from the host tier", _redact(config.url))

    def key(self, block_hash: bytes) -> bytes:
        return self.namespace + block_hash.hex().encode()

    # -- failure handling -------------------------------------------------
    def _ping(self) -> bool:
        try:
            return bool(self._client.ping())
        except redis.RedisError as e:
            self._failed(e)
            return False

    def _usable(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, error: Exception) -> None:
        with self._lock:
            self.errors += 1
            self._down_until = time.monotonic() + self.config.backoff_seconds
            self.available = False
        logger.warning("kv store: Redis call failed (%s); treating as a miss for %.1fs",
                       type(error).__name__, self.config.backoff_seconds)

    def _ok(self) -> None:
        self.available = True

    # -- operations -------------------------------------------------------
    def get_many(self, hashes: list[bytes]) -> list[bytes | None]:
        """Values of the hashes in one round trip; all None when Redis is down."""
        if not hashes or not self._usable():
            return [None] * len(hashes)
        keys = [self.key(h) for h in hashes]
        try:
            values = self._client.mget_nonatomic(keys) if self.config.cluster else self._client.mget(keys)
        except redis.RedisError as e:
            self._failed(e)
            return [None] * len(hashes)
        self._ok()
        return values

    def exists_many(self, hashes: list[bytes]) -> list[bool]:
        if not hashes or not self._usable():
            return [False] * len(hashes)
        try:
            pipe = self._client.pipeline(transaction=False)
            for h in hashes:
                pipe.exists(self.key(h))
            found = pipe.execute()
        except redis.RedisError as e:
            self._failed(e)
            return [False] * len(hashes)
        self._ok()
        return [bool(x) for x in found]

    def put_many(self, items: list[tuple[bytes, bytes]]) -> bool:
        if not items or not self._usable():
            return not items
        try:
            pipe = self._client.pipeline(transaction=False)
            for block_hash, value in items:
                pipe.set(self.key(block_hash), value, ex=self.config.ttl_seconds)
            pipe.execute()
        except redis.RedisError as e:
            self._failed(e)
            return False
        self._ok()
        return True

    def delete(self, block_hash: bytes) -> None:
        if not self._usable():
            return
        try:
            self._client.delete(self.key(block_hash))
        except redis.RedisError as e:
            self._failed(e)

    def close(self) -> None:
        try:
            self._client.close()
        except redis.RedisError:
            pass


def _redact(url: str) -> str:
    """The URL without its password, for logs."""
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme}://***@{rest.split('@', 1)[1]}"
