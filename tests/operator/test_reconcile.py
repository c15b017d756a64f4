"""The pure reconcile function: every spec field lands where it should."""

from __future__ import annotations

import copy

import pytest
import yaml

from gateway.config import gateway_config_from_dict
from tessera_operator import InvalidInferenceService, validate_inference_service
from tessera_operator.reconcile import ObjectKey, desired_objects, stale_keys

from .conftest import make_isvc


def by_key(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def container(objects, name) -> dict:
    return by_key(objects)[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]


def arg_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


FULL_SPEC = {
    "model": {"name": "llama-70b", "dtype": "bfloat16", "maxModelLen": 8192, "toolCallParser": "llama3_json"},
    "image": "registry.local/tessera:dev",
    "imagePullPolicy": "Always",
    "mode": "disaggregated",
    "engine": {"tensorParallelSize": 1, "blockSize": 32, "maxNumBatchedTokens": 4096, "maxNumSeqs": 64,
               "prefixCaching": False, "gpuMemoryUtilization": 0.85, "schedulingPolicy": "fcfs",
               "gpuResourceName": "amd.com/gpu", "drainTimeoutSeconds": 45, "stepTimeoutSeconds": 300,
               "attentionBackend": "triton", "backgroundMaxBatchedTokens": 128,
               "speculative": {"numSpeculativeTokens": 3, "promptLookupMax": 5}},
    "pools": {
        "prefill": {"replicas": 2, "minReplicas": 1, "maxReplicas": 3,
                    "resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"memory": "80Gi"}},
                    "nodeSelector": {"gpu": "h100"},
                    "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]},
        "decode": {"replicas": 3, "minReplicas": 2, "maxReplicas": 8, "gpus": 2},
    },
    "kvStore": {"hostMemory": "2Gi", "redis": {"urlSecretRef": {"name": "redis-cred", "key": "address"},
                                               "tls": {"caSecretRef": {"name": "redis-ca"},
                                                       "clientCertSecretRef": {"name": "redis-client"}},
                                               "podSelector": {"app": "redis"}, "port": 6380}},
    "gateway": {"replicas": 3, "serviceType": "LoadBalancer", "tenantsSecretRef": {"name": "tenants"},
                "priorityClasses": [{"name": "gold", "priority": 0, "weight": 8},
                                    {"name": "batch", "priority": 20, "weight": 1, "sheddable": True}],
                "defaultPriorityClass": "gold",
                "resources": {"requests": {"cpu": "2"}}},
    "disaggregation": {"minUncachedTokens": 1024, "kvChannel": "direct", "inboxBytes": "2Gi"},
    "autoscaling": {"enabled": False},
    "internalSecretRef": {"name": "shared-internal", "key": "secret"},
    "internalTLS": {"secretName": "llama-internal-tls", "serverName": "engine.llama.internal"},
    "networkPolicy": {"metricsNamespaces": ["monitoring"]},
}


@pytest.fixture
def full():
    return desired_objects(make_isvc(FULL_SPEC))


def test_mixed_mode_objects(isvc):
    keys = set(by_key(desired_objects(isvc)))
    assert keys == {("ServiceAccount", "llama-gateway"), ("Role", "llama-gateway"), ("RoleBinding", "llama-gateway"),
                    ("ConfigMap", "llama-gateway"), ("Deployment", "llama-gateway"), ("Service", "llama-gateway"),
                    ("Deployment", "llama-engine"), ("Service", "llama-engine"),
                    ("NetworkPolicy", "llama-engine"), ("NetworkPolicy", "llama-gateway")}
    assert arg_value(container(desired_objects(isvc), "llama-engine")["args"], "--role") == "mixed"


def test_disaggregated_mode_objects(full):
    objects = by_key(full)
    assert ("Deployment", "llama-engine") not in objects
    for role in ("prefill", "decode"):
        assert arg_value(container(full, f"llama-{role}")["args"], "--role") == role
        assert objects[("Service", f"llama-{role}")]["spec"]["selector"]["tessera.dev/pool"] == role


def test_engine_args_carry_every_engine_field(full):
    c = container(full, "llama-prefill")
    args = c["args"]
    assert c["command"] == ["tessera"] and args[0] == "engine"
    expected = {"--model": "/models/llama-8b", "--host": "0.0.0.0", "--grpc-port": "50061", "--metrics-port": "9090",
                "--served-model-name": "llama-70b", "--dtype": "bfloat16", "--max-model-len": "8192",
                "--block-size": "32", "--max-num-batched-tokens": "4096", "--max-num-seqs": "64",
                "--gpu-memory-utilization": "0.85", "--scheduling-policy": "fcfs", "--tensor-parallel-size": "1",
                "--drain-timeout": "45", "--step-timeout": "300", "--attention-backend": "triton",
                "--kv-host-bytes": str(2 * 1024**3),
                "--kv-redis-key-prefix": "tessera:ml/llama:", "--health-port": "50062",
                "--background-max-batched-tokens": "128"}
    for flag, value in expected.items():
        assert arg_value(args, flag) == value, flag
    assert "--no-prefix-caching" in args
    assert "--kv-inbox-bytes" not in args and "--kv-inbox-port" not in args  # only decode pods take pushes
    # The password never appears in the pod spec nor on the command line (not even as $(VAR)):
    # the engine reads the URL from its environment, set from the Secret.
    assert "--kv-redis-url" not in args and not [a for a in args if "$(" in a]
    env = {e["name"]: e for e in c["env"]}
    assert env["TESSERA_KV_REDIS_URL"] == {"name": "TESSERA_KV_REDIS_URL",
                                           "valueFrom": {"secretKeyRef": {"name": "redis-cred", "key": "address"}}}
    assert c["image"] == "registry.local/tessera:dev" and c["imagePullPolicy"] == "Always"


def _mounted_files(objects, deployment: str) -> dict[str, str]:
    """File path in the container -> "Secret name/key" it comes from."""
    pod = by_key(objects)[("Deployment", deployment)]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    out = {}
    for mount in pod["containers"][0]["volumeMounts"]:
        secret = volumes[mount["name"]].get("secret")
        if secret:
            assert mount["readOnly"] and secret["defaultMode"] == 0o440
            for item in secret["items"]:
                out[f"{mount['mountPath']}/{item['path']}"] = f"{secret['secretName']}/{item['key']}"
    return out


def test_internal_secret_is_a_file_in_every_pod(isvc, full):
    """Gateway and engine pods read the internal secret from a mounted file the env var names."""
    for objects, source in ((desired_objects(isvc), "llama-internal/internal-secret"),  # the operator's own
                            (full, "shared-internal/secret")):                         # spec.internalSecretRef
        for name in [o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"]:
            c = container(objects, name)
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            path = env["TESSERA_INTERNAL_SECRET_FILE"]
            assert _mounted_files(objects, name)[path] == source, name
            assert not [a for a in c["args"] if "secret" in a.lower()]


def test_tls_files_are_mounted_and_named_by_flags_and_config(full):
    """internalTLS: engines serve with the certificate and demand one; the gateway presents it and checks
    the engines' against serverName. kvStore.redis.tls: the CA and client certificate reach the engines."""
    args = container(full, "llama-decode")["args"]
    files = _mounted_files(full, "llama-decode")
    for flag, source in (("--tls-cert-file", "llama-internal-tls/tls.crt"),
                         ("--tls-key-file", "llama-internal-tls/tls.key"),
                         ("--tls-client-ca-file", "llama-internal-tls/ca.crt"),
                         ("--kv-redis-ca-file", "redis-ca/ca.crt"),
                         ("--kv-redis-cert-file", "redis-client/tls.crt"),
                         ("--kv-redis-key-file", "redis-client/tls.key")):
        assert files[arg_value(args, flag)] == source, flag
    config = yaml.safe_load(by_key(full)[("ConfigMap", "llama-gateway")]["data"]["gateway.yaml"])
    tls = config["internal"]["tls"]
    gateway_files = _mounted_files(full, "llama-gateway")
    assert tls["server_name"] == "engine.llama.internal"
    assert [gateway_files[tls[k]] for k in ("ca_file", "cert_file", "key_file")] == [
        "llama-internal-tls/ca.crt", "llama-internal-tls/tls.crt", "llama-internal-tls/tls.key"]
    assert "--kv-redis-ca-file" not in container(full, "llama-gateway")["args"]


def test_engine_args_omit_unset_options(isvc):
    args = container(desired_objects(isvc), "llama-engine")["args"]
    for flag in ("--max-model-len", "--kv-host-bytes", "--kv-redis-url", "--kv-redis-key-prefix",
                 "--no-prefix-caching", "--speculative-config", "--tls-cert-file", "--kv-redis-ca-file",
                 "--kv-redis-cert-file", "--background-priority", "--background-max-batched-tokens"):
        assert flag not in args
    assert arg_value(args, "--attention-backend") == "auto"
    env = {e["name"] for e in container(desired_objects(isvc), "llama-engine")["env"]}
    assert "TESSERA_KV_REDIS_URL" not in env
    config = yaml.safe_load(by_key(desired_objects(isvc))[("ConfigMap", "llama-gateway")]["data"]["gateway.yaml"])
    assert "internal" not in config


def test_engine_args_parse_with_the_engine_cli(full):
    """The engine's own parser accepts what the operator emits."""
    import argparse

    from engine_pod.server.main import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(container(full, "llama-decode")["args"])
    assert (args.role, args.block_size, args.max_num_seqs, args.tensor_parallel_size) == ("decode", 32, 64, 1)
    assert args.no_prefix_caching and args.kv_host_bytes == 2 * 1024**3
    assert args.attention_backend == "triton"
    # fcfs: no background priority (the engine refuses one under fcfs), the token budget as given.
    assert args.background_priority is None and args.background_max_batched_tokens == 128
    assert args.kv_inbox_bytes == 2 * 1024**3  # disaggregation.inboxBytes, with kvChannel direct
    assert args.kv_inbox_port == 50063  # the direct channel's data path, with that inbox
    # The engine's own parser of the flag takes it, with the schema's defaults filled in.
    from engine_pod.spec_decode.config import SpeculativeConfig

    spec = SpeculativeConfig.parse(args.speculative_config)
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (
        "ngram", 3, 2, 5)


def test_disaggregated_tp4_prefill_and_tp2_decode_with_both_kv_tiers():
    """Pools of different tensor parallelism with host memory and Redis (the engine stores whole
    blocks, gathered from its ranks): the resource validates, each pool's flags parse with the
    engine's own parser, and each pod asks for its pool's GPUs."""
    import argparse

    from engine_pod.server.main import add_parser

    spec = copy.deepcopy(FULL_SPEC)
    spec["engine"]["tensorParallelSize"] = 2
    spec["pools"]["prefill"]["tensorParallelSize"] = 4
    del spec["pools"]["decode"]["gpus"]
    objects = desired_objects(validate_inference_service(make_isvc(spec)))
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    for pool, tp in (("llama-prefill", 4), ("llama-decode", 2)):
        args = parser.parse_args(container(objects, pool)["args"])
        assert (args.tensor_parallel_size, args.kv_host_bytes) == (tp, 2 * 1024**3)
        assert "TESSERA_KV_REDIS_URL" in {e["name"] for e in container(objects, pool)["env"]}
        assert container(objects, pool)["resources"]["limits"]["amd.com/gpu"] == tp


def _engine_parser():
    import argparse

    from engine_pod.server.main import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser


DIRECT = {"mode": "disaggregated", "disaggregation": {"kvChannel": "direct"}}
KV_INBOX_PORT = 50063
# (case, spec, engine Deployment -> its --kv-inbox-bytes, None where it has none)
INBOX_CASES = [
    ("redis, the default", {"mode": "disaggregated"}, {"llama-prefill": None, "llama-decode": None}),
    ("redis, an inbox size ignored", {"mode": "disaggregated", "disaggregation": {"inboxBytes": "2Gi"}},
     {"llama-prefill": None, "llama-decode": None}),
    ("direct, the default inbox", DIRECT, {"llama-prefill": None, "llama-decode": 1 << 30}),
    ("direct, an integer inbox", {**DIRECT, "disaggregation": {"kvChannel": "direct", "inboxBytes": 256 << 20}},
     {"llama-prefill": None, "llama-decode": 256 << 20}),
    ("direct, a fractional quantity", {**DIRECT, "disaggregation": {"kvChannel": "direct", "inboxBytes": "1.5Gi"}},
     {"llama-prefill": None, "llama-decode": 3 << 29}),
    ("direct, the inbox off", {**DIRECT, "disaggregation": {"kvChannel": "direct", "inboxBytes": 0}},
     {"llama-prefill": None, "llama-decode": 0}),
    ("direct in mixed mode", {"disaggregation": {"kvChannel": "direct"}}, {"llama-engine": None}),
]


@pytest.mark.parametrize("case", INBOX_CASES, ids=[c[0] for c in INBOX_CASES])
def test_only_decode_pods_of_the_direct_channel_get_an_inbox(case):
    """--kv-inbox-bytes goes to decode pods with kvChannel direct, nowhere else (the gateway splits
    requests only between a prefill and a decode pool); the engine's own parser and KV store
    config accept the value."""
    from engine_pod.config import KVStoreConfig
    from engine_pod.entrypoints.cli_args import engine_kwargs
    from tessera.internal_secret import InternalSecret

    _, spec, expected = case
    objects = desired_objects(make_isvc(spec))
    engines = {o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"} - {"llama-gateway"}
    assert engines == set(expected)
    for name, inbox in expected.items():
        args = container(objects, name)["args"]
        assert (arg_value(args, "--kv-inbox-bytes") if "--kv-inbox-bytes" in args else None) == (
            None if inbox is None else str(inbox)), name
        kwargs = engine_kwargs(_engine_parser().parse_args(args))
        assert kwargs["kv_inbox_bytes"] == (inbox or 0)
        # The pods hold the internal secret (a mounted file), which keys the MAC of pushed blocks.
        KVStoreConfig(inbox_bytes=kwargs["kv_inbox_bytes"], mac_key=InternalSecret.generate().kv_mac_key)


@pytest.mark.parametrize("case", INBOX_CASES, ids=[c[0] for c in INBOX_CASES])
def test_only_decode_pods_with_an_inbox_listen_on_the_kv_inbox_port(case):
    """--kv-inbox-port and the `kv-inbox` containerPort go with an inbox that takes pushes: decode pods
    of the direct channel, not with inboxBytes 0 (the engine refuses the port without an inbox). The
    engine's own parser and start-up checks take the flags, the port clear of the pod's other ports."""
    from engine_pod.server.main import _validate

    _, spec, expected = case
    objects = desired_objects(make_isvc(spec))
    for name, inbox in expected.items():
        c = container(objects, name)
        port = KV_INBOX_PORT if inbox else None
        assert (arg_value(c["args"], "--kv-inbox-port") if "--kv-inbox-port" in c["args"] else None) == (
            None if port is None else str(port)), name
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports.get("kv-inbox") == port, name
        assert len(set(ports.values())) == len(ports), name  # clear of grpc, metrics and health
        assert all(p["protocol"] == "TCP" for p in c["ports"])
        args = _engine_parser().parse_args(c["args"])
        assert args.kv_inbox_port == (port or 0)
        _validate(args)
    # The headless Services stay as they were: prefill pods learn the port from their ticket, not a Service.
    for svc in (o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] in expected):
        assert "kv-inbox" not in {p["name"] for p in svc["spec"]["ports"]}


@pytest.mark.parametrize("channel", ["redis", "direct"])
def test_the_gateway_config_names_the_kv_channel(channel):
    config = _gateway_yaml({"mode": "disaggregated", "disaggregation": {"kvChannel": channel}})
    assert config["disaggregation"] == {"min_uncached_tokens": 256, "kv_channel": channel}
    assert gateway_config_from_dict(config).disaggregation.kv_channel == channel


def test_the_default_kv_channel_is_the_gateways():
    """An InferenceService that leaves kvChannel unset runs the gateway as it runs without the key."""
    from gateway.config import DisaggregationConfig

    assert _gateway_yaml({"mode": "disaggregated"})["disaggregation"]["kv_channel"] == DisaggregationConfig().kv_channel


def test_engine_choices_in_the_schema_are_the_engines():
    """The CRD spells the engine's choices out (the operator does not import
    the engine); they must not drift apart."""
    from engine_pod.attention.selector import ATTENTION_BACKENDS
    from engine_pod.spec_decode import config as spec_config
    from tessera_operator import crd_engine

    assert crd_engine.ATTENTION_BACKENDS == ATTENTION_BACKENDS
    assert crd_engine.SPEC_METHODS == spec_config.METHODS
    assert crd_engine.MAX_SPECULATIVE_TOKENS == spec_config.MAX_SPECULATIVE_TOKENS


def test_gpus_equal_tensor_parallel_size_unless_set():
    spec = copy.deepcopy(FULL_SPEC)
    spec["engine"]["tensorParallelSize"] = 4
    objects = desired_objects(make_isvc(spec))
    prefill = container(objects, "llama-prefill")["resources"]
    assert prefill["limits"] == {"memory": "80Gi", "amd.com/gpu": 4}
    assert prefill["requests"] == {"cpu": "8", "memory": "64Gi", "amd.com/gpu": 4}
    assert container(objects, "llama-decode")["resources"]["limits"] == {"amd.com/gpu": 2}


def test_cpu_only_pool_has_no_gpu(isvc):
    objects = desired_objects(make_isvc({"pools": {"mixed": {"gpus": 0}}}))
    assert container(objects, "llama-engine")["resources"] == {}
    default = container(desired_objects(isvc), "llama-engine")["resources"]
    assert default["limits"] == {"nvidia.com/gpu": 1}


def test_replicas_scheduling_and_drain(full):
    objects = by_key(full)
    prefill = objects[("Deployment", "llama-prefill")]["spec"]
    assert prefill["replicas"] == 2 and objects[("Deployment", "llama-decode")]["spec"]["replicas"] == 3
    assert objects[("Deployment", "llama-gateway")]["spec"]["replicas"] == 3
    pod = prefill["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert "nodeSelector" not in objects[("Deployment", "llama-decode")]["spec"]["template"]["spec"]
    # preStop sleep (5 s) + drain (45 s) + margin fit in the grace period: no in-flight request is killed.
    assert pod["terminationGracePeriodSeconds"] == 5 + 45 + 10
    assert pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert prefill["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_probes_use_the_health_endpoints(full):
    # The kubelet's gRPC probe speaks no TLS: the engine serves health alone in plaintext on --health-port.
    engine = container(full, "llama-decode")
    assert arg_value(engine["args"], "--health-port") == "50062"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert engine[probe]["grpc"] == {"port": 50062}
    gw = container(full, "llama-gateway")
    # Ready while it takes requests, live while it answers: zero pods restart no gateway.
    assert gw["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": "http"}
    assert gw["livenessProbe"]["httpGet"] == {"path": "/health/live", "port": "http"}


def _gateway_yaml(spec: dict) -> dict:
    objects = by_key(desired_objects(make_isvc(spec)))
    return yaml.safe_load(objects[("ConfigMap", "llama-gateway")]["data"]["gateway.yaml"])


def test_a_pool_that_may_scale_to_zero_makes_the_gateway_queue_without_pods():
    assert "admission" not in _gateway_yaml(FULL_SPEC)  # every pool keeps a pod: 503 at once with none
    pools = {**FULL_SPEC["pools"], "prefill": {**FULL_SPEC["pools"]["prefill"], "minReplicas": 0}}
    config = _gateway_yaml({**FULL_SPEC, "pools": pools})
    assert config["admission"] == {"queue_without_pods": True}
    assert gateway_config_from_dict(config).admission.queue_without_pods


def test_owner_references_labels_and_selectors(full):
    for obj in full:
        meta = obj["metadata"]
        assert meta["namespace"] == "ml"
        assert meta["ownerReferences"] == [{"apiVersion": "tessera.dev/v1alpha1", "kind": "InferenceService",
                                            "name": "llama", "uid": "uid-1234", "controller": True}]
        assert meta["labels"]["tessera.dev/inference-service"] == "llama"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "tessera-operator"
        if obj["kind"] == "Deployment":
            selector = obj["spec"]["selector"]["matchLabels"]
            template_labels = obj["spec"]["template"]["metadata"]["labels"]
            assert selector.items() <= template_labels.items()
    services = {o["metadata"]["name"]: o for o in full if o["kind"] == "Service"}
    deployments = {o["metadata"]["name"]: o for o in full if o["kind"] == "Deployment"}
    for name, svc in services.items():
        assert svc["spec"]["selector"] == deployments[name]["spec"]["selector"]["matchLabels"]


def test_services_and_ports(full):
    objects = by_key(full)
    engine_svc = objects[("Service", "llama-decode")]["spec"]
    assert engine_svc["clusterIP"] == "None"
    assert {(p["name"], p["port"]) for p in engine_svc["ports"]} == {("grpc", 50061), ("metrics", 9090)}
    gw_svc = objects[("Service", "llama-gateway")]["spec"]
    assert gw_svc["type"] == "LoadBalancer"
    assert {(p["name"], p["port"]) for p in gw_svc["ports"]} == {("http", 8000), ("grpc", 50051)}


def test_gateway_config_file(full):
    objects = by_key(full)
    config = yaml.safe_load(objects[("ConfigMap", "llama-gateway")]["data"]["gateway.yaml"])
    assert config == {
        "model": {"name": "llama-70b", "path": "/models/llama-8b", "max_model_len": 8192, "block_size": 32,
                  "tool_call_parser": "llama3_json"},
        "server": {"host": "0.0.0.0", "http_port": 8000, "grpc_port": 50051, "metrics_port": 9090},
        "pods": {"kubernetes": {"namespace": "ml", "port_name": "grpc",
                                "services": {"prefill": "llama-prefill", "decode": "llama-decode"}}},
        "tenants_file": "/etc/tessera/tenants/tenants.yaml",
        "priority_classes": [{"name": "gold", "priority": 0, "weight": 8, "sheddable": False},
                             {"name": "batch", "priority": 20, "weight": 1, "sheddable": True}],
        "default_priority_class": "gold",
        "disaggregation": {"min_uncached_tokens": 1024, "kv_channel": "direct"},
        "internal": {"tls": {"ca_file": "/etc/tessera/internal-tls/ca.crt",
                             "cert_file": "/etc/tessera/internal-tls/tls.crt",
                             "key_file": "/etc/tessera/internal-tls/tls.key",
                             "server_name": "engine.llama.internal"}},
    }
    # The gateway's own loader accepts it.
    loaded = gateway_config_from_dict(config)
    assert loaded.pods.kubernetes.services == {"prefill": "llama-prefill", "decode": "llama-decode"}
    assert loaded.server.metrics_port == 9090 and loaded.internal.tls.server_name == "engine.llama.internal"
    assert loaded.disaggregation.kv_channel == "direct" and loaded.model.tool_call_parser == "llama3_json"


def test_full_spec_with_batch_redis_the_gateway_loads_its_config_with_the_url_from_its_environment(tmp_path):
    """FULL_SPEC plus spec.batch.redis (another key of the KV store's Secret, its CA): the gateway pod
    gets that URL by environment and the CA as a file, the engines keep kvStore.redis's alone, the
    Redis NetworkPolicy admits the gateway, and the gateway's loader takes the rendered config."""
    spec = copy.deepcopy(FULL_SPEC)
    spec["batch"] = {"priorityClass": "batch", "redis": {"urlSecretRef": {"name": "redis-cred", "key": "batch"},
                                                         "tls": {"caSecretRef": {"name": "redis-ca"}}}}
    objects = desired_objects(make_isvc(spec))
    gateway_env = {e["name"]: e for e in container(objects, "llama-gateway")["env"]}
    assert gateway_env["TESSERA_BATCH_REDIS_URL"]["valueFrom"] == {"secretKeyRef": {"name": "redis-cred",
                                                                                  "key": "batch"}}
    assert "TESSERA_KV_REDIS_URL" not in gateway_env
    for pool in ("llama-prefill", "llama-decode"):
        env = {e["name"]: e for e in container(objects, pool)["env"]}
        assert "TESSERA_BATCH_REDIS_URL" not in env
        assert env["TESSERA_KV_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "redis-cred", "key": "address"}
    config = yaml.safe_load(by_key(objects)[("ConfigMap", "llama-gateway")]["data"]["gateway.yaml"])
    ca_file = config["batch"]["redis_ca_file"]
    assert _mounted_files(objects, "llama-gateway")[ca_file] == "redis-ca/ca.crt"
    redis_policy = by_key(objects)[("NetworkPolicy", "llama-redis")]["spec"]
    gateway_pods = by_key(objects)[("Deployment", "llama-gateway")]["spec"]["selector"]["matchLabels"]
    assert {"podSelector": {"matchLabels": gateway_pods}} in redis_policy["ingress"][0]["from"]
    assert redis_policy["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 6380}]
    local_ca = tmp_path / "ca.crt"
    local_ca.write_text("pem")
    config["batch"]["redis_ca_file"] = str(local_ca)  # where this machine has the pod's file
    url = "rediss://llama-gateway:pw@redis.ml:6380/0"
    loaded = gateway_config_from_dict(config, {"TESSERA_BATCH_REDIS_URL": url}).batch
    assert (loaded.redis_url, loaded.key_prefix, loaded.priority_class) == (url, "tessera:ml/llama:batch:", "batch")


def test_gateway_pod_mounts_config_tenants_and_model(full):
    deployment = by_key(full)[("Deployment", "llama-gateway")]["spec"]["template"]
    pod = deployment["spec"]
    c = pod["containers"][0]
    assert c["args"] == ["gateway", "--config", "/etc/tessera/gateway/gateway.yaml"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts == {"models": "/models", "config": "/etc/tessera/gateway", "tenants": "/etc/tessera/tenants",
                      "tmp": "/tmp", "internal-secret": "/etc/tessera/internal",
                      "internal-tls": "/etc/tessera/internal-tls"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tenants"]["secret"] == {"secretName": "tenants", "defaultMode": 0o440,
                                            "items": [{"key": "tenants.yaml", "path": "tenants.yaml"}]}
    assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert pod["serviceAccountName"] == "llama-gateway"
    assert c["resources"] == {"requests": {"cpu": "2"}}


def test_gateway_rbac_is_read_only_endpointslices(full):
    role = by_key(full)[("Role", "llama-gateway")]
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    binding = by_key(full)[("RoleBinding", "llama-gateway")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llama-gateway", "namespace": "ml"}]


def test_host_path_model():
    body = make_isvc()
    body["spec"]["model"] = {"name": "tiny", "hostPath": {"path": "/data/tiny"}}
    objects = desired_objects(body)
    c = container(objects, "llama-engine")
    assert arg_value(c["args"], "--model") == "/models"
    volume = by_key(objects)[("Deployment", "llama-engine")]["spec"]["template"]["spec"]["volumes"][0]
    assert volume == {"name": "models", "hostPath": {"path": "/data/tiny", "type": "Directory"}}


def test_reconciling_twice_yields_identical_objects(full):
    body = make_isvc(FULL_SPEC)
    assert desired_objects(copy.deepcopy(body)) == desired_objects(copy.deepcopy(body)) == full


def _changed(before: list[dict], after: list[dict]) -> set[tuple[str, str]]:
    a, b = by_key(before), by_key(after)
    assert a.keys() == b.keys()
    return {k for k in a if a[k] != b[k]}


def test_spec_change_touches_only_affected_objects():
    base = make_isvc(FULL_SPEC)
    before = desired_objects(base)
    assert _changed(before, desired_objects(make_isvc(FULL_SPEC, ))) == set()
    decode_only = copy.deepcopy(base)
    decode_only["spec"]["pools"]["decode"]["replicas"] = 5
    assert _changed(before, desired_objects(decode_only)) == {("Deployment", "llama-decode")}
    gw_type = copy.deepcopy(base)
    gw_type["spec"]["gateway"]["serviceType"] = "NodePort"
    assert _changed(before, desired_objects(gw_type)) == {("Service", "llama-gateway")}
    # A gateway setting changes the ConfigMap and, through the config hash, rolls the gateway pods.
    threshold = copy.deepcopy(base)
    threshold["spec"]["disaggregation"]["minUncachedTokens"] = 64
    assert _changed(before, desired_objects(threshold)) == {("ConfigMap", "llama-gateway"),
                                                            ("Deployment", "llama-gateway")}
    # An engine setting reaches every engine pool, and the gateway only where it shares the value.
    block = copy.deepcopy(base)
    block["spec"]["engine"]["maxNumSeqs"] = 8
    assert _changed(before, desired_objects(block)) == {("Deployment", "llama-prefill"),
                                                        ("Deployment", "llama-decode")}


def test_autoscaler_decision_in_status_sets_replicas_within_bounds():
    body = make_isvc({"mode": "disaggregated",
                      "pools": {"decode": {"replicas": 1, "minReplicas": 1, "maxReplicas": 3}}})
    body["status"] = {"pools": {"decode": {"desiredReplicas": 3}, "prefill": {"desiredReplicas": 9}}}
    objects = by_key(desired_objects(body))
    assert objects[("Deployment", "llama-decode")]["spec"]["replicas"] == 3
    assert objects[("Deployment", "llama-prefill")]["spec"]["replicas"] == 4  # clamped to maxReplicas
    body["spec"]["autoscaling"] = {"enabled": False}
    assert by_key(desired_objects(body))[("Deployment", "llama-decode")]["spec"]["replicas"] == 1


def test_mode_switch_leaves_stale_objects_to_prune(isvc):
    before = [ObjectKey.of(o) for o in desired_objects(isvc)]
    after = desired_objects(make_isvc({"mode": "disaggregated"}))
    assert set(stale_keys(before, after)) == {ObjectKey("apps/v1", "Deployment", "llama-engine"),
                                              ObjectKey("v1", "Service", "llama-engine")}


def test_invalid_spec_raises():
    with pytest.raises(InvalidInferenceService, match="spec.pools.mixed.maxReplicas"):
        desired_objects(make_isvc({"pools": {"mixed": {"maxReplicas": 0}}}))
