"""Block codec, host tier, Redis tier (a real redis-server) and the tiered store."""

from __future__ import annotations

import struct
import time
import zlib

import pytest
import torch

from kv_store.block_hash import hash_request_tokens
from kv_store.codec import HEADER_SIZE, MAC_BYTES, BlockCodec, BlockLayout, CorruptBlockError
from kv_store.host_tier import HostMemoryTier
from kv_store.redis_tier import RedisTier, RedisTierConfig
from kv_store.tiered_store import TieredKVStore
from tessera.internal_secret import InternalSecret

LAYOUT = BlockLayout(b"f" * 16, tp_rank=0, tp_size=1, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8,
                     dtype=torch.bfloat16)
# This deployment's KV key, and another deployment's.
KEY = InternalSecret.from_text("kv-store-tests-deployment-a-0123456789").kv_mac_key
OTHER_KEY = InternalSecret.from_text("kv-store-tests-deployment-b-0123456789").kv_mac_key


def _block(seed: int, layout: BlockLayout = LAYOUT) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.block_shape, generator=g).to(layout.dtype)


def _hash(i: int) -> bytes:
    return hash_request_tokens(list(range(i, i + 4)), 4)[0]


# -- codec --------------------------------------------------------------------
def _codec(key: bytes | None = KEY, layout: BlockLayout = LAYOUT) -> BlockCodec:
    return BlockCodec(layout, key)


def test_codec_round_trip_signed_and_unsigned():
    codec = _codec()
    block = _block(1)
    value = codec.encode(_hash(0), block)
    assert len(value) == HEADER_SIZE + LAYOUT.payload_bytes
    # The host tier's form: MAC zero, decoded without verification.
    assert value[HEADER_SIZE - MAC_BYTES: HEADER_SIZE] == bytes(MAC_BYTES)
    assert torch.equal(codec.decode(_hash(0), value, verify_mac=False), block)
    # The shared tiers' form: the same bytes with the MAC set.
    signed = codec.sign(value)
    assert signed[:HEADER_SIZE - MAC_BYTES] == value[:HEADER_SIZE - MAC_BYTES]
    assert signed[HEADER_SIZE:] == value[HEADER_SIZE:]
    assert torch.equal(codec.decode(_hash(0), signed), block)
    with pytest.raises(CorruptBlockError) as info:
        codec.decode(_hash(0), value)  # an unsigned value never passes for a shared one
    assert info.value.reason == "mac"


def test_a_codec_without_a_key_cannot_sign_or_verify():
    codec = _codec(key=None)
    value = codec.encode(_hash(0), _block(1))
    assert torch.equal(codec.decode(_hash(0), value, verify_mac=False), _block(1))
    for call in (lambda: codec.sign(value), lambda: codec.decode(_hash(0), value)):
        with pytest.raises(ValueError, match="kv_mac_key"):
            call()
    with pytest.raises(ValueError, match="kv_mac_key"):
        BlockCodec(LAYOUT, b"short")
    assert "signs=False" in repr(codec) and KEY.hex() not in repr(_codec())


@pytest.mark.parametrize("field,change", [
    ("fingerprint", dict(fingerprint=b"g" * 16)),
    ("tp_rank", dict(tp_rank=1, tp_size=2)),
    ("num_layers", dict(num_layers=3)),
    ("block_size", dict(block_size=8)),
    ("dtype", dict(dtype=torch.float16)),
])
def test_codec_rejects_a_different_layout(field, change):
    value = _codec().sign(_codec().encode(_hash(0), _block(1)))
    other = BlockLayout(**{**LAYOUT.__dict__, **change})
    with pytest.raises(CorruptBlockError) as info:
        _codec(layout=other).decode(_hash(0), value)
    assert info.value.reason in ("misaddressed", "truncated")


def _genuine(i: int) -> bytes:
    return _codec().sign(_codec().encode(_hash(i), _block(i)))


def _tampered_payload(value: bytes) -> bytes:
    """The same header (and MAC), another block's KV: what a forger writes."""
    return value[:HEADER_SIZE] + _codec().encode(_hash(9), _block(9))[HEADER_SIZE:]


def _v1_forgery(value: bytes) -> bytes:
    """A value in the old format (TKV1, CRC32, no MAC) with a valid header
    and a recomputed CRC32 over a forged payload: what CRC32 used to accept."""
    v1 = struct.Struct("<4sH16sHHIIB4I32sQI")
    lay = LAYOUT
    payload = _codec().encode(_hash(9), _block(9))[HEADER_SIZE:]
    crc = zlib.crc32(payload, zlib.crc32(_hash(0)))
    header = v1.pack(b"TKV1", 1, lay.fingerprint, lay.tp_rank, lay.tp_size, lay.block_size, lay.num_layers, 3, 2,
                     lay.block_size, lay.num_kv_heads, lay.head_dim, _hash(0), len(payload), crc)
    return header + payload


FORGERIES = {
    # name: (how the value under _hash(0)'s key is made from its genuine value, reason)
    "payload forged under a valid header": (_tampered_payload, "mac"),
    "old format with a recomputed CRC32": (_v1_forgery, "format"),
    "signed by another deployment": (lambda v: _codec(OTHER_KEY).sign(_tampered_payload(v)), "mac"),
    "replayed from another deployment": (lambda v: _codec(OTHER_KEY).sign(v), "mac"),
    "another block's value relabelled": (lambda v: _genuine(1).replace(_hash(1), _hash(0), 1), "mac"),
    "unsigned": (lambda v: v[:HEADER_SIZE - MAC_BYTES] + bytes(MAC_BYTES) + v[HEADER_SIZE:], "mac"),
    "one bit flipped": (lambda v: v[:HEADER_SIZE + 100] + bytes([v[HEADER_SIZE + 100] ^ 0x40]) + v[HEADER_SIZE + 101:],
                        "mac"),
    "truncated payload": (lambda v: v[:-7], "truncated"),
    "truncated header": (lambda v: v[:HEADER_SIZE - 1], "truncated"),
    "another block's value": (lambda v: _genuine(1), "misaddressed"),
}


@pytest.mark.parametrize("name", list(FORGERIES))
def test_codec_refuses_forged_replayed_truncated_and_misaddressed_values(name):
    make, reason = FORGERIES[name]
    with pytest.raises(CorruptBlockError) as info:
        _codec().decode(_hash(0), make(_genuine(0)))
    assert info.value.reason == reason


# -- host tier -----------------------------------------------------------------
def test_host_tier_respects_its_byte_budget_in_lru_order():
    value_size = 100
    host = HostMemoryTier(capacity_bytes=3 * value_size)
    for i in range(3):
        assert host.put(_hash(i), bytes(value_size))
    assert host.get(_hash(0)) is not None  # touch: 0 becomes most recent
    host.put(_hash(3), bytes(value_size))  # evicts the least recent: 1
    assert _hash(1) not in host
    assert host.lru_order() == [_hash(2), _hash(0), _hash(3)]
    assert host.used_bytes == 3 * value_size and host.evictions == 1
    assert not host.put(_hash(9), bytes(4 * value_size))  # never fits
    assert host.num_leading_hits([_hash(2), _hash(0), _hash(1), _hash(3)]) == 2


# -- Redis tier ------------------------------------------------------------------
def _redis_tier(url: str, **kw) -> RedisTier:
    return RedisTier(RedisTierConfig(url=url, **kw), namespace="fp:0/1:")


def test_redis_tier_round_trip_with_namespace_and_ttl(redis_server):
    tier = _redis_tier(redis_server.url, ttl_seconds=120)
    assert tier.available
    assert tier.put_many([(_hash(0), b"a"), (_hash(1), b"b")])
    assert tier.get_many([_hash(0), _hash(2), _hash(1)]) == [b"a", None, b"b"]
    key = b"tessera:fp:0/1:" + _hash(0).hex().encode()
    assert redis_server.client.get(key) == b"a"
    assert 0 < redis_server.client.ttl(key) <= 120
    assert tier.exists_many([_hash(1), _hash(5)]) == [True, False]


def test_redis_tier_unreachable_is_a_miss_not_an_error():
    tier = _redis_tier("redis://127.0.0.1:1/0", timeout_seconds=0.1)
    assert not tier.available
    assert tier.get_many([_hash(0)]) == [None]
    assert not tier.put_many([(_hash(0), b"x")])


def test_redis_tier_authenticates_from_the_url(tmp_path):
    from kv_store.local_redis import RedisServer

    server = RedisServer(tmp_path, password="s3cret")
    try:
        tier = _redis_tier(server.url)
        assert tier.available and tier.put_many([(_hash(0), b"v")])
        assert tier.get_many([_hash(0)]) == [b"v"]
        wrong = _redis_tier(server.url.replace("s3cret", "wrong"))
        assert not wrong.available and wrong.get_many([_hash(0)]) == [None]
    finally:
        server.stop()


def test_redis_tier_spreads_blocks_over_a_redis_cluster(tmp_path):
    from kv_store.local_redis import RedisClusterServers

    cluster = RedisClusterServers(tmp_path)
    try:
        tier = _redis_tier(cluster.url, cluster=True, timeout_seconds=2.0)
        items = [(_hash(i), f"value-{i}".encode()) for i in range(40)]
        assert tier.put_many(items)
        assert tier.get_many([h for h, _ in items]) == [v for _, v in items]
        assert tier.exists_many([_hash(0), _hash(99)]) == [True, False]
        store = TieredKVStore(_codec(), HostMemoryTier(0), tier)
        store.put(_hash(100), _block(3), sync_remote=True)
        assert torch.equal(store.get_blocks([_hash(100)])[0], _block(3))
        # The keys landed on more than one node.
        import redis as redis_py

        sizes = [redis_py.Redis(port=int(n.args[2])).dbsize() for n in cluster.nodes]
        assert sum(1 for s in sizes if s) > 1
    finally:
        cluster.stop()


def test_redis_config_rejects_bad_values():
    with pytest.raises(ValueError, match="kv_redis_url"):
        RedisTierConfig(url="http://x")
    with pytest.raises(ValueError, match="kv_redis_ttl"):
        RedisTierConfig(url="redis://x", ttl_seconds=0)
    for prefix in ("", "a b", "tessera:*", "t[1]:", "x\n"):
        with pytest.raises(ValueError, match="kv_redis_key_prefix"):
            RedisTierConfig(url="redis://x", key_prefix=prefix)


@pytest.mark.parametrize("url", [
    "http://user:hunter2-pw@redis:6379/0",  # a bad scheme
    "redis:/:hunter2-pw@redis:6379/0",  # no scheme at all
    "redis://:hunter2-pw@redis:notaport/0",  # a bad port: redis-py's own message quotes it
    "redis://redis:6379/0?password=hunter2-pw&db=x",
])
def test_redis_url_errors_never_show_the_password(url):
    with pytest.raises(ValueError, match="kv_redis_url") as info:
        RedisTierConfig(url=url)
    assert "hunter2" not in str(info.value)
    assert "hunter2" not in repr(RedisTierConfig(url="redis://:hunter2-pw@redis:6379/0"))


def test_redact_url_hides_user_password_and_query():
    from kv_store.redis_tier import redact_url

    assert redact_url("redis://user:pw@host:6379/0") == "redis://***@host:6379/0"
    assert redact_url("rediss://:p@ss/w@rd@host:6380/1") == "rediss://***@host:6380/1"
    assert redact_url("redis://host:6379/0?password=pw") == "redis://host:6379/0?***"
    assert redact_url("unix://:pw@/run/redis.sock") == "unix://***@/run/redis.sock"
    assert redact_url("no-scheme:pw@host") == "***"


def test_unreachable_redis_is_logged_without_its_password(caplog):
    with caplog.at_level("WARNING"):
        tier = _redis_tier("redis://:hunter2-pw@127.0.0.1:1/0", timeout_seconds=0.1)
    assert not tier.available
    assert "unreachable" in caplog.text and "127.0.0.1:1" in caplog.text and "hunter2" not in caplog.text


def test_tls_files_are_checked_and_need_rediss(tmp_path):
    (tmp_path / "ca.crt").write_text("x")
    with pytest.raises(ValueError, match="kv_redis_ca_file needs a rediss://"):
        RedisTierConfig(url="redis://h", ca_file=str(tmp_path / "ca.crt"))
    with pytest.raises(ValueError, match="kv_redis_cert_file: no such file"):
        RedisTierConfig(url="rediss://h", cert_file=str(tmp_path / "absent.crt"))
    with pytest.raises(ValueError, match="kv_redis_key_file needs kv_redis_cert_file"):
        RedisTierConfig(url="rediss://h", key_file=str(tmp_path / "ca.crt"))


def _make_tls_files(tmp_path):
    """A CA, and a server and a client certificate it signed (openssl, EC keys: fast)."""
    import subprocess

    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=tmp_path, check=True, capture_output=True, timeout=30)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=test-ca")
    (tmp_path / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.crt", "-days", "1", "-extfile", "san.cnf")
    return {n: str(tmp_path / n) for n in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")}


def test_redis_tier_speaks_mutual_tls_with_the_configured_files(tmp_path):
    import shutil
    import subprocess

    from kv_store.local_redis import _wait_ping
    from tessera.child_process import free_port

    files = _make_tls_files(tmp_path)
    port = free_port()
    server = subprocess.Popen(
        [shutil.which("redis-server"), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", files["server.crt"], "--tls-key-file", files["server.key"],
         "--tls-ca-cert-file", files["ca.crt"], "--tls-auth-clients", "yes", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import redis as redis_py

        _wait_ping(redis_py.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=files["ca.crt"],
                                  ssl_certfile=files["client.crt"], ssl_keyfile=files["client.key"],
                                  socket_timeout=0.5))
        url = f"rediss://127.0.0.1:{port}/0"
        tier = _redis_tier(url, ca_file=files["ca.crt"], cert_file=files["client.crt"], key_file=files["client.key"],
                           timeout_seconds=2.0)
        assert tier.available and tier.put_many([(_hash(0), b"v")]) and tier.get_many([_hash(0)]) == [b"v"]
        # Without the client certificate the server refuses the handshake: a miss, not an error.
        no_cert = _redis_tier(url, ca_file=files["ca.crt"], timeout_seconds=2.0)
        assert not no_cert.available and no_cert.get_many([_hash(0)]) == [None]
    finally:
        server.kill()
        server.wait()


def test_a_redis_acl_user_confined_to_the_key_prefix_serves_the_tier(redis_server):
    """The ACL of the README: exactly REDIS_COMMANDS on ~prefix*."""
    from kv_store.redis_tier import REDIS_COMMANDS

    prefix = "tessera:team-a/llama:"
    redis_server.client.execute_command(
        "ACL", "SETUSER", "llama-pods", "on", ">pods-password-0123", "resetkeys", f"~{prefix}*", "resetchannels",
        "-@all", *[f"+{c}" for c in REDIS_COMMANDS])
    url = f"redis://llama-pods:pods-password-0123@127.0.0.1:{redis_server.port}/0"
    store = TieredKVStore(_codec(), HostMemoryTier(0), _redis_tier(url, key_prefix=prefix))
    store.put(_hash(0), _block(0), sync_remote=True)
    assert store.lookup([_hash(0)]) == 1 and torch.equal(store.get_blocks([_hash(0)])[0], _block(0))
    store.remote.delete(_hash(0))
    assert store.remote.errors == 0
    assert redis_server.client.execute_command("ACL", "LOG") == []  # no command was denied
    assert redis_server.client.dbsize() == 0
    # Another deployment's prefix: every write is refused by Redis (a dropped write, never an error).
    other = _redis_tier(url, key_prefix="tessera:team-b/llama:")
    assert not other.put_many([(_hash(0), b"v")]) and other.errors == 1
    store.close()


# -- tiered store ------------------------------------------------------------------
def _store(url: str | None = None, host_bytes: int = 1 << 20, key: bytes | None = KEY, **kw) -> TieredKVStore:
    remote = _redis_tier(url) if url else None
    return TieredKVStore(_codec(key), HostMemoryTier(host_bytes), remote, **kw)


def test_the_redis_tier_needs_a_mac_key(redis_server):
    with pytest.raises(ValueError, match="kv_mac_key"):
        _store(redis_server.url, key=None)
    _store(key=None)  # the host tier alone needs none


def test_only_values_bound_for_redis_are_signed(redis_server):
    store = _store(redis_server.url)
    store.put(_hash(0), _block(0), sync_remote=True)
    store.put(_hash(1), _block(1))
    assert store.flush()
    for h in (_hash(0), _hash(1)):
        in_redis = redis_server.client.get(store.remote.key(h))
        assert torch.equal(store.codec.decode(h, in_redis), store.codec.decode(h, store.host.get(h), verify_mac=False))
        assert store.host.get(h)[HEADER_SIZE - MAC_BYTES: HEADER_SIZE] == bytes(MAC_BYTES)
    store.close()


def test_put_reaches_both_tiers_and_get_promotes(redis_server):
    store = _store(redis_server.url)
    blocks = [_block(i) for i in range(3)]
    for i, b in enumerate(blocks):
        store.put(_hash(i), b)
    assert store.flush()
    assert store.lookup([_hash(0), _hash(1), _hash(2), _hash(3)]) == 3
    # A second store (another pod) with an empty host tier reads from Redis.
    other = _store(redis_server.url)
    got = other.get_blocks([_hash(0), _hash(1), _hash(2), _hash(3)])
    assert len(got) == 3 and all(torch.equal(g, b) for g, b in zip(got, blocks))
    assert other.stats.redis_hits == 3 and other.stats.host_hits == 0
    assert other.get_blocks([_hash(0)]) and other.stats.host_hits == 1  # promoted
    store.close()
    other.close()


def test_refused_redis_values_are_misses_deleted_and_counted_by_reason(redis_server):
    """Every forgery of the codec test, planted in Redis: refused, deleted,
    counted, never promoted to the host tier."""
    writer = _store(redis_server.url)
    writer.put(_hash(0), _block(0), sync_remote=True)
    genuine = redis_server.client.get(writer.remote.key(_hash(0)))
    reader = _store(redis_server.url)
    expected: dict = {}
    for name, (make, reason) in FORGERIES.items():
        key = writer.remote.key(_hash(0))
        redis_server.client.set(key, make(genuine))
        assert reader.get_blocks([_hash(0), _hash(1)]) == [], name
        assert redis_server.client.get(key) is None, name
        expected[("redis", reason)] = expected.get(("redis", reason), 0) + 1
        assert reader.stats.rejected == expected, name
    assert reader.stats.redis_hits == 0 and len(reader.host) == 0
    # The genuine value is still accepted, and the run stops at a refused one.
    for i in range(3):
        writer.put(_hash(i), _block(i), sync_remote=True)
    redis_server.client.set(writer.remote.key(_hash(1)), _tampered_payload(genuine))
    got = reader.get_blocks([_hash(0), _hash(1), _hash(2)])
    assert len(got) == 1 and torch.equal(got[0], _block(0))
    assert reader.stats.rejected[("redis", "mac")] == expected[("redis", "mac")] + 1
    assert reader.stats.rejected_values == sum(expected.values()) + 1


def test_refused_values_are_exposed_as_a_metric_by_tier_and_reason(redis_server):
    from engine_pod.server.metrics import KVStoreCollector

    store = _store(redis_server.url)
    store.put(_hash(0), _block(0), sync_remote=True)
    redis_server.client.set(store.remote.key(_hash(0)), b"garbage")
    store.host.delete(_hash(0))
    assert store.get_blocks([_hash(0)]) == []
    samples = {(s.name, s.labels.get("tier"), s.labels.get("reason")): s.value
               for fam in KVStoreCollector(store, "m").collect() for s in fam.samples}
    assert samples[("tessera:kv_store_rejected_values_total", "redis", "truncated")] == 1
    assert samples[("tessera:kv_store_rejected_values_total", "redis", "mac")] == 0
    assert samples[("tessera:kv_store_rejected_values_total", "host", "mac")] == 0


def test_write_behind_drops_when_the_queue_is_full(redis_server):
    store = _store(redis_server.url, write_queue_size=1)
    redis_server.proc.send_signal(__import__("signal").SIGSTOP)  # Redis stalls: the queue fills
    try:
        for i in range(20):
            store.put(_hash(i), _block(i))
        assert store.stats.writes_dropped > 0
        assert len(store.host) == 20  # the host tier took every block
    finally:
        redis_server.proc.send_signal(__import__("signal").SIGCONT)
    store.close()


def test_redis_killed_mid_run_degrades_to_misses(redis_server):
    store = _store(redis_server.url, host_bytes=0)
    store.put(_hash(0), _block(0), sync_remote=True)
    assert len(store.get_blocks([_hash(0)])) == 1
    redis_server.stop()
    start = time.monotonic()
    assert store.get_blocks([_hash(0)]) == []
    store.put(_hash(1), _block(1), sync_remote=True)  # no exception
    assert time.monotonic() - start < 2.0
    assert store.remote.errors >= 1


def test_salts_never_share_blocks_in_any_tier(redis_server):
    store = _store(redis_server.url)
    tokens = list(range(40))
    a = hash_request_tokens(tokens, 4, cache_salt="tenant-a")
    b = hash_request_tokens(tokens, 4, cache_salt="tenant-b")
    for i, h in enumerate(a):
        store.put(h, _block(i), sync_remote=True)
    assert store.lookup(a) == len(a)
    assert store.lookup(b) == 0
    assert _store(redis_server.url, host_bytes=0).get_blocks(b) == []
