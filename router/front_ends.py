"""The wire front ends of one router core, started and stopped together: the gRPC listeners
(Generation with health and reflection; Admin on its own) and the OpenAI HTTP API.

Whoever hosts a router (cluster/deployment.py, the controller, a router replica) builds the
core (router/core.py) and starts its front ends here. Replicas of the router listen on the same
ports with SO_REUSEPORT, so the kernel spreads connections over them; Admin, which scales the
pools, is served by the replica that manages them only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from router.addresses import host_port
from router.core import Router
from router.grpc_api import GrpcFrontEnd
from router.openai_api.chat_format import ChatFormat
from router.openai_api.server import OpenAIServer
from router.security import server_ssl_context

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ListenPorts:
    """Ports a front end binds (None: the router config's own; the HTTP API off if it is off)."""

    grpc: int | None = None
    http: int | None = None


class FrontEnds:
    def __init__(self, router: Router, reuse_port: bool = False, admin: bool = True):
        self.router = router
        self.reuse_port = reuse_port
        # The chat template and parsers, loaded once: gRPC's ChatPrompt and the HTTP APIs share them.
        self.chat = ChatFormat.of(router)
        self.grpc = GrpcFrontEnd(router, reuse_port=reuse_port, admin=admin, chat=self.chat)
        self.http: OpenAIServer | None = None

    @property
    def port(self) -> int | None:
        return self.grpc.port

    @property
    def admin_port(self) -> int | None:
        return self.grpc.admin_port

    @property
    def admin_server(self):
        return self.grpc.admin_server

    @property
    def http_port(self) -> int | None:
        return None if self.http is None else self.http.port

    async def start(self, ports: ListenPorts | None = None) -> int:
        """Start every configured listener; return the gRPC port."""
        ports = ports or ListenPorts()
        config = self.router.config
        await self.grpc.start(ports.grpc)
        if config.http_port is not None:
            names = config.served_model_names or [self.router.model_info.name]
            ssl_context = None
            if config.tls_cert_file is not None:
                ssl_context = server_ssl_context(config.tls_cert_file, config.tls_key_file)
            port = config.http_port if ports.http is None else ports.http
            # vLLM answers to the model as it was started (its path); so does pdserve, beside its names.
            aliases = [str(self.router.model_dir), str(self.router.model_dir.resolve())]
            self.http = OpenAIServer(
                self.router, config.http_host, port, names, config.auth_token, ssl_context, reuse_port=self.reuse_port, model_aliases=aliases, chat=self.chat,
            )
            await self.http.start()
            # A router process that starts (again) runs what its earlier life left in progress.
            await self.http.resume_background_responses()
        logger.info(
            "router listening on %s (%s; %s, %s)", host_port(config.host, self.port),
            "ready" if self.router.readiness.is_ready else "not ready yet",
            "bearer token required" if config.auth_token else "no authentication",
            "TLS" if config.tls_cert_file else "plaintext",
        )
        return self.port

    async def stop(self, grace_s: float = 1.0) -> None:
        if self.http is not None:
            await self.http.stop()
        await self.grpc.stop(grace_s)
