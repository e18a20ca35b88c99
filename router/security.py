"""Who may call the router: a bearer token on its services, TLS on its listeners.

With a token configured, every Generation and Admin call must carry the metadata
``authorization: Bearer <token>``; a call without it, or with another token, is answered
UNAUTHENTICATED before any servicer code runs. The health service stays open (load balancers
and orchestrators probe it without credentials) and so does reflection (it describes the API,
it serves nothing). TLS, when a certificate and key are given, covers both listeners.

Exposing the router beyond loopback without a token is refused where the configuration is
checked (``cluster/config.py``), unless the operator says so explicitly.
"""

from __future__ import annotations

import hmac
import ipaddress
import ssl
from pathlib import Path

import grpc

# Where clients (and ``pdserve up``, when no token file is configured) find the token.
AUTH_TOKEN_ENV = "PDSERVE_AUTH_TOKEN"
# A client's CA bundle for a router that serves TLS.
TLS_CA_ENV = "PDSERVE_TLS_CA"
# The name a client checks the router's certificate against, where the certificate covers no
# address the router is reached at (a DNS name, the router reached by its IP).
TLS_SERVER_NAME_ENV = "PDSERVE_TLS_SERVER_NAME"

_PROTECTED_SERVICES = ("/pdserve.v1.Generation/", "/pdserve.v1.Admin/")


def is_loopback(host: str) -> bool:
    """Whether a bind address keeps a listener on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


_REFUSAL = "missing or wrong bearer token: send the metadata 'authorization: Bearer <token>'"


class _TokenCheck:
    def __init__(self, token: str):
        if not token:
            raise ValueError("auth token: must not be empty")
        self._expected = f"Bearer {token}".encode()

    def lets_through(self, handler_call_details) -> bool:
        if not handler_call_details.method.startswith(_PROTECTED_SERVICES):
            return True
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(given, self._expected)  # constant time: no timing hint
        return False


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call to a protected service through only with the right bearer token."""

    def __init__(self, token: str):
        self._check = _TokenCheck(token)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or self._check.lets_through(handler_call_details):
            return handler

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)

        async def refuse_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)
            yield  # an async generator, as a streaming handler must be

        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(refuse_stream)
        return grpc.unary_unary_rpc_method_handler(refuse)


def server_credentials(cert_file: Path, key_file: Path) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(Path(key_file).read_bytes(), Path(cert_file).read_bytes())])


def server_ssl_context(cert_file: Path, key_file: Path) -> ssl.SSLContext:
    """The same certificate for the HTTP (OpenAI) listener."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(cert_file), str(key_file))
    return context


class _BearerTokenMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the bearer token to every call of a (synchronous) client channel."""

    def __init__(self, token: str):
        self._header = ("authorization", f"Bearer {token}")

    def _with_token(self, details):
        # grpc hands interceptors its call details as a namedtuple.
        return details._replace(metadata=[*(details.metadata or ()), self._header])

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)


def client_channel(address: str, token: str | None = None, ca_file: Path | None = None, server_name: str | None = None) -> grpc.Channel:
    """A channel to the router that presents ``token`` and, with ``ca_file``, speaks TLS,
    checking the certificate against ``server_name`` where given (else the address's host)."""
    if ca_file is not None:
        options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(Path(ca_file).read_bytes()), options=options)
    else:
        channel = grpc.insecure_channel(address)
    return grpc.intercept_channel(channel, _BearerTokenMetadata(token)) if token else channel


def client_token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata an async client adds to each call (grpc.aio channels take it per call)."""
    return (("authorization", f"Bearer {token}"),) if token else ()
