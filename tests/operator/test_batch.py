"""spec.batch: the gateway's Batch API section, its store's volume, and the engines' background priority."""

from __future__ import annotations

import argparse

import pytest
import yaml

from gateway.config import BatchConfig, gateway_config_from_dict
from gateway.priority import PriorityClasses, batch_priority_class
from tessera_operator import InvalidInferenceService, validate_inference_service
from tessera_operator.batch import MOUNT
from tessera_operator.reconcile import desired_objects
from tessera_operator.render import render_objects

from .conftest import make_isvc
from .test_reconcile import by_key, container

CLASSES = {"priorityClasses": [{"name": "standard", "priority": 10, "weight": 4},
                               {"name": "batch", "priority": 20, "weight": 1, "sheddable": True}]}
VOLUME = {"claimName": "batch-store", "path": "llama"}


def _objects(spec: dict) -> dict:
    return by_key(desired_objects(make_isvc(spec)))


def _gateway_yaml(objects: dict) -> dict:
    return yaml.safe_load(objects[("ConfigMap", "llama-gateway")]["data"]["gateway.yaml"])


def _gateway_pod(objects: dict) -> dict:
    return objects[("Deployment", "llama-gateway")]["spec"]["template"]["spec"]


def _engine_flags(objects: list[dict] | dict, name: str = "llama-engine") -> dict[str, str]:
    objects = objects if isinstance(objects, list) else list(objects.values())
    args = container(objects, name)["args"]
    return {a: b for a, b in zip(args, args[1:]) if a.startswith("--")}


def test_without_batch_nothing_changes():
    """No spec.batch: no `batch` key (the API is off), no store volume, a rolling gateway, no background flags."""
    objects = _objects({})
    assert "batch" not in _gateway_yaml(objects)
    pod = _gateway_pod(objects)
    assert "batch" not in {v["name"] for v in pod["volumes"]}
    assert objects[("Deployment", "llama-gateway")]["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert not [f for f in _engine_flags(objects) if f.startswith("--background")]


def test_a_volume_becomes_the_gateways_directory_store():
    objects = _objects({"gateway": CLASSES, "batch": {"volume": VOLUME, "maxConcurrency": 3, "maxFileBytes": 1024}})
    config = _gateway_yaml(objects)
    assert config["batch"] == {"directory": f"{MOUNT}/llama", "max_concurrency": 3, "max_file_bytes": 1024,
                               "max_lines_per_file": BatchConfig.max_lines_per_file,
                               "max_files_per_tenant": BatchConfig.max_files_per_tenant,
                               "max_batches_per_tenant": BatchConfig.max_batches_per_tenant,
        "retention_s": BatchConfig.retention_s}
    # The gateway's own loader takes it.
    loaded = gateway_config_from_dict(config).batch
    assert loaded is not None and loaded.directory == "/var/lib/tessera/batch/llama" and loaded.redis_url is None
    pod = _gateway_pod(objects)
    volumes = {v["name"]: v for v in pod["volumes"]}
    # Read-write: the one volume of the gateway that is not read-only.
    assert volumes["batch"] == {"name": "batch", "persistentVolumeClaim": {"claimName": "batch-store"}}
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["batch"] == {"name": "batch", "mountPath": MOUNT}
    assert config["batch"]["directory"].startswith(mounts["batch"]["mountPath"] + "/")
    # One process on the folder at a time: replaced, never rolled with a second pod beside it.
    assert objects[("Deployment", "llama-gateway")]["spec"]["strategy"] == {"type": "Recreate"}


def test_the_volumes_root_and_the_named_class():
    objects = _objects({"gateway": CLASSES, "batch": {"volume": {"claimName": "b"}, "priorityClass": "batch"}})
    batch = _gateway_yaml(objects)["batch"]
    assert batch["directory"] == MOUNT and batch["priority_class"] == "batch"
    assert gateway_config_from_dict(_gateway_yaml(objects)).batch.priority_class == "batch"


def test_turning_the_batch_api_on_rolls_the_gateway():
    plain = _objects({"gateway": CLASSES})
    batch = _objects({"gateway": CLASSES, "batch": {"volume": VOLUME}})
    hash_of = lambda objects: (objects[("Deployment", "llama-gateway")]["spec"]["template"]["metadata"]  # noqa: E731
                               ["annotations"]["tessera.dev/config-hash"])
    assert hash_of(plain) != hash_of(batch)


REDIS = {"urlSecretRef": {"name": "batch-redis"}}


URL_ENV = "TESSERA_BATCH_REDIS_URL"


def _strings(obj) -> list[str]:
    """Every string in an object, keys too, at any depth."""
    if isinstance(obj, dict):
        return [s for k, v in obj.items() for s in [k, *_strings(v)]]
    if isinstance(obj, list):
        return [s for v in obj for s in _strings(v)]
    return [obj] if isinstance(obj, str) else []


def test_redis_reaches_the_gateway_from_its_secret_by_environment_never_by_configmap_or_argv():
    """spec.batch.redis in a cluster: the gateway pods get the URL (a credential) as TESSERA_BATCH_REDIS_URL
    from the Secret; the ConfigMap has the key prefix and no URL; the engines get nothing of it."""
    body = make_isvc({"gateway": {**CLASSES, "replicas": 3}, "batch": {"redis": REDIS}})
    objects = _objects({"gateway": {**CLASSES, "replicas": 3}, "batch": {"redis": REDIS}})
    assert by_key(render_objects(body)).keys() == objects.keys()  # `tessera render` serves it too
    gateway = objects[("Deployment", "llama-gateway")]
    env = {e["name"]: e for e in gateway["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env[URL_ENV] == {"name": URL_ENV, "valueFrom": {"secretKeyRef": {"name": "batch-redis", "key": "url"}}}
    for name, obj in objects.items():
        strings = _strings(obj)
        assert not [s for s in strings if "redis://" in s or "redis_url" in s], name  # not even a key
        if name[0] == "Deployment":
            args = obj["spec"]["template"]["spec"]["containers"][0]["args"]
            assert not [a for a in args if "$(" in a or "redis-url" in a], name
            if name != ("Deployment", "llama-gateway"):
                assert URL_ENV not in strings, name  # the engines never see it
    assert _gateway_yaml(objects)["batch"] == {
        "key_prefix": "tessera:ml/llama:batch:", "max_concurrency": BatchConfig.max_concurrency,
        "max_file_bytes": BatchConfig.max_file_bytes, "max_lines_per_file": BatchConfig.max_lines_per_file,
        "max_files_per_tenant": BatchConfig.max_files_per_tenant,
        "max_batches_per_tenant": BatchConfig.max_batches_per_tenant,
        "retention_s": BatchConfig.retention_s}
    # Several replicas share Redis: rolled, no store volume.
    assert gateway["spec"]["replicas"] == 3 and gateway["spec"]["strategy"]["type"] == "RollingUpdate"
    assert "batch" not in {v["name"] for v in _gateway_pod(objects)["volumes"]}
    # The Secret is among those `tessera render` says must exist.
    from tessera_operator.render import secret_refs

    assert "batch-redis" in secret_refs(list(objects.values()))


def test_the_gateway_loads_the_rendered_redis_config_with_the_url_its_pod_gets():
    """The gateway's own loader takes the ConfigMap with the environment the pod has; without the
    variable it names it (a pod whose Secret key is missing never starts)."""
    objects = _objects({"gateway": CLASSES, "batch": {"redis": {**REDIS, "keyPrefix": "team-a:batches:"}}})
    url = "redis://llama-gateway:pw-1234@redis.ml:6379/0"
    loaded = gateway_config_from_dict(_gateway_yaml(objects), {URL_ENV: url}).batch
    assert (loaded.redis_url, loaded.key_prefix, loaded.directory) == (url, "team-a:batches:", None)
    from gateway.config import GatewayConfigError

    with pytest.raises(GatewayConfigError, match=URL_ENV):
        gateway_config_from_dict(_gateway_yaml(objects))


REDIS_TLS = {"caSecretRef": {"name": "redis-ca"}, "clientCertSecretRef": {"name": "batch-redis-client"}}


def test_batch_redis_tls_files_are_mounted_into_the_gateway_and_named_in_its_config(tmp_path):
    """batch.redis.tls, as kvStore.redis.tls: the CA and the client certificate from their Secrets,
    mounted read-only into the gateway pods and named by batch.redis_*_file; the engines get none of it."""
    from .test_reconcile import _mounted_files

    spec = {"gateway": CLASSES, "batch": {"redis": {**REDIS, "tls": REDIS_TLS}}}
    objects = _objects(spec)
    section = _gateway_yaml(objects)["batch"]
    files = _mounted_files(list(objects.values()), "llama-gateway")
    assert {k: files[section[k]] for k in ("redis_ca_file", "redis_cert_file", "redis_key_file")} == {
        "redis_ca_file": "redis-ca/ca.crt", "redis_cert_file": "batch-redis-client/tls.crt",
        "redis_key_file": "batch-redis-client/tls.key"}
    engine = _engine_flags(objects)
    assert not [f for f in engine if f.startswith("--kv-redis")]
    assert not [p for p in _mounted_files(list(objects.values()), "llama-engine") if "redis" in p]
    # The gateway's loader takes the fields, the files where the pod has them (here under tmp_path).
    config = _gateway_yaml(objects)
    for key in ("redis_ca_file", "redis_cert_file", "redis_key_file"):
        local = tmp_path / config["batch"][key].lstrip("/")
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_text("pem")
        config["batch"][key] = str(local)
    loaded = gateway_config_from_dict(config, {URL_ENV: "rediss://redis.ml:6380/0"}).batch
    assert loaded.redis_cert_file.endswith("/tls.crt") and loaded.redis_ca_file.endswith("/ca.crt")
    # Only the CA: no client certificate, nor its flags.
    only_ca = _gateway_yaml(_objects({"gateway": CLASSES, "batch": {"redis": {
        **REDIS, "tls": {"caSecretRef": {"name": "redis-ca", "key": "bundle.pem"}}}}}))["batch"]
    assert "redis_ca_file" in only_ca and "redis_cert_file" not in only_ca and "redis_key_file" not in only_ca


def test_the_redis_network_policy_admits_the_gateway_when_batch_keeps_its_batches_in_redis():
    """kvStore.redis.podSelector isolates the Redis pods: with batch.redis the gateway pods (which may
    well use that same Redis) get in too; without it, or with a volume, only the engines do."""
    from .test_network_policy import REDIS as REDIS_POD
    from .test_network_policy import STRANGER, admits, pod_of, policies_of

    kv = {"kvStore": {"redis": {"urlSecretRef": {"name": "kv-redis"}, "podSelector": {"app": "redis"}}}}
    for batch, gateway_admitted in (({"redis": REDIS}, True), ({"volume": VOLUME}, False), (None, False)):
        spec = {**kv, "gateway": CLASSES, **({"batch": batch} if batch else {})}
        objects = desired_objects(make_isvc(spec))
        other = desired_objects(make_isvc(kv, name="other"))  # another service on the same Redis, no batch
        policies = policies_of(objects) + policies_of(other)
        assert admits(policies, REDIS_POD, pod_of(objects, "llama-gateway"), 6379) is gateway_admitted, batch
        assert admits(policies, REDIS_POD, pod_of(objects, "llama-engine"), 6379)
        assert not admits(policies, REDIS_POD, pod_of(other, "other-gateway"), 6379)
        assert not admits(policies, REDIS_POD, STRANGER, 6379)
        assert not admits(policies, REDIS_POD, pod_of(objects, "llama-gateway"), 6380)  # kvStore.redis.port only


def test_redis_key_prefix_defaults_inside_the_services_kv_key_space():
    from kv_store.redis_tier import check_key_prefix
    from tessera_operator.batch import gateway_section
    from tessera_operator.names import Owner

    spec = validate_inference_service(make_isvc({"batch": {"redis": REDIS}}))["spec"]
    owner = Owner("llama", "ml", "u")
    section = gateway_section(owner, spec)
    assert section["key_prefix"] == "tessera:ml/llama:batch:"
    assert "redis_url" not in section and "directory" not in section
    check_key_prefix(section["key_prefix"], "batch.key_prefix")
    spec["batch"]["redis"]["keyPrefix"] = "team-a:batches:"
    assert gateway_section(owner, spec)["key_prefix"] == "team-a:batches:"


@pytest.mark.parametrize("prefix", ["team a:", "batch:*", "x?", "a[b]", "back\\slash", "tab\t", "bell\x07"])
def test_key_prefixes_the_gateway_would_refuse_are_refused_by_the_schema(prefix):
    from kv_store.redis_tier import check_key_prefix

    with pytest.raises(ValueError):
        check_key_prefix(prefix, "batch.key_prefix")
    with pytest.raises(InvalidInferenceService, match="spec.batch.redis.keyPrefix"):
        validate_inference_service(make_isvc({"batch": {"redis": {**REDIS, "keyPrefix": prefix}}}))


# (gateway, batch, engine) -> the engines' --background-priority, or None.
BACKGROUND = [
    ("the default classes: batch lines run at standard, the default class, which must stay foreground",
     {}, {"volume": VOLUME}, {}, None),
    ("a sheddable class past the default one", CLASSES, {"volume": VOLUME}, {}, "20"),
    ("the class named", {"priorityClasses": CLASSES["priorityClasses"] + [
        {"name": "bulk", "priority": 30, "weight": 1}]}, {"volume": VOLUME, "priorityClass": "bulk"}, {}, "30"),
    ("no sheddable class: the one with the largest priority",
     {"priorityClasses": [{"name": "standard", "priority": 10, "weight": 4},
                          {"name": "low", "priority": 15, "weight": 1}]}, {"volume": VOLUME}, {}, "15"),
    ("the named class is the default one", CLASSES, {"volume": VOLUME, "priorityClass": "standard"}, {}, None),
    ("a sheddable class that runs before the default one",
     {"priorityClasses": [{"name": "standard", "priority": 10, "weight": 4},
                          {"name": "spot", "priority": 5, "weight": 1, "sheddable": True}]}, {"volume": VOLUME}, {},
     None),
    ("fcfs: no priorities to tell batch work by", CLASSES, {"volume": VOLUME}, {"schedulingPolicy": "fcfs"}, None),
    ("engine.backgroundPriority wins", CLASSES, {"volume": VOLUME}, {"backgroundPriority": 15}, "15"),
    ("engine.backgroundPriority without spec.batch", {}, None, {"backgroundPriority": 7}, "7"),
]


@pytest.mark.parametrize("case", BACKGROUND, ids=[c[0] for c in BACKGROUND])
def test_background_priority(case):
    _, gateway, batch, engine, expected = case
    spec = {"gateway": gateway, "engine": engine, **({"batch": batch} if batch is not None else {})}
    assert _engine_flags(_objects(spec)).get("--background-priority") == expected


@pytest.mark.parametrize("case", [c for c in BACKGROUND if c[2] is not None and "backgroundPriority" not in c[3]],
                         ids=lambda c: c[0])
def test_the_engines_background_class_is_the_one_the_gateways_runner_submits_at(case):
    """One rule: the class the gateway's runner picks from the rendered config (runner.py) is the
    class whose priority the engines got, whenever they got one."""
    _, gateway, batch, engine, expected = case
    objects = _objects({"gateway": gateway, "engine": engine, "batch": batch})
    config = gateway_config_from_dict(_gateway_yaml(objects))
    classes = PriorityClasses.from_config(list(config.priority_classes), config.default_priority_class)
    runner_class = classes.get(batch_priority_class(classes, config.batch.priority_class))
    if expected is not None:
        assert str(runner_class.priority) == expected
    else:
        assert engine.get("schedulingPolicy") == "fcfs" or runner_class.priority <= classes.default.priority


def test_background_flags_are_emitted_for_every_pool_and_parse_with_the_engines_own_checks():
    """The engine's parser and its SchedulerConfig (which refuses a background priority under fcfs)
    accept what the operator emits, in both disaggregated pools."""
    from engine_pod.config import SchedulerConfig
    from engine_pod.entrypoints.cli_args import engine_kwargs
    from engine_pod.server.main import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    objects = desired_objects(make_isvc({"mode": "disaggregated", "gateway": CLASSES,
                                         "engine": {"backgroundMaxBatchedTokens": 64},
                                         "batch": {"volume": VOLUME}}))
    for pool in ("llama-prefill", "llama-decode"):
        kwargs = engine_kwargs(parser.parse_args(container(objects, pool)["args"]))
        assert (kwargs["background_priority"], kwargs["background_max_batched_tokens"]) == (20, 64)
        config = SchedulerConfig(policy=kwargs["scheduling_policy"], background_priority=kwargs["background_priority"],
                                 background_max_batched_tokens=kwargs["background_max_batched_tokens"])
        assert config.background_priority == 20


def test_the_engines_default_background_token_budget_is_the_schemas_word():
    from engine_pod.config import SchedulerConfig
    from tessera_operator.crd_engine import DEFAULT_BACKGROUND_MAX_BATCHED_TOKENS

    assert SchedulerConfig.background_max_batched_tokens == DEFAULT_BACKGROUND_MAX_BATCHED_TOKENS
    assert "--background-max-batched-tokens" not in _engine_flags(_objects({"gateway": CLASSES,
                                                                             "batch": {"volume": VOLUME}}))


def test_the_schema_defaults_are_the_gateways():
    spec = validate_inference_service(make_isvc({"batch": {"volume": VOLUME}}))["spec"]
    assert spec["batch"] == {"volume": {**VOLUME}, "maxConcurrency": BatchConfig.max_concurrency,
                             "maxFileBytes": BatchConfig.max_file_bytes,
                             "maxLinesPerFile": BatchConfig.max_lines_per_file,
                             "maxFilesPerTenant": BatchConfig.max_files_per_tenant,
                             "maxBatchesPerTenant": BatchConfig.max_batches_per_tenant,
                             "retentionSeconds": BatchConfig.retention_s}
    assert validate_inference_service(make_isvc({"batch": {"volume": {"claimName": "b"}}}))["spec"]["batch"][
        "volume"] == {"claimName": "b", "path": ""}
