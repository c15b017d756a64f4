"""The Redis tier: blocks shared by every pod of a model, with a TTL.

One key per block (``{key_prefix}{fingerprint}:{rank}/{tp}:{hash}``): a prompt
that diverges mid-way still shares every block before the divergence, and
MGET / pipelines make a run of blocks one round trip anyway
(docs/benchmarks.md compares the read throughput with redis-benchmark's).
The key prefix (default ``tessera:``) lets a Redis ACL confine each
InferenceService's pods to keys of their own (README, "The KV store"); the
tier sends only the commands in ``REDIS_COMMANDS``.

Failures never reach callers as errors: a timeout or a dead server is a
miss (or a dropped write), counted, and the tier backs off for a while so
that each engine step does not wait for another timeout.

The URL may hold a password: it reaches the engine by environment
(``TESSERA_KV_REDIS_URL``), and every message shows it through ``redact_url``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import redis
from redis.cluster import RedisCluster

logger = logging.getLogger(__name__)

# The engine reads the Redis URL from here when --kv-redis-url is not given
# (the operator sets it from a Secret: argv is world-readable in /proc).
REDIS_URL_ENV = "TESSERA_KV_REDIS_URL"
DEFAULT_KEY_PREFIX = "tessera:"
# Every command the tier sends (for a Redis ACL); ping at start-up, mget
# (per-node under Redis Cluster) to read, set with EX to write, exists for
# lookups, del for refused values.
REDIS_COMMANDS = ("ping", "mget", "set", "exists", "del")
# Characters a key prefix may not hold: Redis ACL key patterns are globs
# (``~prefix*``), so a glob character would widen the pattern.
_GLOB_CHARS = frozenset("*?[]\\")
_SCHEMES = ("redis://", "rediss://", "unix://")


@dataclass(frozen=True)
class RedisTierConfig:
    # redis://[[user]:password@]host:port/db, rediss:// for TLS, or unix://.
    # Never shown: messages use redact_url.
    url: str = field(repr=False)
    # Seconds a block lives in Redis.
    ttl_seconds: int = 3600
    # The URL names one node of a Redis Cluster.
    cluster: bool = False
    # Socket (connect and call) timeout; a slow Redis is a miss, not a stall.
    timeout_seconds: float = 0.25
    max_connections: int = 16
    # After a failure, skip Redis this long before trying again.
    backoff_seconds: float = 2.0
    # Prepended to every key (an ACL can then confine a deployment to ``prefix*``).
    key_prefix: str = DEFAULT_KEY_PREFIX
    # TLS (rediss:// only): the CA bundle that signs the server's certificate,
    # and a client certificate and its key for servers that demand one.
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def __post_init__(self) -> None:
        check_redis_url(self.url)
        if self.ttl_seconds < 1:
            raise ValueError(f"kv_redis_ttl must be >= 1 second, got {self.ttl_seconds}")
        if self.timeout_seconds <= 0:
            raise ValueError("kv_redis_timeout must be positive")
        check_key_prefix(self.key_prefix)
        self._check_tls()

    def _check_tls(self) -> None:
        check_tls_files(self.url, self.ca_file, self.cert_file, self.key_file)

    def ssl_options(self) -> dict[str, str]:
        return ssl_options(self.ca_file, self.cert_file, self.key_file)


def check_tls_files(url: str | None, ca_file: str | None, cert_file: str | None, key_file: str | None,
                    prefix: str = "kv_redis_", url_name: str = "kv_redis_url") -> None:
    """A Redis client's TLS files (named `prefix` + ca_file, cert_file, key_file in
    messages): each needs a rediss:// `url` and must exist; a key needs its certificate."""
    for suffix, path in (("ca_file", ca_file), ("cert_file", cert_file), ("key_file", key_file)):
        if path is None:
            continue
        if url is None or not url.startswith("rediss://"):
            raise ValueError(f"{prefix}{suffix} needs a rediss:// {url_name} (TLS)")
        if not Path(path).is_file():
            raise ValueError(f"{prefix}{suffix}: no such file {path}")
    if key_file is not None and cert_file is None:
        raise ValueError(f"{prefix}key_file needs {prefix}cert_file (the client certificate)")


def ssl_options(ca_file: str | None, cert_file: str | None, key_file: str | None) -> dict[str, str]:
    """redis-py's keyword arguments for the TLS files that are set."""
    options = {"ssl_ca_certs": ca_file, "ssl_certfile": cert_file, "ssl_keyfile": key_file}
    return {k: v for k, v in options.items() if v is not None}


def redact_url(url: str) -> str:
    """The URL without its credentials (user, password, query), for messages."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "***"  # not a URL: nothing of it can be told apart from a password
    if "@" in rest:  # the last '@' ends the credentials, even one holding '@' or '/'
        rest = "***@" + rest.rsplit("@", 1)[1]
    if "?" in rest:  # redis-py also reads password=... from the query
        rest = rest.split("?", 1)[0] + "?***"
    return f"{scheme}://{rest}"


def check_redis_url(url: str, name: str = "kv_redis_url") -> None:
    """ValueError naming ``name`` unless ``url`` is a Redis URL (the message never shows its credentials)."""
    if not isinstance(url, str) or not url.startswith(_SCHEMES):
        scheme = url.partition("://")[0] if isinstance(url, str) and "://" in url else None
        got = f"scheme {scheme!r}" if scheme is not None and scheme.isalnum() else "a value without one"
        raise ValueError(f"{name} must start with redis://, rediss:// or unix://, got {got}")
    try:
        redis.connection.parse_url(url)  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
    except ValueError:
        # parse_url's own message may quote parts of the URL.
        raise ValueError(f"{name} {redact_url(url)} is not a valid Redis URL") from None


def check_key_prefix(prefix: str, name: str = "kv_redis_key_prefix") -> None:
    """ValueError naming ``name`` unless ``prefix`` can head a Redis ACL key pattern."""
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"{name} must be a non-empty string")
    if len(prefix) > 200 or not prefix.isprintable() or any(c.isspace() or c in _GLOB_CHARS for c in prefix):
        raise ValueError(
            f"{name} {prefix[:200]!r} must be at most 200 printable characters without spaces or "
            "glob characters (* ? [ ] \\): a Redis ACL pattern is the prefix followed by *")


class RedisTier:
    def __init__(self, config: RedisTierConfig, namespace: str, keys_per_read: int = 0) -> None:
        """``namespace``: what follows the key prefix in every key (the
        engine's fingerprint and TP rank), so readers of other layouts never
        meet these keys. ``keys_per_read``: a read of more keys is several
        MGETs in one pipeline (one round trip): Redis answers each as soon as
        it is built, so no socket read waits for a whole prompt's worth (an
        8B model's 2k-token prompt is 256 MB); 0: one MGET."""
        self.config = config
        self.keys_per_read = keys_per_read
        self.namespace = (config.key_prefix + namespace).encode()
        common = dict(socket_timeout=config.timeout_seconds, socket_connect_timeout=config.timeout_seconds,
                      max_connections=config.max_connections, **config.ssl_options())
        self._client: redis.Redis | RedisCluster
        if config.cluster:
            self._client = RedisCluster.from_url(config.url, **common)
        else:
            self._client = redis.Redis.from_url(config.url, **common)
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.errors = 0
        self.available = self._ping()
        if not self.available:
            logger.warning("kv store: Redis at %s is unreachable; serving from the host tier", redact_url(config.url))

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
            if isinstance(self._client, RedisCluster):
                values = self._client.mget_nonatomic(keys)  # already one MGET per node
            elif 0 < self.keys_per_read < len(keys):
                pipe = self._client.pipeline(transaction=False)
                for i in range(0, len(keys), self.keys_per_read):
                    pipe.mget(keys[i:i + self.keys_per_read])
                values = [v for chunk in pipe.execute() for v in chunk]
            else:
                values = self._client.mget(keys)
        except redis.RedisError as e:
            self._failed(e)
            return [None] * len(hashes)
        self._ok()
        # The client is made without decode_responses: values come back as bytes, never str.
        return cast("list[bytes | None]", values)

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

