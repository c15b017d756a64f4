"""Who may call an engine pod: holders of the deployment's internal token
(tessera/internal_secret.py), and under mutual TLS only those whose client
certificate the pod's client CA signed.

A pod's KV cache holds every tenant's prompts: a caller that merely reaches
the port must learn nothing from GetLoad (which blocks are cached) nor
Generate (cached tokens). Every method needs the token except the standard
health service, which kubelet probes call without credentials and which
tells only SERVING / NOT_SERVING. The check is an allow-list: a service
added later is closed until listed here.
"""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health

from tessera.internal_channel import InternalTLS, read_pem
from tessera.internal_secret import AUTH_METADATA_KEY, InternalSecret

logger = logging.getLogger(__name__)

OPEN_SERVICES = frozenset({health.SERVICE_NAME})

_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}
MISSING = ("missing internal credential: engine pods serve only the gateway and their peers, "
           "which send the deployment's internal token as `authorization: Bearer` metadata")
REFUSED = "internal credential refused: not this deployment's internal token"


def _service(method: str) -> str:
    """The service of a method path: /grpc.health.v1.Health/Check -> grpc.health.v1.Health."""
    return method.lstrip("/").split("/", 1)[0]


class InternalAuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for every call without this deployment's token, but
    to the open services."""

    def __init__(self, secret: InternalSecret) -> None:
        self._secret = secret

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or _service(handler_call_details.method) in OPEN_SERVICES:
            return handler  # an unknown method gets UNIMPLEMENTED either way
        presented = _authorization(handler_call_details.invocation_metadata)
        if self._secret.accepts(presented):
            return handler
        message = MISSING if presented is None else REFUSED
        logger.info("refused %s: %s", handler_call_details.method, "no credential" if presented is None else
                    "wrong credential")
        return _refusal(handler, message)


def _authorization(metadata) -> str | None:
    for key, value in metadata or ():
        if key == AUTH_METADATA_KEY:
            return value
    return None


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that only refuses."""
    async def refuse(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    make = _HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)]
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


@dataclass(frozen=True)
class ServerTLS:
    """Mutual TLS on the pod's gRPC port (PEM files; cert-manager's
    kubernetes.io/tls Secret mounts them as tls.crt, tls.key, ca.crt)."""

    cert_file: str
    """The pod's certificate (its chain), PEM (--tls-cert-file)."""
    key_file: str
    """The certificate's private key, PEM (--tls-key-file)."""
    client_ca_file: str
    """The CA whose signature a client certificate must carry: a client
    without one fails the handshake (--tls-client-ca-file)."""

    @classmethod
    def from_flags(cls, cert_file: str | None, key_file: str | None, client_ca_file: str | None) -> ServerTLS | None:
        """None when no flag is given; all three or an error naming the missing ones."""
        given = {"--tls-cert-file": cert_file, "--tls-key-file": key_file, "--tls-client-ca-file": client_ca_file}
        missing = [flag for flag, value in given.items() if not value]
        if len(missing) == len(given):
            return None
        if missing:
            raise ValueError(f"mutual TLS needs all of --tls-cert-file, --tls-key-file and --tls-client-ca-file; "
                             f"missing {', '.join(missing)}")
        return cls(cert_file, key_file, client_ca_file)

    def as_client(self, server_name: str | None) -> InternalTLS:
        """How this pod dials a peer pod of its deployment: its own certificate
        as the client's, the peer's checked against the same CA."""
        return InternalTLS(self.client_ca_file, self.cert_file, self.key_file, server_name)

    def ssl_context(self) -> ssl.SSLContext:
        """The same mutual TLS for a plain socket (the KV inbox): a client
        certificate signed by the client CA or no handshake."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH,
                                             cadata=read_pem(self.client_ca_file, "--tls-client-ca-file").decode())
        context.load_cert_chain(self.cert_file, self.key_file)
        context.verify_mode = ssl.CERT_REQUIRED
        return context

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(read_pem(self.key_file, "--tls-key-file"), read_pem(self.cert_file, "--tls-cert-file"))],
            root_certificates=read_pem(self.client_ca_file, "--tls-client-ca-file"),
            require_client_auth=True,
        )
