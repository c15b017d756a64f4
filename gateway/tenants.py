"""Tenants and API-key authentication.

API keys are never stored: the tenants file (or the Kubernetes Secret mounted
as a directory) holds only their SHA-256 digests, and a presented key is
hashed and looked up by digest. Unknown fields in the file are errors, so a
typo such as `request_per_minute` can never silently disable a limit.

A tenant's prefix-cache salt is a keyed hash of its identity under the
deployment's internal secret: knowing a tenant's name does not give its salt,
so nobody who reaches an engine pod can ask for another tenant's cached KV.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tessera.internal_secret import InternalSecret

# The file the Secret (or ConfigMap) mount must contain when a directory is given.
TENANTS_FILE_NAMES = ("tenants.yaml", "tenants.yml", "tenants.json")
ANONYMOUS = "anonymous"

# Tenant names end up in metric labels, logs and cache salts: keep them plain.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_SHA256_HEX_RE = re.compile(r"^[0-9a-f]{64}$")
_TENANT_FIELDS = frozenset({
    "name", "api_key_sha256", "priority_class", "allowed_priority_classes",
    "requests_per_minute", "tokens_per_minute", "max_concurrent", "cache_salt_group", "allowed_models", "admin",
})
# A model name in allowed_models: the base model's or an adapter's (1-256 characters, like the engine's names).
_MAX_MODEL_NAME_LEN = 256
_LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")


def hash_api_key(key: str) -> str:
    """The stored form of an API key: its SHA-256 hex digest."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class AuthError(Exception):
    """Authentication failed; str(e) is safe to show the client."""


class AdminRefused(Exception):
    """An authenticated caller may not use an admin endpoint; str(e) is safe to show."""


class TenantConfigError(ValueError):
    """The tenants file is invalid; the message names the tenant and field."""


@dataclass(frozen=True)
class RateLimits:
    """Per-tenant limits; None means unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    def __post_init__(self) -> None:
        for name in _LIMIT_FIELDS:
            value = getattr(self, name)
            # bool is an int subclass: `max_concurrent: true` is a typo, not 1.
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Tenant:
    name: str
    priority_class: str | None
    # None: every priority class is allowed.
    allowed_priority_classes: frozenset[str] | None
    limits: RateLimits
    # Goes into the block hash's extra keys: equal salts may share prefix-cache KV.
    # A keyed hash (the internal secret's cache_salt), never the name itself.
    cache_salt: str
    # The models (the base model's name and/or LoRA adapters' names) the
    # tenant may use and see in /v1/models; None: every model. Any other is
    # answered as an unknown model (404), so a tenant cannot probe which exist.
    allowed_models: frozenset[str] | None = None
    # May call the admin endpoints (/v1/load_lora_adapter, /v1/unload_lora_adapter).
    admin: bool = False

    def may_use(self, model: str) -> bool:
        """Whether the tenant's allow-list admits `model` (a base or adapter name)."""
        return self.allowed_models is None or model in self.allowed_models


def _cache_salt(secret: InternalSecret, name: str, group: str | None) -> str:
    if not isinstance(secret, InternalSecret):
        raise TypeError("tenants: the cache salts need the deployment's InternalSecret, got "
                        f"{type(secret).__name__}")
    # Distinct prefixes keep a tenant named "x" apart from a group named "x".
    return secret.cache_salt(f"group:{group}" if group is not None else f"tenant:{name}")


class TenantRegistry:
    """Maps presented API keys to tenants."""

    def __init__(self, tenants: list[Tenant], tenant_by_key_hash: dict[str, Tenant], open_access: bool = False):
        self._tenants = list(tenants)
        self._by_hash = dict(tenant_by_key_hash)
        self._open_access = open_access

    @classmethod
    def open_access(cls, secret: InternalSecret) -> TenantRegistry:
        """No tenants configured: everyone is the unlimited tenant "anonymous"."""
        anonymous = Tenant(ANONYMOUS, None, None, RateLimits(), _cache_salt(secret, ANONYMOUS, None))
        return cls([anonymous], {}, open_access=True)

    @classmethod
    def load(cls, path: str | Path, secret: InternalSecret) -> TenantRegistry:
        """From a YAML/JSON file, or a directory (Secret mount) holding tenants.yaml."""
        return cls.from_dict(_read_file(_resolve_file(Path(path))), secret)

    @classmethod
    def from_dict(cls, data: Any, secret: InternalSecret) -> TenantRegistry:
        """``secret``: the deployment's internal secret, the key of the cache salts."""
        if not isinstance(data, dict):
            raise TenantConfigError("tenants file: expected a mapping with a `tenants` list")
        unknown = sorted(set(data) - {"tenants"})
        if unknown:
            raise TenantConfigError(f"tenants file: unknown top-level field(s) {unknown}")
        items = data.get("tenants")
        if not isinstance(items, list) or not items:
            # An empty list would lock everyone out; open access is "no file", not "empty file".
            raise TenantConfigError("tenants file: `tenants` must be a non-empty list")
        tenants: list[Tenant] = []
        by_hash: dict[str, Tenant] = {}
        for index, item in enumerate(items):
            tenant, hashes = _parse_tenant(item, index, secret)
            if any(t.name == tenant.name for t in tenants):
                raise TenantConfigError(f"tenant {tenant.name!r}: duplicate name")
            for digest in hashes:
                if digest in by_hash:
                    raise TenantConfigError(
                        f"tenant {tenant.name!r}: api_key_sha256 {digest[:12]}... already belongs to "
                        f"tenant {by_hash[digest].name!r}")
                by_hash[digest] = tenant
            tenants.append(tenant)
        return cls(tenants, by_hash)

    @property
    def tenants(self) -> list[Tenant]:
        return list(self._tenants)

    @property
    def is_open_access(self) -> bool:
        return self._open_access

    def check_admin(self, tenant: Tenant) -> None:
        """AdminRefused unless `tenant` may call the admin endpoints: an
        `admin: true` tenant of the tenants file (open access has none)."""
        if self._open_access:
            raise AdminRefused("admin endpoints need an admin API key: add a tenant with `admin: true` to the "
                               "tenants file (tenants_file); without one they are refused")
        if not tenant.admin:
            raise AdminRefused("this API key may not call admin endpoints (its tenant lacks `admin: true`)")

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant for a raw `Authorization` header / metadata value."""
        if self._open_access:
            return self._tenants[0]
        key = _bearer_key(authorization)
        # A dict lookup on the digest: timing reveals nothing about the stored keys.
        tenant = self._by_hash.get(hash_api_key(key))
        if tenant is None:
            raise AuthError("invalid API key")
        return tenant


def _bearer_key(authorization: str | None) -> str:
    if authorization is None or not authorization.strip():
        raise AuthError("missing API key")
    parts = authorization.strip().split(None, 1)
    if len(parts) != 2 or parts[0].lower() != "bearer" or not parts[1].strip():
        raise AuthError("malformed Authorization header: expected 'Bearer <API key>'")
    return parts[1].strip()


def _resolve_file(path: Path) -> Path:
    if not path.is_dir():
        return path
    # Secret mounts expose each key as a symlink into ..data; reading follows it.
    for name in TENANTS_FILE_NAMES:
        if (path / name).is_file():
            return path / name
    raise TenantConfigError(f"tenants directory {path} holds none of {list(TENANTS_FILE_NAMES)}")


def _read_file(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise TenantConfigError(f"tenants file: cannot read {path}: {e}") from None
    try:
        return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise TenantConfigError(f"tenants file {path} is not valid YAML/JSON: {e}") from None


def _parse_tenant(item: Any, index: int, secret: InternalSecret) -> tuple[Tenant, list[str]]:
    where = f"tenants[{index}]"
    if not isinstance(item, dict):
        raise TenantConfigError(f"{where}: expected a mapping")
    name = item.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise TenantConfigError(f"{where}: `name` is required: letters, digits, '.', '_', '-' (max 63)")
    where = f"tenant {name!r}"
    unknown = sorted(set(item) - _TENANT_FIELDS)
    if unknown:
        raise TenantConfigError(f"{where}: unknown field(s) {unknown}; known: {sorted(_TENANT_FIELDS)}")
    hashes = _parse_hashes(item.get("api_key_sha256"), where)
    default_class = _optional_str(item, "priority_class", where)
    allowed = _parse_allowed(item.get("allowed_priority_classes"), where)
    if default_class is not None and allowed is not None and default_class not in allowed:
        raise TenantConfigError(f"{where}: priority_class {default_class!r} is not in allowed_priority_classes")
    try:
        limits = RateLimits(**{f: item.get(f) for f in _LIMIT_FIELDS})
    except ValueError as e:
        raise TenantConfigError(f"{where}: {e}") from None
    group = _optional_str(item, "cache_salt_group", where)
    models = _parse_allowed_models(item.get("allowed_models"), where)
    admin = item.get("admin", False)
    if not isinstance(admin, bool):
        raise TenantConfigError(f"{where}: admin must be true or false, got {admin!r}")
    return Tenant(name, default_class, allowed, limits, _cache_salt(secret, name, group), models, admin), hashes


def _parse_hashes(value: Any, where: str) -> list[str]:
    # One string is accepted as a list of one; several allow key rotation.
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not values:
        raise TenantConfigError(f"{where}: api_key_sha256 is required (one or more SHA-256 hex digests)")
    digests = []
    for v in values:
        digest = v.lower() if isinstance(v, str) else None
        if digest is None or not _SHA256_HEX_RE.match(digest):
            raise TenantConfigError(f"{where}: api_key_sha256 entry {str(v)[:16]!r} is not a 64-digit hex digest")
        digests.append(digest)
    if len(set(digests)) != len(digests):
        raise TenantConfigError(f"{where}: api_key_sha256 lists the same digest twice")
    return digests


def _parse_allowed(value: Any, where: str) -> frozenset[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise TenantConfigError(f"{where}: allowed_priority_classes must be a non-empty list of class names")
    return frozenset(value)


def _parse_allowed_models(value: Any, where: str) -> frozenset[str] | None:
    if value is None:
        return None
    # An empty list would admit no model at all: a tenant that can do nothing is a mistake, not a policy.
    if not isinstance(value, list) or not value:
        raise TenantConfigError(f"{where}: allowed_models must be a non-empty list of model names "
                                "(the base model's and/or LoRA adapters'); leave it out to allow every model")
    for v in value:
        if not isinstance(v, str) or not 1 <= len(v) <= _MAX_MODEL_NAME_LEN:
            raise TenantConfigError(f"{where}: allowed_models entry {str(v)[:64]!r} is not a model name "
                                    f"(a string of 1-{_MAX_MODEL_NAME_LEN} characters)")
    if len(set(value)) != len(value):
        raise TenantConfigError(f"{where}: allowed_models lists the same model twice")
    return frozenset(value)


def _optional_str(item: dict, key: str, where: str) -> str | None:
    value = item.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise TenantConfigError(f"{where}: {key} must be a non-empty string")
    return value
