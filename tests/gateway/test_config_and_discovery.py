"""The gateway's config file and pod discovery (pure functions)."""

from __future__ import annotations

import pytest

from gateway.config import GatewayConfigError, gateway_config_from_dict, load_gateway_config
from gateway.pods.discovery import addresses_from_slices, static_members

BASE = {"model": {"name": "m", "path": "/models/m"}, "pods": {"static": [{"address": "10.0.0.1:50061"}]}}


def test_defaults_and_nested_overrides():
    c = gateway_config_from_dict({**BASE, "router": {"weights": {"prefix": 2}}, "admission": {"max_kv_usage": 0.8}})
    assert c.router.weights.prefix == 2.0 and c.router.weights.waiting == 0.5
    assert c.admission.max_kv_usage == 0.8 and c.admission.max_waiting_per_pod == 8
    assert c.server.http_port == 8000 and c.server.grpc_port == 50051 and c.server.metrics_port == 9090
    assert gateway_config_from_dict({**BASE, "server": {"metrics_port": 0}}).server.metrics_port == 0  # off
    assert c.model.block_size == 16 and c.disaggregation.min_uncached_tokens == 256


@pytest.mark.parametrize("change,message", [
    ({"model": {"name": "m", "path": "/p", "blocksize": 16}}, "unknown field(s) ['blocksize']"),
    ({"router": {"weights": {"prefix": -1}}}, "router.weights must be >= 0"),
    ({"router": {"weights": {"prefill_backlog": -0.5}}}, "router.weights must be >= 0"),
    ({"router": {"weights": {"prefix": "high"}}}, "router.weights.prefix: expected float"),
    ({"admission": {"max_kv_usage": 1.5}}, "admission.max_kv_usage must be in (0, 1]"),
    ({"pods": {"static": [{"address": "nohost", "role": "mixed"}]}}, "is not host:port"),
    ({"pods": {"static": [{"address": "h:1", "role": "prefil"}]}}, "role 'prefil' is not one of"),
    ({"pods": {}}, "give one of a static list, kubernetes discovery or a file"),
    ({"pods": {"static": [{"address": "h:1"}], "file": {"path": "/p"}}}, "give one of"),
    ({"pods": {"file": {"path": "/p", "poll_interval_s": 0}}}, "pods.file.poll_interval_s must be > 0"),
    ({"model": {"name": "m", "path": "/p", "block_size": 0}}, "model.block_size must be > 0"),
    ({"disaggregation": {"kv_channel": "nixl"}}, "disaggregation.kv_channel must be one of redis, direct, got 'nixl'"),
    ({"server": {"http_port": True}}, "server.http_port: expected int"),
    ({"server": {"metrics_port": 8000}}, "server.metrics_port must differ from server.http_port"),
    ({"server": {"metrics_port": 70000}}, "server.metrics_port must be in [0, 65535]"),
    ({"server": {"keep_alive_s": 0}}, "server.keep_alive_s must be > 0"),
    ({"pods": {"kubernetes": {"namespace": "ml", "services": ["a", "b"]}}},
     "pods.kubernetes.services: expected a mapping of names to names"),
    ({"batch": {}}, "batch: give a directory or a redis_url"),
    ({"batch": {"redis_url": "http://:s3cret@h:1"}}, "batch.redis_url must start with redis://"),
    ({"batch": {"directory": "/d", "key_prefix": "tessera:*"}}, "batch.key_prefix 'tessera:"),
    ({"batch": {"directory": "/d", "max_concurrency": 0}}, "batch.max_concurrency must be >= 1"),
    ({"batch": {"directory": "/d", "max_file_bytes": -1}}, "batch.max_file_bytes must be >= 1"),
    ({"batch": {"directory": "/d", "lease_s": 0}}, "batch.lease_s must be > 0"),
    ({"batch": {"directory": "/d", "retry_interval_s": float("nan")}}, "batch.retry_interval_s must be > 0"),
    ({"batch": {"directory": "/d", "retention_s": 0}}, "batch.retention_s must be > 0"),
    ({"batch": {"directory": "/d", "retention_s": float("nan")}}, "batch.retention_s must be > 0"),
    ({"model": {"name": "m", "path": "/p", "tool_call_parser": "mistral"}},
     "model.tool_call_parser: unknown tool-call parser 'mistral'"),
])
def test_bad_configs_name_the_field(change, message):
    with pytest.raises(GatewayConfigError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        gateway_config_from_dict({**BASE, **change})


def test_a_bad_batch_redis_url_never_shows_its_password():
    with pytest.raises(GatewayConfigError) as e:
        gateway_config_from_dict({**BASE, "batch": {"redis_url": "redis://:s3cret@h:notaport/0"}})
    assert "s3cret" not in str(e.value) and "batch.redis_url" in str(e.value)


URL_ENV = "TESSERA_BATCH_REDIS_URL"


def test_the_batch_redis_url_comes_from_the_environment_when_the_file_has_none(tmp_path, monkeypatch):
    """The operator's gateway pods get the URL (password and all) by environment from a Secret, never
    in the ConfigMap: the engines' rule for --kv-redis-url and TESSERA_KV_REDIS_URL."""
    from gateway.config import BATCH_REDIS_URL_ENV

    assert BATCH_REDIS_URL_ENV == URL_ENV
    url = "redis://batch:s3cret-pw@redis.ml:6379/2"
    path = tmp_path / "gateway.yaml"
    path.write_text("model: {name: m, path: /p}\npods: {static: [{address: 'h:1'}]}\n"
                    "batch: {key_prefix: 'tessera:ml/llama:batch:'}\n")
    batch = load_gateway_config(path, {URL_ENV: url}).batch
    assert batch.redis_url == url and batch.key_prefix == "tessera:ml/llama:batch:" and batch.directory is None
    assert "s3cret" not in repr(load_gateway_config(path, {URL_ENV: url}))
    # What `tessera gateway` does: this process's environment.
    monkeypatch.setenv(URL_ENV, url)
    assert load_gateway_config(path).batch.redis_url == url
    # A mapping alone looks at no environment unless given one.
    with pytest.raises(GatewayConfigError, match=f"batch: give a directory or a redis_url \\(or set {URL_ENV}\\)"):
        gateway_config_from_dict({**BASE, "batch": {}})
    # An empty variable counts as unset.
    with pytest.raises(GatewayConfigError, match="batch: give a directory or a redis_url"):
        gateway_config_from_dict({**BASE, "batch": {}}, {URL_ENV: ""})
    # No batch section: the Batch API stays off whatever the environment holds.
    assert gateway_config_from_dict(BASE, {URL_ENV: url}).batch is None


def test_the_config_files_batch_redis_url_wins_over_the_environment():
    ours = "redis://redis.ml:6379/0"
    for env in ({URL_ENV: "redis://other:6379/0"}, {URL_ENV: "http://not-even-a-redis-url"}):  # never read
        assert gateway_config_from_dict({**BASE, "batch": {"redis_url": ours}}, env).batch.redis_url == ours
    # A config that names a directory chose its store: a stray variable never moves it to Redis.
    kept = gateway_config_from_dict({**BASE, "batch": {"directory": "/d"}}, {URL_ENV: ours}).batch
    assert (kept.directory, kept.redis_url) == ("/d", None)


@pytest.mark.parametrize("url,message", [
    ("http://:hunter2-pw@redis:6379/0", f"{URL_ENV} must start with redis://, rediss:// or unix://, got scheme 'http'"),
    ("redis:/:hunter2-pw@redis:6379/0", f"{URL_ENV} must start with redis://"),
    ("redis://:hunter2-pw@redis:notaport/0", f"{URL_ENV} redis://\\*\\*\\*@redis:notaport/0 is not a valid Redis URL"),
])
def test_a_bad_batch_redis_url_in_the_environment_is_a_config_error_naming_it_without_the_password(url, message):
    with pytest.raises(GatewayConfigError, match=message) as e:
        gateway_config_from_dict({**BASE, "batch": {"key_prefix": "b:"}}, {URL_ENV: url})
    assert "hunter2" not in str(e.value) and "batch.redis_url" not in str(e.value)


def test_batch_redis_tls_files_are_checked_as_the_engines_are(tmp_path):
    """batch.redis_ca_file, redis_cert_file, redis_key_file: KVStoreConfig's names and rules."""
    for name in ("ca.crt", "tls.crt", "tls.key"):
        (tmp_path / name).write_text("x")
    files = {"redis_ca_file": str(tmp_path / "ca.crt"), "redis_cert_file": str(tmp_path / "tls.crt"),
             "redis_key_file": str(tmp_path / "tls.key")}
    tls_url = "rediss://:pw@redis.ml:6380/0"
    batch = gateway_config_from_dict({**BASE, "batch": {"redis_url": tls_url, **files}}).batch
    assert (batch.redis_ca_file, batch.redis_cert_file, batch.redis_key_file) == tuple(files.values())
    # The URL from the environment counts as well.
    assert gateway_config_from_dict({**BASE, "batch": files}, {URL_ENV: tls_url}).batch.redis_url == tls_url
    bad = [({"redis_url": "redis://redis.ml:6379/0", "redis_ca_file": files["redis_ca_file"]},
            f"batch.redis_ca_file needs a rediss:// URL \\(batch.redis_url or {URL_ENV}\\) \\(TLS\\)"),
           ({"directory": "/d", "redis_cert_file": files["redis_cert_file"]}, "batch.redis_cert_file needs a rediss://"),
           ({"redis_url": tls_url, "redis_ca_file": str(tmp_path / "absent.crt")},
            "batch.redis_ca_file: no such file"),
           ({"redis_url": tls_url, "redis_key_file": files["redis_key_file"]},
            "batch.redis_key_file needs batch.redis_cert_file")]
    for section, message in bad:
        with pytest.raises(GatewayConfigError, match=message):
            gateway_config_from_dict({**BASE, "batch": section})


def test_load_yaml_file(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text("model: {name: m, path: /p}\npods:\n  kubernetes:\n    namespace: ml\n"
                    "    services: {prefill: s-prefill, decode: s-decode}\n")
    c = load_gateway_config(path)
    assert c.pods.kubernetes.services == {"prefill": "s-prefill", "decode": "s-decode"}
    (tmp_path / "bad.yaml").write_text("model: [unclosed")
    with pytest.raises(GatewayConfigError, match="not valid YAML"):
        load_gateway_config(tmp_path / "bad.yaml")
    with pytest.raises(GatewayConfigError, match="cannot read"):
        load_gateway_config(tmp_path / "missing.yaml")


def test_static_members_by_role():
    c = gateway_config_from_dict({**BASE, "pods": {"static": [
        {"address": "a:1", "role": "prefill"}, {"address": "b:1", "role": "decode"}, {"address": "c:1"}]}})
    assert static_members(c.pods) == {"prefill": ["a:1"], "decode": ["b:1"], "mixed": ["c:1"]}


def test_addresses_from_endpoint_slices_keep_ready_endpoints_on_the_named_port():
    slices = [
        {"ports": [{"name": "metrics", "port": 9090}, {"name": "grpc", "port": 50061}],
         "endpoints": [
             {"addresses": ["10.0.0.2"], "conditions": {"ready": True}},
             {"addresses": ["10.0.0.1"]},  # no conditions: ready
             {"addresses": ["10.0.0.3"], "conditions": {"ready": False}},
             {"addresses": ["10.0.0.4"], "conditions": {"ready": True, "terminating": True}},
         ]},
        {"ports": [{"name": "grpc", "port": 50061}],
         "endpoints": [{"addresses": ["fd00::5"], "conditions": {"ready": True}},
                       {"addresses": ["10.0.0.2"], "conditions": {"ready": True}}]},
        {"ports": [{"name": "other", "port": 1}], "endpoints": [{"addresses": ["10.9.9.9"]}]},
        {"ports": None, "endpoints": None},
    ]
    assert addresses_from_slices(slices, "grpc") == ["10.0.0.1:50061", "10.0.0.2:50061", "[fd00::5]:50061"]
