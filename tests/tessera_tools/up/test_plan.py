"""`tessera up`'s plan: the operator's resource and commands, made local (pure)."""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

import pytest
import yaml

from tessera_tools.up.plan import LocalOptions, build_plan, split_cpus
from tessera_tools.up.supervisor import MAX_BACKOFF_S, STABLE_AFTER_S, Supervisor
from tessera_operator.validation import InvalidInferenceService

ROOT = Path(__file__).resolve().parents[3]


def _ports():
    counter = iter(range(40000, 40100))
    return lambda: next(counter)


def _example(name: str) -> dict:
    return yaml.safe_load((ROOT / "examples" / name).read_text())


def _engine_flags(args: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(args, args[1:]) if a.startswith("--")}


def test_mixed_example_two_pinned_replicas_behind_a_static_gateway(tiny_llama):
    options = LocalOptions(models_dir=tiny_llama.parent, http_port=8123, grpc_port=8124, cpus=(0, 1))
    plan = build_plan(_example("local-tiny.yaml"), options, _ports())
    assert [e.name for e in plan.engines] == ["mixed-0", "mixed-1"]
    assert [e.cpus for e in plan.engines] == [frozenset({0}), frozenset({1})]
    for engine in plan.engines:
        flags = _engine_flags(engine.args)
        assert engine.args[0] == "engine" and flags["--role"] == "mixed"
        assert flags["--model"] == str(tiny_llama.resolve())
        assert flags["--host"] == "127.0.0.1" and flags["--grpc-port"] == str(engine.grpc_port)
        assert flags["--cpu-threads"] == "1" and flags["--kv-host-bytes"] == str(256 << 20)
    gw = plan.gateway_config
    assert gw["pods"] == {"static": [{"address": e.address, "role": "mixed"} for e in plan.engines]}
    # /metrics on a port of its own, as in a cluster.
    assert gw["server"] == {"host": "127.0.0.1", "http_port": 8123, "grpc_port": 8124,
                            "metrics_port": plan.metrics_port}
    assert plan.metrics_port not in {8123, 8124} | {p for e in plan.engines for p in (e.grpc_port, e.metrics_port)}
    assert gw["model"]["path"] == str(tiny_llama.resolve()) and gw["model"]["name"] == "tiny"
    assert not plan.needs_redis


def test_disaggregated_example_needs_redis_and_gets_its_url_by_environment(tiny_llama):
    """The Redis URL (a password in it) reaches the engines by environment, never in their argv."""
    url = "redis://:hunter2-redis-password@127.0.0.1:7777/0"
    options = LocalOptions(models_dir=tiny_llama.parent, redis_url=url, cpus=(0, 1))
    plan = build_plan(_example("local-disaggregated.yaml"), options, _ports())
    assert plan.needs_redis
    assert [(e.name, e.role) for e in plan.engines] == [("prefill-0", "prefill"), ("decode-0", "decode")]
    for engine in plan.engines:
        assert engine.env == {"TESSERA_KV_REDIS_URL": url}
        assert "--kv-redis-url" not in engine.args
        assert not [a for a in engine.args if "hunter2" in a]
        # The operator's prefix: this InferenceService's own key space.
        assert _engine_flags(engine.args)["--kv-redis-key-prefix"] == "tessera:default/local-pd:"
        assert "hunter2" not in repr(engine)  # nor in a log line of the plan
    assert "hunter2" not in yaml.safe_dump(plan.gateway_config)
    assert plan.gateway_config["disaggregation"] == {"min_uncached_tokens": 64, "kv_channel": "direct"}


def test_disaggregated_example_pushes_kv_from_the_prefill_to_the_decode_pod(tiny_llama):
    """kvChannel direct locally: the decode pod gets an inbox, the gateway the channel, and the
    address the gateway names to the prefill pod is the decode pod's loopback gRPC port."""
    from engine_pod.entrypoints.cli_args import engine_kwargs
    from engine_pod.server.main import add_parser
    from gateway.config import gateway_config_from_dict

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    plan = build_plan(_example("local-disaggregated.yaml"),
                      LocalOptions(models_dir=tiny_llama.parent, redis_url="redis://127.0.0.1:1/0"), _ports())
    prefill, decode = plan.engines
    assert _engine_flags(decode.args)["--kv-inbox-bytes"] == str(256 << 20)
    assert "--kv-inbox-bytes" not in prefill.args
    assert engine_kwargs(parser.parse_args(decode.args))["kv_inbox_bytes"] == 256 << 20
    gateway = gateway_config_from_dict(plan.gateway_config)
    assert gateway.disaggregation.kv_channel == "direct"
    assert {"address": decode.address, "role": "decode"} in plan.gateway_config["pods"]["static"]
    assert decode.address == f"127.0.0.1:{_engine_flags(decode.args)['--grpc-port']}"


def test_each_decode_pod_gets_a_kv_inbox_port_of_its_own(tiny_llama, tmp_path):
    """The operator's pods share one inbox port; on one machine each decode pod gets a free port
    (from the same allocator as its gRPC and metrics ports), none shared with any other listener,
    named in the banner. Prefill pods take no pushes and get none."""
    from engine_pod.server.main import _validate, add_parser
    from tessera_tools.up.runner import banner

    resource = _example("local-disaggregated.yaml")
    resource["spec"]["pools"]["decode"]["replicas"] = 2
    options = LocalOptions(models_dir=tiny_llama.parent, redis_url="redis://127.0.0.1:1/0")
    plan = build_plan(resource, options, _ports())
    prefill, *decodes = plan.engines
    assert [e.role for e in decodes] == ["decode", "decode"]
    assert prefill.kv_inbox_port == 0 and "--kv-inbox-port" not in prefill.args
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    lines = {line.split()[0]: line for line in banner(plan, options, tmp_path).splitlines()
             if line.startswith(tuple(f"  {e.name} " for e in plan.engines))}
    for decode in decodes:
        assert 40000 <= decode.kv_inbox_port < 40100  # from free_port, not the pods' 50063
        assert _engine_flags(decode.args)["--kv-inbox-port"] == str(decode.kv_inbox_port)
        _validate(parser.parse_args(decode.args))  # the engine's own checks: an inbox, distinct ports
        assert lines[decode.name].endswith(f"  KV inbox 127.0.0.1:{decode.kv_inbox_port}")
    assert "KV inbox" not in lines[prefill.name]
    ports = [plan.metrics_port] + [p for e in plan.engines for p in (e.grpc_port, e.metrics_port, e.kv_inbox_port) if p]
    assert len(ports) == len(set(ports)) == 1 + 3 * 2 + 2


def test_cluster_only_credentials_are_dropped_locally_with_a_warning(tiny_llama):
    """internalTLS and kvStore.redis.tls name Kubernetes Secrets: no file flags locally, no internal.tls."""
    resource = _example("local-disaggregated.yaml")
    resource["spec"]["internalTLS"] = {"secretName": "tls", "serverName": "engine.local"}
    resource["spec"]["internalSecretRef"] = {"name": "mine"}
    resource["spec"]["kvStore"]["redis"]["tls"] = {"caSecretRef": {"name": "ca"}}
    plan = build_plan(resource, LocalOptions(models_dir=tiny_llama.parent, redis_url="redis://127.0.0.1:1/0"),
                      _ports())
    for engine in plan.engines:
        for flag in ("--tls-cert-file", "--tls-client-ca-file", "--kv-redis-ca-file", "--health-port"):
            assert flag not in engine.args
    assert "internal" not in plan.gateway_config
    assert len(plan.warnings) == 3 and all("Kubernetes Secret" in w for w in plan.warnings)


def test_the_secret_file_is_private_from_its_creation(tmp_path):
    from tessera.internal_secret import InternalSecret
    from tessera_tools.up.runner import write_secret_file

    old_umask = os.umask(0)  # a umask cannot widen it either
    try:
        path = write_secret_file(tmp_path / "internal-secret", InternalSecret.generate())
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        first = path.read_bytes()
        write_secret_file(path, InternalSecret.generate())  # a rerun replaces it
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_bytes() != first
    assert InternalSecret.load(path) is not None


def test_engine_args_parse_with_the_engines_own_parser(tiny_llama):
    from engine_pod.server.main import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    plan = build_plan(_example("local-tiny.yaml"), LocalOptions(models_dir=tiny_llama.parent), _ports())
    args = parser.parse_args(plan.engines[0].args)
    assert args.cpu_threads >= 1 and args.max_num_seqs == 64


def test_invalid_resources_fail_with_the_operators_messages(tiny_llama):
    bad = _example("local-tiny.yaml")
    bad["spec"]["pools"]["mixed"]["replicas"] = -1
    bad["spec"]["engine"]["blockSize"] = "big"
    with pytest.raises(InvalidInferenceService) as err:
        build_plan(bad, LocalOptions(models_dir=tiny_llama.parent), _ports())
    assert "spec.pools.mixed.replicas" in str(err.value) and "spec.engine.blockSize" in str(err.value)
    with pytest.raises(ValueError, match="no checkpoint at"):
        build_plan(_example("local-tiny.yaml"), LocalOptions(models_dir=Path("/nonexistent")), _ports())


def test_split_cpus():
    assert split_cpus((0, 1, 2, 3), 2) == [frozenset({0, 1}), frozenset({2, 3})]
    assert split_cpus((0, 1), 3) == [frozenset({0}), frozenset({1}), frozenset({0})]


class _FakeProc:
    def __init__(self):
        self.code = None

    def poll(self):
        return self.code


class _FakeChild:
    def __init__(self):
        self.proc = _FakeProc()


def test_supervisor_restarts_with_doubling_backoff_that_resets_when_stable():
    now = [0.0]
    started = []
    sup = Supervisor(clock=lambda: now[0])

    def start():
        started.append(_FakeChild())
        return started[-1]

    child = sup.add("engine", start, stop_order=1)
    waits = []
    for _ in range(7):
        started[-1].proc.code = 1  # crash at once
        sup.check()
        waits.append(child.restart_at - now[0])
        now[0] = child.restart_at
        sup.check()
    assert waits == [1, 2, 4, 8, 16, 30, 30] and MAX_BACKOFF_S == 30
    assert child.restarts == 7 and len(started) == 8
    now[0] += STABLE_AFTER_S
    sup.check()  # ran a minute: the back-off starts over
    started[-1].proc.code = 1
    sup.check()
    assert child.restart_at - now[0] == 1


@pytest.mark.parametrize("text,message", [
    ("kind: InferenceService\nspec: [", "not valid YAML"),
    ("kind: Deployment\n", "expected exactly one InferenceService document, found 0"),
])
def test_bad_files_are_refused_naming_the_problem(tmp_path, text, message):
    import subprocess
    import sys

    path = tmp_path / "isvc.yaml"
    path.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "tessera_tools.cli", "up", "-f", str(path)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_adapters_are_read_from_this_machines_folders(tiny_llama, tmp_path):
    """spec.loras and the run-time roots name folders the way the model does (a PVC's path under
    --models-dir, or a hostPath): locally the engines get those folders, not the pods' mounts."""
    resource = _example("local-tiny.yaml")
    resource["spec"]["loras"] = [{"name": "sql", "pvc": {"claimName": "models", "path": "tiny-sql"}},
                                 {"name": "chat", "hostPath": {"path": str(tmp_path / "chat")}}]
    resource["spec"]["engine"]["lora"] = {"maxLoras": 2, "runtimeRoots": [{"hostPath": {"path": str(tmp_path)}}]}
    plan = build_plan(resource, LocalOptions(models_dir=tiny_llama.parent), _ports())
    args = plan.engines[0].args
    start = args.index("--lora-modules") + 1
    assert args[start : start + 2] == [f"sql={(tiny_llama.parent / 'tiny-sql').resolve()}", f"chat={tmp_path / 'chat'}"]
    assert _engine_flags(args)["--lora-root"] == str(tmp_path)
    assert [a["name"] for a in plan.gateway_config["model"]["loras"]] == ["sql", "chat"]


def test_batch_example_keeps_its_folder_under_the_state_directory(tiny_llama, tmp_path):
    """examples/local-batch.yaml: spec.batch.volume's folder lives under the run's state directory
    (what outlives a run), the engines get the batch class's priority as their background priority,
    and the gateway's own loader takes the config."""
    from engine_pod.config import SchedulerConfig
    from engine_pod.entrypoints.cli_args import engine_kwargs
    from engine_pod.server.main import add_parser
    from gateway.config import gateway_config_from_dict
    from tessera_tools.up.runner import banner

    options = LocalOptions(models_dir=tiny_llama.parent, state_dir=tmp_path / "state")
    plan = build_plan(_example("local-batch.yaml"), options, _ports())
    assert plan.batch and plan.batch_directory == (tmp_path / "state" / "batch" / "batches").resolve()
    assert plan.gateway_config["batch"]["directory"] == str(plan.batch_directory)
    batch = gateway_config_from_dict(plan.gateway_config).batch
    assert (batch.directory, batch.redis_url, batch.priority_class, batch.max_concurrency) == (
        str(plan.batch_directory), None, "batch", 4)
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    for engine in plan.engines:
        kwargs = engine_kwargs(parser.parse_args(engine.args))
        assert (kwargs["scheduling_policy"], kwargs["background_priority"]) == ("priority", 20)
        SchedulerConfig(policy=kwargs["scheduling_policy"], background_priority=kwargs["background_priority"])
    assert f"kept in {plan.batch_directory}" in banner(plan, options, tmp_path)
    # Without a state directory: the runner's default, .tessera/up/NAME.
    default = build_plan(_example("local-batch.yaml"), LocalOptions(models_dir=tiny_llama.parent), _ports())
    assert default.batch_directory == Path(".tessera/up/local-batch/batch/batches").resolve()


def test_no_batch_section_no_batch_api(tiny_llama):
    plan = build_plan(_example("local-tiny.yaml"), LocalOptions(models_dir=tiny_llama.parent), _ports())
    assert not plan.batch and plan.batch_directory is None and "batch" not in plan.gateway_config


def test_batch_redis_uses_the_runs_kv_redis_and_keeps_the_url_off_every_command_line(tiny_llama):
    """spec.batch.redis locally: the Redis of kvStore.redis (up's own, or --redis-url), in the gateway's
    environment as TESSERA_BATCH_REDIS_URL (as the operator's gateway pods get it), never in its config
    file nor on a command line; keys under the service's key space."""
    from gateway.config import gateway_config_from_dict

    url = "redis://:hunter2-redis-password@127.0.0.1:7777/0"
    resource = _example("local-disaggregated.yaml")
    resource["spec"]["batch"] = {"redis": {"urlSecretRef": {"name": "batch-redis"}}}
    plan = build_plan(resource, LocalOptions(models_dir=tiny_llama.parent, redis_url=url), _ports())
    assert plan.batch and plan.batch_directory is None
    assert plan.gateway_env == {"TESSERA_BATCH_REDIS_URL": url}
    assert "redis_url" not in plan.gateway_config["batch"]
    assert "hunter2" not in yaml.safe_dump(plan.gateway_config) and "hunter2" not in repr(plan)
    assert plan.gateway_config["batch"]["key_prefix"] == "tessera:default/local-pd:batch:"
    assert not [a for e in plan.engines for a in e.args if "hunter2" in a]
    assert any("batch.redis.urlSecretRef names a Kubernetes Secret" in w for w in plan.warnings)
    # The gateway's loader, with the environment the runner gives the gateway, finds the URL there.
    loaded = gateway_config_from_dict(plan.gateway_config, plan.gateway_env).batch
    assert (loaded.redis_url, loaded.key_prefix) == (url, "tessera:default/local-pd:batch:")


def test_batch_redis_tls_is_left_to_the_runs_redis_url(tiny_llama):
    """batch.redis.tls names Kubernetes Secrets, files only a pod has: locally the run's Redis URL is
    used as given, with a warning, and the config names no file the gateway would refuse to find."""
    from gateway.config import gateway_config_from_dict

    resource = _example("local-disaggregated.yaml")
    resource["spec"]["batch"] = {"redis": {"urlSecretRef": {"name": "batch-redis"}, "tls": {
        "caSecretRef": {"name": "redis-ca"}, "clientCertSecretRef": {"name": "redis-client"}}}}
    plan = build_plan(resource, LocalOptions(models_dir=tiny_llama.parent, redis_url="redis://127.0.0.1:7777/0"),
                      _ports())
    assert not [k for k in plan.gateway_config["batch"] if k.startswith("redis_")]
    assert any("batch.redis.tls names Kubernetes Secrets" in w for w in plan.warnings)
    assert gateway_config_from_dict(plan.gateway_config, plan.gateway_env).batch.redis_ca_file is None


def test_without_batch_redis_an_inherited_batch_redis_url_is_blanked(tiny_llama):
    """A TESSERA_BATCH_REDIS_URL in the shell running `tessera up` would take the gateway's batches to that
    Redis rather than the run's folder: the gateway gets it empty (unset), with or without spec.batch."""
    from gateway.config import gateway_config_from_dict

    options = LocalOptions(models_dir=tiny_llama.parent)
    for example in ("local-batch.yaml", "local-tiny.yaml"):
        plan = build_plan(_example(example), options, _ports())
        assert plan.gateway_env == {"TESSERA_BATCH_REDIS_URL": ""}
    batch = gateway_config_from_dict(plan.gateway_config, {**os.environ, **plan.gateway_env}).batch
    assert batch is None
    plan = build_plan(_example("local-batch.yaml"), options, _ports())
    batch = gateway_config_from_dict(plan.gateway_config, {"TESSERA_BATCH_REDIS_URL": "redis://elsewhere:6379/0",
                                                           **plan.gateway_env}).batch
    assert batch.redis_url is None and batch.directory == str(plan.batch_directory)


def test_batch_redis_without_a_kv_redis_is_refused(tiny_llama):
    resource = _example("local-tiny.yaml")
    resource["spec"]["batch"] = {"redis": {"urlSecretRef": {"name": "batch-redis"}}}
    with pytest.raises(ValueError, match=r"spec.batch.redis: `tessera up` keeps batches in the Redis it runs for "
                                         r"kvStore.redis .* add one, or keep batches in a folder with "
                                         r"spec.batch.volume"):
        build_plan(resource, LocalOptions(models_dir=tiny_llama.parent, redis_url="redis://127.0.0.1:1/0"), _ports())


def test_a_batch_run_keeps_its_secret_for_the_next_one(tmp_path):
    """The gateway signs batch records with a key derived from the internal secret: a run with a batch
    folder reuses the secret the last one left, if it is still private; otherwise it writes a new one."""
    from tessera.internal_secret import InternalSecret
    from tessera_tools.up.runner import kept_secret_file

    path = tmp_path / "internal-secret"
    kept_secret_file(path)
    first = path.read_bytes()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and InternalSecret.load(path) is not None
    assert kept_secret_file(path) == path and path.read_bytes() == first  # reused
    path.chmod(0o644)  # readable by others: no longer this run's alone
    kept_secret_file(path)
    assert path.read_bytes() != first and stat.S_IMODE(path.stat().st_mode) == 0o600
    path.write_bytes(b"short")  # not a valid secret
    kept_secret_file(path)
    assert InternalSecret.load(path) is not None


def test_a_run_keeps_its_secret_exactly_when_its_batches_outlive_it(tiny_llama, tmp_path):
    """Batches in a folder or in a Redis given by --redis-url outlive the run: it keeps its secret. In
    the run's own redis-server (stopped with it), or without the Batch API, each run makes its own."""
    from tessera_tools.up.runner import batches_outlive_the_run

    options = LocalOptions(models_dir=tiny_llama.parent, redis_url="redis://127.0.0.1:7777/0",
                           state_dir=tmp_path / "state")
    in_redis = _example("local-disaggregated.yaml")
    in_redis["spec"]["batch"] = {"redis": {"urlSecretRef": {"name": "batch-redis"}}}
    redis_plan = build_plan(in_redis, options, _ports())
    assert batches_outlive_the_run(redis_plan, own_redis=False)
    assert not batches_outlive_the_run(redis_plan, own_redis=True)
    folder_plan = build_plan(_example("local-batch.yaml"), options, _ports())
    assert folder_plan.batch_directory is not None and batches_outlive_the_run(folder_plan, own_redis=True)
    no_batch = build_plan(_example("local-disaggregated.yaml"), options, _ports())
    assert not no_batch.batch and not batches_outlive_the_run(no_batch, own_redis=False)


def test_simulated_pods_take_the_profile_and_compute_in_no_dtype(tiny_llama):
    options = LocalOptions(models_dir=tiny_llama.parent, cpus=(0, 1), simulate="engine_pod/sim/profiles/bench-cpu.json")
    plan = build_plan(_example("local-tiny.yaml"), options, _ports())
    for engine in plan.engines:
        flags = _engine_flags(engine.args)
        assert flags["--simulate"] == "engine_pod/sim/profiles/bench-cpu.json" and flags["--dtype"] == "auto"
    real = build_plan(_example("local-tiny.yaml"), LocalOptions(models_dir=tiny_llama.parent, cpus=(0, 1)), _ports())
    assert all("--simulate" not in e.args and _engine_flags(e.args)["--dtype"] == "float32" for e in real.engines)
