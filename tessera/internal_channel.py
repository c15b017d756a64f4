"""Channels to engine pods that authenticate the caller.

Every internal client of an engine pod (the gateway's Pod, benchmarks,
tests) dials through `InternalClient`: the deployment's internal token
(tessera/internal_secret.py) goes as `authorization: Bearer` metadata on
every call, added by a channel interceptor so no call site can forget it;
with `InternalTLS` the channel also speaks mutual TLS (the pods demand a
client certificate signed by their client CA). The health service needs
neither credential (kubelet probes send none), so health checks dial plainly.

No torch here: the gateway imports this module.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from tessera.internal_secret import InternalSecret


@dataclass(frozen=True)
class InternalTLS:
    """The client side of mutual TLS to engine pods (PEM files; cert-manager's
    kubernetes.io/tls Secret mounts them as ca.crt, tls.crt, tls.key)."""

    # The CA that signed the engine pods' server certificates.
    ca_file: str
    # This client's certificate and key: the pods refuse a handshake without one.
    cert_file: str
    key_file: str
    # The name checked against the pod's certificate instead of the dialled
    # host (pods are dialled by IP; their certificate names a DNS name). None:
    # the host itself.
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.ca_file, "ca_file"),
            private_key=read_pem(self.key_file, "key_file"),
            certificate_chain=read_pem(self.cert_file, "cert_file"),
        )

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def ssl_context(self) -> ssl.SSLContext:
        """The same credentials for a plain socket (a decode pod's KV inbox)."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH,
                                             cadata=read_pem(self.ca_file, "ca_file").decode())
        context.load_cert_chain(self.cert_file, self.key_file)
        return context


def read_pem(path: str, what: str) -> bytes:
    """A PEM file's bytes; the error names the file, never its contents."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path}: {e.strerror or type(e).__name__}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what}: {path} is not a PEM file")
    return data


@dataclass(frozen=True)
class InternalClient:
    """How this process reaches engine pods: the token it sends and, when
    set, the TLS it speaks. Channels are cheap to make: one per pod."""

    # The deployment's internal secret; its token goes on every call.
    secret: InternalSecret
    # Mutual TLS to the pods; None: plaintext (the token alone authenticates).
    tls: InternalTLS | None = None

    def __post_init__(self) -> None:
        if self.tls is not None:
            self.tls.credentials()  # unreadable files fail now, not at the first call

    @classmethod
    def from_env(cls, tls: InternalTLS | None = None) -> InternalClient:
        """With the secret of this process's environment (benchmarks, tests)."""
        return cls(InternalSecret.require("engine pods answer only callers holding the internal secret"), tls)

    def aio_channel(self, address: str, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
        interceptors = _aio_interceptors(self.secret.metadata())
        options = [*options, *(self.tls.channel_options() if self.tls else [])]
        if self.tls is None:
            return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
        return grpc.aio.secure_channel(address, self.tls.credentials(), options=options, interceptors=interceptors)

    def channel(self, address: str, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
        """A blocking channel (scripts, tests)."""
        options = [*options, *(self.tls.channel_options() if self.tls else [])]
        if self.tls is None:
            plain = grpc.insecure_channel(address, options=options)
        else:
            plain = grpc.secure_channel(address, self.tls.credentials(), options=options)
        return grpc.intercept_channel(plain, _SyncAuth(self.secret.metadata()))


def _with_auth(metadata, auth: tuple[tuple[str, str], ...]) -> list[tuple[str, str]]:
    """The call's own metadata (trace context, ...) plus the token; a token
    the caller set is replaced, never sent twice."""
    keys = {key for key, _ in auth}
    return [*((k, v) for k, v in (metadata or ()) if k not in keys), *auth]


class _AioAuth:
    """Adds the token to a call's metadata. grpc.aio files an interceptor
    under its first matching kind only, hence one subclass per kind."""

    def __init__(self, auth: tuple[tuple[str, str], ...]) -> None:
        self._auth = auth

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return details._replace(metadata=grpc.aio.Metadata(*_with_auth(details.metadata, self._auth)))


class _AioUnaryUnary(_AioAuth, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _AioUnaryStream(_AioAuth, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _AioStreamUnary(_AioAuth, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _AioStreamStream(_AioAuth, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def _aio_interceptors(auth: tuple[tuple[str, str], ...]) -> list[_AioAuth]:
    return [kind(auth) for kind in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)]


@dataclass(frozen=True)
class _SyncCallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: list | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: object | None


class _SyncAuth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, auth: tuple[tuple[str, str], ...]) -> None:
        self._auth = auth

    def _details(self, d: grpc.ClientCallDetails) -> _SyncCallDetails:
        return _SyncCallDetails(d.method, d.timeout, _with_auth(d.metadata, self._auth), d.credentials,
                                getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)
