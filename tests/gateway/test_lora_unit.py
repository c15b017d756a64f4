"""LoRA adapters in the gateway, without processes: the config's `model.loras`,
tenants' `allowed_models` and `admin`, the model catalog (what `model` may
name, and who sees what), and adapter-aware routing over hand-made pod
reports (as tests/gateway/test_router.py builds them)."""

from __future__ import annotations

import asyncio
import functools
import re

import pytest

from gateway.catalog import UNKNOWN_MODEL_LABEL, ModelCatalog, ModelEntry
from gateway.config import AdmissionConfig, GatewayConfigError, RouterConfig, gateway_config_from_dict
from gateway.errors import GatewayError
from gateway.pods import Pod, PodPool
from gateway.router import Router
from gateway.tenants import AdminRefused, TenantConfigError, TenantRegistry, hash_api_key
from tessera.internal_secret import InternalSecret
from tessera.v1 import engine_pb2 as epb

BASE = {"model": {"name": "m", "path": "/models/m"}, "pods": {"static": [{"address": "10.0.0.1:50061"}]}}
SECRET = InternalSecret.from_text("lora-tests-internal-secret-0123456789")


def _model(**fields) -> dict:
    return {**BASE, "model": {**BASE["model"], **fields}}


# -- config -----------------------------------------------------------------


def test_loras_are_names_listed_under_the_model():
    config = gateway_config_from_dict(_model(loras=[{"name": "sql-lora"}, {"name": "org/chat:v2"}]))
    assert [lora.name for lora in config.model.loras] == ["sql-lora", "org/chat:v2"]
    assert config.model.lora_admin_timeout_s == 30.0
    assert gateway_config_from_dict(BASE).model.loras == ()
    assert config.router.weights.lora_resident == 0.25


@pytest.mark.parametrize("fields, message", [
    ({"loras": [{"name": "a"}, {"name": "a"}]}, "model.loras[1].name: 'a' is listed twice"),
    ({"loras": [{"name": "m"}]}, "model.loras[0].name: 'm' is the base model's name"),
    ({"loras": [{"name": "has space"}]}, "model.loras[0].name: 'has space' is not a valid adapter name"),
    ({"loras": [{"name": ""}]}, "is not a valid adapter name"),
    ({"loras": [{"name": "x" * 257}]}, "is not a valid adapter name"),
    ({"loras": [{"name": 7}]}, "model.loras[0].name: expected str"),
    ({"loras": ["a"]}, "model.loras[0]: expected a mapping"),
    ({"loras": [{"name": "a", "path": "/p"}]}, "unknown field(s) ['path']"),
    ({"loras": {"name": "a"}}, "model.loras: expected a list"),
    ({"lora_admin_timeout_s": 0}, "model.lora_admin_timeout_s must be > 0"),
])
def test_bad_loras_are_errors_naming_the_entry(fields, message):
    with pytest.raises(GatewayConfigError, match=re.escape(message)):
        gateway_config_from_dict(_model(**fields))


def test_the_residency_weight_is_checked_like_the_others():
    with pytest.raises(GatewayConfigError, match="router.weights must be >= 0"):
        gateway_config_from_dict({**BASE, "router": {"weights": {"lora_resident": -1}}})


# -- tenants ----------------------------------------------------------------

KEYS = {"ops": "sk-ops-1", "acme": "sk-acme-1", "beta": "sk-beta-1"}


def _tenants(**acme) -> dict:
    return {"tenants": [
        {"name": "ops", "api_key_sha256": hash_api_key(KEYS["ops"]), "admin": True},
        {"name": "acme", "api_key_sha256": hash_api_key(KEYS["acme"]), **acme},
        {"name": "beta", "api_key_sha256": hash_api_key(KEYS["beta"])},
    ]}


def _registry(**acme) -> TenantRegistry:
    return TenantRegistry.from_dict(_tenants(**acme), SECRET)


def _tenant(registry: TenantRegistry, name: str):
    return registry.authenticate(f"Bearer {KEYS[name]}")


def test_allowed_models_and_admin_are_parsed():
    registry = _registry(allowed_models=["m", "sql-lora"])
    acme, beta, ops = (_tenant(registry, n) for n in ("acme", "beta", "ops"))
    assert acme.allowed_models == frozenset({"m", "sql-lora"}) and not acme.admin
    assert acme.may_use("sql-lora") and not acme.may_use("chat-lora")
    assert beta.allowed_models is None and beta.may_use("anything")  # absent: every model
    assert ops.admin


@pytest.mark.parametrize("acme, fragment", [
    ({"allowed_models": []}, "allowed_models must be a non-empty list"),
    ({"allowed_models": "m"}, "allowed_models must be a non-empty list"),
    ({"allowed_models": ["m", ""]}, "allowed_models entry '' is not a model name"),
    ({"allowed_models": ["m", 3]}, "allowed_models entry '3' is not a model name"),
    ({"allowed_models": ["m", "m"]}, "lists the same model twice"),
    ({"admin": "yes"}, "admin must be true or false"),
    ({"admin": 1}, "admin must be true or false"),
])
def test_bad_allowed_models_or_admin_are_errors(acme, fragment):
    with pytest.raises(TenantConfigError, match=fragment) as info:
        _registry(**acme)
    assert "tenant 'acme'" in str(info.value)


def test_only_admin_tenants_pass_the_admin_check():
    registry = _registry()
    registry.check_admin(_tenant(registry, "ops"))
    with pytest.raises(AdminRefused, match="lacks `admin: true`"):
        registry.check_admin(_tenant(registry, "acme"))
    # Open access has no admin: everyone is anonymous, and anonymous is nobody's admin.
    open_access = TenantRegistry.open_access(SECRET)
    with pytest.raises(AdminRefused, match="need an admin API key: add a tenant with `admin: true` to the tenants"):
        open_access.check_admin(open_access.authenticate(None))


# -- the catalog ------------------------------------------------------------


def in_loop(test):
    """Run the test's body inside an event loop: a Pod opens its (never used) channel on one."""
    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        async def body():
            return test(*args, **kwargs)
        return asyncio.run(body())
    return wrapper


def _pod(address: str, adapters=(), waiting: int = 0, role: str = "mixed") -> Pod:
    """A routable pod whose report lists `adapters`: (name, fingerprint, resident)."""
    pod = Pod(address, role)
    pod.on_report(epb.LoadReport(role=role, serving=True, num_waiting=waiting, lora_adapters=[
        epb.LoRAAdapter(name=n, fingerprint=f, resident=r) for n, f, r in adapters]))
    return pod


def _pool(*pods: Pod, config: RouterConfig | None = None) -> PodPool:
    pool = PodPool(config or RouterConfig(), AdmissionConfig())
    for pod in pods:
        pool.pods[pod.address] = pod
    return pool


def _not_found(catalog: ModelCatalog, model: str, tenant) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        catalog.resolve(model, tenant)
    return info.value


@in_loop
def test_model_names_the_base_a_configured_or_a_reported_adapter():
    pool = _pool(_pod("a:1", [("reported", "f" * 64, True)]))
    catalog = ModelCatalog("m", ["configured"], pool)
    anyone = TenantRegistry.open_access(SECRET).authenticate(None)
    assert catalog.resolve("m", anyone) == ""  # the base model: no lora_name
    assert catalog.resolve("configured", anyone) == "configured"
    assert catalog.resolve("reported", anyone) == "reported"
    assert catalog.adapter_names() == ["configured", "reported"]
    error = _not_found(catalog, "gpt-17", anyone)
    assert (error.status, error.code, error.param) == (404, "model_not_found", "model")
    assert error.message == "The model `gpt-17` does not exist or you do not have access to it."


@in_loop
def test_a_model_outside_the_tenants_list_is_the_same_404_as_an_unknown_one():
    catalog = ModelCatalog("m", ["sql-lora", "chat-lora"], _pool())
    registry = _registry(allowed_models=["sql-lora"])
    acme = _tenant(registry, "acme")
    assert catalog.resolve("sql-lora", acme) == "sql-lora"
    refused, unknown = _not_found(catalog, "chat-lora", acme), _not_found(catalog, "no-such-lora", acme)
    assert refused.to_openai() == {"error": {**unknown.to_openai()["error"],
                                             "message": unknown.message.replace("no-such-lora", "chat-lora")}}
    assert _not_found(catalog, "m", acme).code == "model_not_found"  # the base model too, when not listed


@in_loop
def test_models_list_shows_each_tenant_its_own_with_the_parent():
    catalog = ModelCatalog("m", ["sql-lora", "chat-lora"], _pool())
    registry = _registry(allowed_models=["sql-lora"])
    assert catalog.visible(_tenant(registry, "beta")) == [
        ModelEntry("m", None), ModelEntry("chat-lora", "m"), ModelEntry("sql-lora", "m")]
    assert catalog.visible(_tenant(registry, "acme")) == [ModelEntry("sql-lora", "m")]
    assert catalog.find("sql-lora", _tenant(registry, "acme")) == ModelEntry("sql-lora", "m")
    with pytest.raises(GatewayError, match="does not exist or you do not have access"):
        catalog.find("chat-lora", _tenant(registry, "acme"))


@in_loop
def test_admin_loads_and_unloads_change_the_list_at_once():
    pod = _pod("a:1", [("shared", "f" * 64, False)])
    catalog = ModelCatalog("m", ["configured"], _pool(pod))
    catalog.added("new")
    assert catalog.known("new")
    catalog.removed("configured")
    catalog.removed("shared")
    assert not catalog.known("configured")
    assert catalog.known("shared")  # a pod still reports it: still served there
    pod.set_adapters([])
    assert catalog.adapter_names() == ["new"]


@in_loop
def test_the_fingerprint_is_the_one_most_pods_report():
    pods = [_pod("a:1", [("x", "aa", True)]), _pod("b:1", [("x", "bb", True)]), _pod("c:1", [("x", "bb", False)]),
            _pod("d:1")]
    catalog = ModelCatalog("m", ["x", "y"], _pool(*pods))
    assert catalog.fingerprint("x") == "bb"
    assert catalog.fingerprint("y") is None  # configured, reported by no pod
    # A tie goes to the smaller, so every replica hashes alike.
    assert ModelCatalog("m", [], _pool(*pods[:2])).fingerprint("x") == "aa"


@in_loop
def test_metric_labels_are_served_names_only():
    catalog = ModelCatalog("m", ["sql-lora"], _pool(_pod("a:1", [("reported", "ff", True)])))
    assert [catalog.metric_label(n) for n in ("m", "sql-lora", "reported", "made-up/123")] == [
        "m", "sql-lora", "reported", UNKNOWN_MODEL_LABEL]


@in_loop
def test_reports_keep_only_valid_adapter_names():
    pod = _pod("a:1", [("ok", "ff", True), ("bad name", "ff", True), ("", "ff", True)])
    assert list(pod.adapters) == ["ok"]


# -- routing ----------------------------------------------------------------


def _rank(pods: list[tuple], adapter: str, policy: str = "score", hashes=()) -> list[str]:
    """The addresses ranked for a request on `adapter` over pods made from `_pod`'s arguments."""
    async def run() -> list[str]:
        config = RouterConfig(policy=policy, prefix_match="pushed")  # pushed: no prefix RPCs to these fake pods
        pool = _pool(*(_pod(*spec) for spec in pods), config=config)
        router = Router(pool, config, AdmissionConfig(), block_size=16)
        ranked = await router.rank("mixed", list(hashes), 64, b"k" * 32, adapter=adapter)
        await pool.close()
        return [s.pod.address for s in ranked]

    return asyncio.run(run())


def test_an_adapter_goes_to_a_pod_holding_it_resident():
    pods = [("cold:1", [("x", "ff", False)]), ("warm:1", [("x", "ff", True)])]
    assert _rank(pods, "x")[0] == "warm:1"
    # The base model's requests ignore residency: the tie-break decides, so both pods win some.
    assert {_rank_key(pods, k)[0] for k in range(16)} == {"cold:1", "warm:1"}


def _rank_key(pods: list[tuple], k: int) -> list[str]:
    async def run():
        config = RouterConfig()
        pool = _pool(*(_pod(*spec) for spec in pods), config=config)
        ranked = await Router(pool, config, AdmissionConfig(), 16).rank("mixed", [], 8, bytes([k]) * 8)
        await pool.close()
        return [s.pod.address for s in ranked]

    return asyncio.run(run())


@pytest.mark.parametrize("warm_waiting, warm_wins", [(0, True), (3, True), (5, False), (8, False)])
def test_a_busy_pod_holding_the_adapter_spills_to_another_serving_it(warm_waiting, warm_wins):
    """Residency is worth lora_resident (0.25, about four waiting requests at
    max_waiting_per_pod 8): beyond, the idle pod takes the adapter's requests
    and loads it, so a popular adapter spreads."""
    pods = [("cold:1", [("x", "ff", False)]), ("warm:1", [("x", "ff", True)], warm_waiting)]
    assert (_rank(pods, "x")[0] == "warm:1") == warm_wins


def test_pods_not_serving_the_adapter_are_never_chosen_if_one_does():
    pods = [("idle:1",), ("other:1", [("y", "ee", True)]), ("busy:1", [("x", "ff", False)], 7)]
    for policy in ("score", "bounded", "round_robin"):
        assert _rank(pods, "x", policy) == ["busy:1"], policy
    # No pod reports it (a configured adapter, pods without --enable-lora): any pod, whose NOT_FOUND is a 404.
    assert sorted(_rank(pods, "z")) == ["busy:1", "idle:1", "other:1"]


def test_bounded_asks_the_pods_holding_the_adapter_wherever_the_ring_points():
    """Of 40 pods serving the adapter, 2 hold it resident: the ring's
    candidates are others, but the resident pods are candidates too and win."""
    pods = [(f"p{i}:1", [("x", "ff", i in (17, 31))]) for i in range(40)]
    hashes = [bytes([i]) * 32 for i in range(4)]
    ranked = _rank(pods, "x", "bounded", hashes)
    assert set(ranked[:2]) == {"p17:1", "p31:1"}
