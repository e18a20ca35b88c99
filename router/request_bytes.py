"""Request bytes that are not the message they claim to be: INVALID_ARGUMENT and one log line.

grpc deserializes a request before any servicer code runs; a ``DecodeError`` there reached
clients as UNKNOWN and the log as a 7-line traceback per call. ``tolerant`` wraps a server
so the services registered through it decode leniently: bad bytes become a
``MalformedRequest`` that the wrapped method answers with INVALID_ARGUMENT, naming the
message type, without calling the servicer at all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class MalformedRequest:
    """Stands in for a request whose bytes did not decode."""

    message_type: str
    problem: str


class _TolerantServer:
    """Forwards service registration to ``server`` with every method handler made tolerant."""

    def __init__(self, server: grpc.aio.Server):
        self._server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        self._server.add_generic_rpc_handlers(tuple(_TolerantGenericHandler(h) for h in handlers))

    def add_registered_method_handlers(self, service_name: str, method_handlers: dict) -> None:
        tolerant_handlers = {name: tolerant_handler(name, h) for name, h in method_handlers.items()}
        self._server.add_registered_method_handlers(service_name, tolerant_handlers)


def tolerant(server: grpc.aio.Server) -> _TolerantServer:
    """What to pass to a generated ``add_*Servicer_to_server`` instead of the server itself."""
    return _TolerantServer(server)


class _TolerantGenericHandler(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler):
        self._inner = inner

    def service(self, handler_call_details):
        handler = self._inner.service(handler_call_details)
        return None if handler is None else tolerant_handler(handler_call_details.method, handler)


def tolerant_handler(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` with a deserializer that never raises and a behaviour that refuses bad bytes."""
    if handler.request_streaming or handler.request_deserializer is None:
        return handler  # none in this API; left as grpc made them
    deserialize = handler.request_deserializer
    message_type = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)
    type_name = message_type.full_name if message_type is not None else "request"

    def lenient_deserialize(data: bytes):
        try:
            return deserialize(data)
        except Exception as exc:  # DecodeError, or anything a broken message makes the parser raise
            return MalformedRequest(type_name, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)

    if handler.unary_stream is not None:
        behaviour = handler.unary_stream

        async def unary_stream(request, context):
            if isinstance(request, MalformedRequest):
                await _refuse(method, request, context)
            async for response in behaviour(request, context):
                yield response

        return handler._replace(request_deserializer=lenient_deserialize, unary_stream=unary_stream)
    behaviour = handler.unary_unary

    async def unary_unary(request, context):
        if isinstance(request, MalformedRequest):
            await _refuse(method, request, context)
        return await behaviour(request, context)

    return handler._replace(request_deserializer=lenient_deserialize, unary_unary=unary_unary)


async def _refuse(method: str, request: MalformedRequest, context: grpc.aio.ServicerContext) -> None:
    logger.warning("%s from %s: malformed %s (%s)", method, context.peer(), request.message_type, request.problem)
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT, f"request: the bytes are not a valid {request.message_type} ({request.problem})"
    )
