"""The deployment's internal secret: one random value shared by the gateway and
the engine pods of one InferenceService, and the keys derived from it.

One Secret (the operator creates it if absent; `tessera up` generates one)
serves three purposes, each with its own key so that no two uses can be
played against each other:

- ``token``: the bearer token engine pods demand of every caller (the gateway,
  a P/D peer); a client that merely reaches a pod's port gets UNAUTHENTICATED.
- ``kv_mac_key``: the key of the MAC over every KV value in a shared tier
  (Redis), so a value written by anyone without the key, or by another
  deployment, is refused.
- ``cache_salt(identity)``: the prefix-cache salt of a tenant (or salt group),
  a keyed hash: knowing a tenant's name does not give its salt.

The secret reaches processes by environment or file, never the command line
(``/proc/*/cmdline`` is world-readable): ``TESSERA_INTERNAL_SECRET_FILE``
names a file holding it (a mounted Secret), else ``TESSERA_INTERNAL_SECRET``
holds it. Nothing here ever puts the secret or a derived key into a message.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets as _secrets
from dataclasses import dataclass
from pathlib import Path

SECRET_ENV = "TESSERA_INTERNAL_SECRET"
SECRET_FILE_ENV = "TESSERA_INTERNAL_SECRET_FILE"
# The key the operator's Secret stores it under (mounted as a file of that name).
SECRET_KEY = "internal-secret"
# gRPC metadata carrying the token on every internal call.
AUTH_METADATA_KEY = "authorization"
MIN_SECRET_CHARS = 32


class InternalSecretError(ValueError):
    """The secret is missing, unreadable or too short; the message never holds it."""


@dataclass(frozen=True)
class InternalSecret:
    value: bytes

    def __post_init__(self) -> None:
        if len(self.value) < MIN_SECRET_CHARS:
            raise InternalSecretError(
                f"internal secret: must be at least {MIN_SECRET_CHARS} characters "
                f"(got {len(self.value)}); `tessera internal-secret` makes one")

    def __repr__(self) -> str:  # never the value, not even in a traceback's locals
        return "InternalSecret(***)"

    __str__ = __repr__

    @classmethod
    def generate(cls) -> InternalSecret:
        return cls(_secrets.token_urlsafe(32).encode())

    @classmethod
    def from_text(cls, text: str) -> InternalSecret:
        return cls(text.strip().encode())

    @classmethod
    def from_file(cls, path: str | Path) -> InternalSecret:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InternalSecretError(f"internal secret: cannot read {path}: {type(e).__name__}") from None
        return cls.from_text(text)

    @classmethod
    def load(cls, path: str | Path | None = None, environ: dict | None = None) -> InternalSecret | None:
        """From ``path``, else the file named by TESSERA_INTERNAL_SECRET_FILE,
        else TESSERA_INTERNAL_SECRET; None when none is set."""
        env = os.environ if environ is None else environ
        path = path or env.get(SECRET_FILE_ENV)
        if path:
            return cls.from_file(path)
        if env.get(SECRET_ENV):
            return cls.from_text(env[SECRET_ENV])
        return None

    @classmethod
    def require(cls, needed_for: str, path: str | Path | None = None, setting: str = "",
                otherwise: str = "") -> InternalSecret:
        """``load()``, or an InternalSecretError saying what needs the secret
        (``needed_for``) and every way to give it: ``setting`` (a config key
        that names a file) first, then the environment, then ``otherwise``."""
        secret = cls.load(path)
        if secret is None:
            ways = f"{setting}, " if setting else ""
            alternative = f", or {otherwise}" if otherwise else ""
            raise InternalSecretError(
                f"no internal secret: {needed_for}; set {ways}{SECRET_FILE_ENV} (a file holding it) or {SECRET_ENV} "
                f"(`tessera internal-secret` makes one){alternative}")
        return secret

    # -- derived keys ------------------------------------------------------
    def derive(self, purpose: str) -> bytes:
        """A 32-byte key for one purpose (HMAC-SHA256 of the secret over a label)."""
        return hmac.new(self.value, f"tessera/{purpose}/v1".encode(), hashlib.sha256).digest()

    @property
    def token(self) -> str:
        return self.derive("internal-token").hex()

    @property
    def kv_mac_key(self) -> bytes:
        return self.derive("kv-mac")

    def cache_salt(self, identity: str) -> str:
        """The prefix-cache salt of ``identity`` (e.g. "tenant:acme", "group:shared")."""
        return hmac.new(self.derive("cache-salt"), identity.encode(), hashlib.sha256).hexdigest()

    # -- the bearer token on gRPC ------------------------------------------
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata that authenticates this process to an engine pod."""
        return ((AUTH_METADATA_KEY, f"Bearer {self.token}"),)

    def accepts(self, authorization: str | None) -> bool:
        """Whether an ``authorization`` metadata value carries this secret's token
        (constant-time compare)."""
        if not authorization:
            return False
        scheme, _, presented = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(presented.strip().encode(), self.token.encode())
