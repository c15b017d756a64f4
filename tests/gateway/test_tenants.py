"""Tenants: key hashing, authentication, open access and the tenants file."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import yaml

from gateway.tenants import (
    AuthError, RateLimits, Tenant, TenantConfigError, TenantRegistry, hash_api_key,
)
from tessera.internal_secret import InternalSecret

KEY_A, KEY_A2, KEY_B = "sk-acme-1", "sk-acme-2", "sk-beta-1"
# The deployment's internal secret: the key of the cache salts.
SECRET = InternalSecret.from_text("tenants-tests-internal-secret-0123456789")


def _config(**acme_overrides) -> dict:
    acme = {
        "name": "acme", "api_key_sha256": [hash_api_key(KEY_A), hash_api_key(KEY_A2)],
        "priority_class": "standard", "allowed_priority_classes": ["standard", "batch"],
        "requests_per_minute": 600, "tokens_per_minute": 200000, "max_concurrent": 32,
    }
    acme.update(acme_overrides)
    beta = {"name": "beta", "api_key_sha256": [hash_api_key(KEY_B)]}
    return {"tenants": [acme, beta]}


def test_hash_api_key_is_sha256_hex():
    assert hash_api_key("secret") == hashlib.sha256(b"secret").hexdigest()
    assert len(hash_api_key("x")) == 64


def test_authenticate_maps_every_rotated_key_to_its_tenant():
    registry = TenantRegistry.from_dict(_config(), SECRET)
    acme = registry.authenticate(f"Bearer {KEY_A}")
    assert acme.name == "acme"
    assert registry.authenticate(f"Bearer {KEY_A2}") is acme
    assert registry.authenticate(f"bearer   {KEY_B}  ").name == "beta"  # scheme is case-insensitive
    assert acme.priority_class == "standard"
    assert acme.allowed_priority_classes == frozenset({"standard", "batch"})
    assert acme.limits == RateLimits(600, 200000, 32)


def test_parsed_tenant_without_options_is_unlimited():
    beta = TenantRegistry.from_dict(_config(), SECRET).authenticate(f"Bearer {KEY_B}")
    assert beta == Tenant("beta", None, None, RateLimits(), SECRET.cache_salt("tenant:beta"))


@pytest.mark.parametrize("header, message", [
    (None, "missing API key"),
    ("", "missing API key"),
    ("   ", "missing API key"),
    ("Bearer", "malformed"),
    ("Bearer   ", "malformed"),
    (f"Basic {KEY_A}", "malformed"),
    (KEY_A, "malformed"),
    ("Bearer sk-wrong", "invalid API key"),
    (f"Bearer {hash_api_key(KEY_A)}", "invalid API key"),  # the stored hash is not a key
])
def test_bad_credentials_raise_auth_error(header, message):
    registry = TenantRegistry.from_dict(_config(), SECRET)
    with pytest.raises(AuthError, match=message) as info:
        registry.authenticate(header)
    assert KEY_A not in str(info.value)


def test_open_access_admits_everyone_as_anonymous():
    registry = TenantRegistry.open_access(SECRET)
    for header in (None, "", "Bearer whatever", "garbage"):
        tenant = registry.authenticate(header)
        assert tenant.name == "anonymous"
        assert tenant.limits == RateLimits()
        assert tenant.allowed_priority_classes is None
    assert [t.name for t in registry.tenants] == ["anonymous"]
    assert registry.is_open_access


def test_cache_salt_is_per_tenant_unless_grouped():
    data = _config(cache_salt_group="shared-docs")
    data["tenants"][1]["cache_salt_group"] = "shared-docs"
    data["tenants"].append({"name": "solo", "api_key_sha256": hash_api_key("sk-solo")})
    data["tenants"].append({"name": "shared-docs", "api_key_sha256": [hash_api_key("sk-x")]})
    salts = {t.name: t.cache_salt for t in TenantRegistry.from_dict(data, SECRET).tenants}
    assert salts["acme"] == salts["beta"] == SECRET.cache_salt("group:shared-docs")
    assert salts["solo"] == SECRET.cache_salt("tenant:solo")
    # A tenant named like a group still gets its own salt.
    assert salts["shared-docs"] != salts["acme"]
    assert len(set(salts.values())) == 3


def test_cache_salts_are_keyed_by_the_internal_secret():
    """Knowing a tenant's name gives nothing: the salt is a keyed hash that
    another deployment (another secret) cannot reproduce."""
    data = _config(cache_salt_group="docs")
    data["tenants"][1]["cache_salt_group"] = "docs"
    data["tenants"].append({"name": "solo", "api_key_sha256": hash_api_key("sk-solo")})
    other = InternalSecret.from_text("another-deployment-internal-secret-0123")
    ours = {t.name: t.cache_salt for t in TenantRegistry.from_dict(data, SECRET).tenants}
    theirs = {t.name: t.cache_salt for t in TenantRegistry.from_dict(data, other).tenants}
    for name in ("acme", "beta", "solo"):
        assert ours[name] != theirs[name]
        for salt in (ours[name], theirs[name]):
            assert name not in salt and "docs" not in salt and "tenant:" not in salt and "group:" not in salt
            assert len(salt) == 64
    assert ours["acme"] == ours["beta"]  # the group still shares one salt
    anonymous = [TenantRegistry.open_access(s).tenants[0].cache_salt for s in (SECRET, other)]
    assert anonymous[0] != anonymous[1] and "anonymous" not in anonymous[0]
    with pytest.raises(TypeError, match="InternalSecret"):
        TenantRegistry.from_dict(data, None)


def test_uppercase_hashes_are_accepted():
    data = _config(api_key_sha256=[hash_api_key(KEY_A).upper()])
    assert TenantRegistry.from_dict(data, SECRET).authenticate(f"Bearer {KEY_A}").name == "acme"


def test_load_yaml_and_json_files(tmp_path):
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(_config()))
    (tmp_path / "t.json").write_text(json.dumps(_config()))
    for name in ("t.yaml", "t.json"):
        registry = TenantRegistry.load(tmp_path / name, SECRET)
        assert [t.name for t in registry.tenants] == ["acme", "beta"]
        assert registry.authenticate(f"Bearer {KEY_B}").name == "beta"


def test_load_kubernetes_secret_mount_directory(tmp_path):
    # The kubelet's layout: the real file in a timestamped dir, reached via ..data symlinks.
    mount = tmp_path / "tenants-secret"
    real = mount / "..2025_01_01_00_00_00.000000001"
    real.mkdir(parents=True)
    (real / "tenants.yaml").write_text(yaml.safe_dump(_config()))
    os.symlink(real.name, mount / "..data")
    os.symlink("..data/tenants.yaml", mount / "tenants.yaml")
    registry = TenantRegistry.load(mount, SECRET)
    assert registry.authenticate(f"Bearer {KEY_A}").name == "acme"


def test_load_errors_name_the_problem(tmp_path):
    with pytest.raises(TenantConfigError, match="cannot read"):
        TenantRegistry.load(tmp_path / "absent.yaml", SECRET)
    with pytest.raises(TenantConfigError, match="holds none of"):
        TenantRegistry.load(tmp_path, SECRET)
    (tmp_path / "bad.yaml").write_text("tenants: [unclosed")
    with pytest.raises(TenantConfigError, match="not valid YAML"):
        TenantRegistry.load(tmp_path / "bad.yaml", SECRET)


def _config_error(data) -> str:
    with pytest.raises(TenantConfigError) as info:
        TenantRegistry.from_dict(data, SECRET)
    return str(info.value)


def test_duplicate_name_is_an_error():
    data = _config()
    data["tenants"][1]["name"] = "acme"
    assert "duplicate name" in _config_error(data)


def test_a_hash_may_belong_to_one_tenant_only():
    data = _config()
    data["tenants"][1]["api_key_sha256"] = [hash_api_key(KEY_A)]
    message = _config_error(data)
    assert "beta" in message and "already belongs to tenant 'acme'" in message


def test_unknown_fields_are_errors():
    message = _config_error(_config(request_per_minute=10))  # typo of requests_per_minute
    assert "acme" in message and "request_per_minute" in message
    assert "top-level" in _config_error({**_config(), "tenant": []})


@pytest.mark.parametrize("field, value", [
    ("requests_per_minute", 0), ("tokens_per_minute", -5), ("max_concurrent", 1.5),
    ("max_concurrent", True), ("requests_per_minute", "600"),
])
def test_bad_limits_are_errors(field, value):
    message = _config_error(_config(**{field: value}))
    assert "acme" in message and field in message


@pytest.mark.parametrize("overrides, fragment", [
    ({"api_key_sha256": []}, "api_key_sha256 is required"),
    ({"api_key_sha256": ["abc"]}, "64-digit hex"),
    ({"api_key_sha256": [hash_api_key(KEY_A)] * 2}, "same digest twice"),
    ({"priority_class": "critical"}, "not in allowed_priority_classes"),
    ({"allowed_priority_classes": []}, "non-empty list"),
    ({"cache_salt_group": ""}, "cache_salt_group"),
    ({"name": ""}, "name"),
    ({"name": "has space"}, "name"),
])
def test_bad_tenant_entries_are_errors(overrides, fragment):
    assert fragment in _config_error(_config(**overrides))


@pytest.mark.parametrize("data", [None, [], {"tenants": []}, {"tenants": "acme"}, {"tenants": ["acme"]}])
def test_bad_file_shapes_are_errors(data):
    _config_error(data)


def test_rate_limits_validate_directly():
    with pytest.raises(ValueError):
        RateLimits(requests_per_minute=0)
    assert RateLimits(tokens_per_minute=1).max_concurrent is None
