"""The Redis tier against a real redis-server: namespaced keys with a TTL, failures as misses,
passwords never shown, TLS, Redis Cluster and an ACL user confined to the key prefix."""

from __future__ import annotations

import pytest

from kv_store.host_tier import HostMemoryTier
from kv_store.redis_tier import RedisTierConfig
from kv_store.tiered_store import TieredKVStore
from tests.kv_store.blocks import block_hash, make_codec, make_payload, make_redis_tier


def test_redis_tier_round_trip_with_namespace_and_ttl(redis_server):
    tier = make_redis_tier(redis_server.url, ttl_seconds=120)
    assert tier.available
    assert tier.put_many([(block_hash(0), b"a"), (block_hash(1), b"b")])
    assert tier.get_many([block_hash(0), block_hash(2), block_hash(1)]) == [b"a", None, b"b"]
    key = b"tessera:fp:0/1:" + block_hash(0).hex().encode()
    assert redis_server.client.get(key) == b"a"
    assert 0 < redis_server.client.ttl(key) <= 120
    assert tier.exists_many([block_hash(1), block_hash(5)]) == [True, False]


def _mget_calls(client) -> int:
    return int(client.info("commandstats").get("cmdstat_mget", {}).get("calls", 0))


def test_a_long_read_is_several_mgets_in_one_round_trip(redis_server):
    """Ten keys, three per MGET: four MGETs, the values in order, misses where missing."""
    tier = make_redis_tier(redis_server.url, keys_per_read=3)
    tier.put_many([(block_hash(i), bytes([i]) * 10) for i in range(10) if i != 4])
    before = _mget_calls(redis_server.client)
    got = tier.get_many([block_hash(i) for i in range(10)])
    assert got == [None if i == 4 else bytes([i]) * 10 for i in range(10)]
    assert _mget_calls(redis_server.client) - before == 4
    assert make_redis_tier(redis_server.url).get_many([block_hash(0), block_hash(1)]) == [b"\0" * 10, b"\1" * 10]


def test_a_prompts_worth_of_large_values_reads_back_whole_in_chunks(redis_server):
    """An 8B model's blocks are 2 MiB: 128 of them (a 2k-token prompt) come back
    intact and in order from 16 MGETs of 8 (each reply 16 MiB, not one of 256 MiB)."""
    values = [(block_hash(1000 + i), bytes([i]) * (2 << 20)) for i in range(128)]
    tier = make_redis_tier(redis_server.url, keys_per_read=8, timeout_seconds=10)
    assert tier.put_many(values)
    before = _mget_calls(redis_server.client)
    assert tier.get_many([h for h, _ in values]) == [v for _, v in values]
    assert _mget_calls(redis_server.client) - before == 16 and tier.errors == 0
    redis_server.client.delete(*[tier.key(h) for h, _ in values])


def test_redis_tier_unreachable_is_a_miss_not_an_error():
    tier = make_redis_tier("redis://127.0.0.1:1/0", timeout_seconds=0.1)
    assert not tier.available
    assert tier.get_many([block_hash(0)]) == [None]
    assert not tier.put_many([(block_hash(0), b"x")])


def test_redis_tier_authenticates_from_the_url(tmp_path):
    from kv_store.local_redis import RedisServer

    server = RedisServer(tmp_path, password="s3cret")
    try:
        tier = make_redis_tier(server.url)
        assert tier.available and tier.put_many([(block_hash(0), b"v")])
        assert tier.get_many([block_hash(0)]) == [b"v"]
        wrong = make_redis_tier(server.url.replace("s3cret", "wrong"))
        assert not wrong.available and wrong.get_many([block_hash(0)]) == [None]
    finally:
        server.stop()


def test_redis_tier_spreads_blocks_over_a_redis_cluster(tmp_path):
    from kv_store.local_redis import RedisClusterServers

    cluster = RedisClusterServers(tmp_path)
    try:
        tier = make_redis_tier(cluster.url, cluster=True, timeout_seconds=2.0)
        items = [(block_hash(i), f"value-{i}".encode()) for i in range(40)]
        assert tier.put_many(items)
        assert tier.get_many([h for h, _ in items]) == [v for _, v in items]
        assert tier.exists_many([block_hash(0), block_hash(99)]) == [True, False]
        store = TieredKVStore(make_codec(), HostMemoryTier(0), tier)
        store.put(block_hash(100), make_payload(3), sync_remote=True)
        assert store.get_blocks([block_hash(100)]) == [make_payload(3)]
        # The keys landed on more than one node.
        import redis as redis_py

        sizes = [redis_py.Redis(port=port).dbsize() for port in cluster.ports]
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
        tier = make_redis_tier("redis://:hunter2-pw@127.0.0.1:1/0", timeout_seconds=0.1)
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
        tier = make_redis_tier(url, ca_file=files["ca.crt"], cert_file=files["client.crt"],
                               key_file=files["client.key"], timeout_seconds=2.0)
        assert tier.available and tier.put_many([(block_hash(0), b"v")]) and tier.get_many([block_hash(0)]) == [b"v"]
        # Without the client certificate the server refuses the handshake: a miss, not an error.
        no_cert = make_redis_tier(url, ca_file=files["ca.crt"], timeout_seconds=2.0)
        assert not no_cert.available and no_cert.get_many([block_hash(0)]) == [None]
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
    store = TieredKVStore(make_codec(), HostMemoryTier(0), make_redis_tier(url, key_prefix=prefix))
    store.put(block_hash(0), make_payload(0), sync_remote=True)
    assert store.lookup([block_hash(0)]) == 1 and store.get_blocks([block_hash(0)]) == [make_payload(0)]
    store.remote.delete(block_hash(0))
    assert store.remote.errors == 0
    assert redis_server.client.execute_command("ACL", "LOG") == []  # no command was denied
    assert redis_server.client.dbsize() == 0
    # Another deployment's prefix: every write is refused by Redis (a dropped write, never an error).
    other = make_redis_tier(url, key_prefix="tessera:team-b/llama:")
    assert not other.put_many([(block_hash(0), b"v")]) and other.errors == 1
    store.close()
