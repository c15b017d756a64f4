"""Secrets the pods read as files, never as command-line arguments (/proc/*/cmdline is
world-readable): the deployment's internal secret, the internal TLS certificate, Redis's TLS
files (and the gateway's tenants file, through `mounted_secret`). Each part gives the Secret
volumes, their read-only mounts, and the flags, config or environment that point the process at
the files.
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


# -- TLS to Redis (engine pods) ------------------------------------------------------

def redis_tls(spec: dict) -> SecretFiles:
    tls = (spec["kvStore"].get("redis") or {}).get("tls") or {}
    out = SecretFiles()
    if "caSecretRef" in tls:
        ref = tls["caSecretRef"]
        out += mounted_secret("redis-ca", ref["name"], {ref["key"]: TLS_CA}, REDIS_CA_DIR)
    if "clientCertSecretRef" in tls:
        out += mounted_secret("redis-client-cert", tls["clientCertSecretRef"]["name"],
                              {TLS_CERT: TLS_CERT, TLS_KEY: TLS_KEY}, REDIS_CLIENT_DIR)
    return out


def redis_tls_args(spec: dict) -> list[str]:
    tls = (spec["kvStore"].get("redis") or {}).get("tls") or {}
    args = []
    if "caSecretRef" in tls:
        args += ["--kv-redis-ca-file", f"{REDIS_CA_DIR}/{TLS_CA}"]
    if "clientCertSecretRef" in tls:
        args += ["--kv-redis-cert-file", f"{REDIS_CLIENT_DIR}/{TLS_CERT}",
                 "--kv-redis-key-file", f"{REDIS_CLIENT_DIR}/{TLS_KEY}"]
    return args
