"""Secrets the pods read as files, never as command-line arguments (/proc/*/cmdline is
world-readable): the deployment's internal secret, the internal TLS certificate, Redis's TLS
files (kvStore.redis's in the engine pods, batch.redis's in the gateway pods), and the gateway's
tenants file, through `mounted_secret`. Each part gives the Secret volumes, their read-only
mounts, and the flags, config or environment that point the process at the files.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.internal_secret import SECRET_FILE_ENV, SECRET_KEY
from tessera_operator import names
from tessera_operator.names import Owner

INTERNAL_SECRET_DIR = "/etc/tessera/internal"
INTERNAL_TLS_DIR = "/etc/tessera/internal-tls"
REDIS_CA_DIR = "/etc/tessera/redis-tls/ca"
REDIS_CLIENT_DIR = "/etc/tessera/redis-tls/client"
BATCH_REDIS_CA_DIR = "/etc/tessera/batch-redis-tls/ca"
BATCH_REDIS_CLIENT_DIR = "/etc/tessera/batch-redis-tls/client"
# What cert-manager (and kubectl create secret tls) name the files of a kubernetes.io/tls Secret.
TLS_CERT, TLS_KEY, TLS_CA = "tls.crt", "tls.key", "ca.crt"
# Owner and group (the pod's fsGroup) may read; nobody may write.
SECRET_FILE_MODE = 0o440


@dataclass
class SecretFiles:
    volumes: list[dict] = field(default_factory=list)  # pod volumes, one per Secret
    mounts: list[dict] = field(default_factory=list)   # the container's read-only mounts of them

    def __add__(self, other: SecretFiles) -> SecretFiles:
        return SecretFiles(self.volumes + other.volumes, self.mounts + other.mounts)


def mounted_secret(volume: str, secret_name: str, items: dict[str, str], mount_dir: str) -> SecretFiles:
    """`items`: Secret key -> file name under `mount_dir`."""
    return SecretFiles(
        [{"name": volume, "secret": {"secretName": secret_name, "defaultMode": SECRET_FILE_MODE,
                                     "items": [{"key": k, "path": p} for k, p in items.items()]}}],
        [{"name": volume, "mountPath": mount_dir, "readOnly": True}])


# -- the internal secret (gateway and engine pods) ---------------------------------

INTERNAL_SECRET_FILE = f"{INTERNAL_SECRET_DIR}/{SECRET_KEY}"


def internal_secret_ref(owner: Owner, spec: dict) -> tuple[str, str]:
    """(Secret name, key): the user's spec.internalSecretRef, else the one the operator creates."""
    ref = spec.get("internalSecretRef")
    return (ref["name"], ref["key"]) if ref else (names.internal_secret_name(owner), SECRET_KEY)


def internal_secret(owner: Owner, spec: dict) -> SecretFiles:
    name, key = internal_secret_ref(owner, spec)
    # Whatever the key, the file has one name: the env var below never changes.
    return mounted_secret("internal-secret", name, {key: SECRET_KEY}, INTERNAL_SECRET_DIR)


def internal_secret_env() -> list[dict]:
    return [{"name": SECRET_FILE_ENV, "value": INTERNAL_SECRET_FILE}]


# -- mutual TLS between the gateway and the engine pods ----------------------------

def internal_tls(spec: dict) -> SecretFiles:
    tls = spec.get("internalTLS")
    if not tls:
        return SecretFiles()
    return mounted_secret("internal-tls", tls["secretName"], {k: k for k in (TLS_CERT, TLS_KEY, TLS_CA)},
                          INTERNAL_TLS_DIR)


def engine_tls_args(spec: dict) -> list[str]:
    """The engine serves its gRPC port with this certificate and demands one signed by the CA;
    it dials peer pods (the direct P/D channel) with the same certificate, checking theirs
    against the CA and the service's server name, as the gateway does."""
    tls = spec.get("internalTLS")
    if not tls:
        return []
    return ["--tls-cert-file", f"{INTERNAL_TLS_DIR}/{TLS_CERT}", "--tls-key-file", f"{INTERNAL_TLS_DIR}/{TLS_KEY}",
            "--tls-client-ca-file", f"{INTERNAL_TLS_DIR}/{TLS_CA}", "--tls-server-name", tls["serverName"]]


def gateway_tls_config(spec: dict) -> dict | None:
    """The gateway config's `internal.tls`: its client certificate, and how it checks the engines'."""
    tls = spec.get("internalTLS")
    if not tls:
        return None
    return {"ca_file": f"{INTERNAL_TLS_DIR}/{TLS_CA}", "cert_file": f"{INTERNAL_TLS_DIR}/{TLS_CERT}",
            "key_file": f"{INTERNAL_TLS_DIR}/{TLS_KEY}", "server_name": tls["serverName"]}


# -- TLS to Redis: kvStore.redis.tls (engine pods), batch.redis.tls (gateway pods) -----

def _redis_tls_files(tls: dict, volume_prefix: str, ca_dir: str, client_dir: str) -> SecretFiles:
    out = SecretFiles()
    if "caSecretRef" in tls:
        ref = tls["caSecretRef"]
        out += mounted_secret(f"{volume_prefix}-ca", ref["name"], {ref["key"]: TLS_CA}, ca_dir)
    if "clientCertSecretRef" in tls:
        out += mounted_secret(f"{volume_prefix}-client-cert", tls["clientCertSecretRef"]["name"],
                              {TLS_CERT: TLS_CERT, TLS_KEY: TLS_KEY}, client_dir)
    return out


def _redis_tls_paths(tls: dict, ca_dir: str, client_dir: str) -> dict[str, str]:
    """ca_file, cert_file, key_file: where the mounted files are, for those the spec names."""
    paths = {}
    if "caSecretRef" in tls:
        paths["ca_file"] = f"{ca_dir}/{TLS_CA}"
    if "clientCertSecretRef" in tls:
        paths["cert_file"], paths["key_file"] = f"{client_dir}/{TLS_CERT}", f"{client_dir}/{TLS_KEY}"
    return paths


def _kv_redis_tls(spec: dict) -> dict:
    return (spec["kvStore"].get("redis") or {}).get("tls") or {}


def redis_tls(spec: dict) -> SecretFiles:
    return _redis_tls_files(_kv_redis_tls(spec), "redis", REDIS_CA_DIR, REDIS_CLIENT_DIR)


def redis_tls_args(spec: dict) -> list[str]:
    flags = {"ca_file": "--kv-redis-ca-file", "cert_file": "--kv-redis-cert-file", "key_file": "--kv-redis-key-file"}
    paths = _redis_tls_paths(_kv_redis_tls(spec), REDIS_CA_DIR, REDIS_CLIENT_DIR)
    return [arg for name, path in paths.items() for arg in (flags[name], path)]


def _batch_redis_tls(spec: dict) -> dict:
    return ((spec.get("batch") or {}).get("redis") or {}).get("tls") or {}


def batch_redis_tls(spec: dict) -> SecretFiles:
    """batch.redis.tls's Secrets, mounted into the gateway pods."""
    return _redis_tls_files(_batch_redis_tls(spec), "batch-redis", BATCH_REDIS_CA_DIR, BATCH_REDIS_CLIENT_DIR)


def batch_redis_tls_config(spec: dict) -> dict[str, str]:
    """The gateway config's batch.redis_ca_file, redis_cert_file, redis_key_file (those set)."""
    paths = _redis_tls_paths(_batch_redis_tls(spec), BATCH_REDIS_CA_DIR, BATCH_REDIS_CLIENT_DIR)
    return {f"redis_{name}": path for name, path in paths.items()}
