"""The frontend process: public gRPC (and OpenAI-compatible HTTP) in one asyncio loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

import grpc
from grpc_health.v1 import health, health_pb2

from services.common import tracing
from services.common.config import FrontendConfig
from services.common.curve import InsecureLink, InternalKeys, check_link, load_keys
from services.common.grpc_util import SERVER_OPTIONS, add_health_and_reflection, aset_serving, bind
from services.common.tls import ClientTls, server_credentials
from services.frontend.auth import ApiKeys
from services.frontend.chat_tools import ChatParsers
from services.frontend.engine_client import EngineClient
from services.frontend.engine_discovery import make_resolver
from services.frontend.grpc_parse import ParseRequests
from services.frontend.http_api import HttpServer, HttpTls
from services.frontend.key_limits import REASON, KeyConcurrency
from services.frontend.metrics import FrontendMetrics
from services.frontend.pipeline import Frontend
from services.frontend.router import RoutingParams
from services.frontend.server import SERVICE_NAME, add_generation_servicer
from services.frontend.tokenizer import Tokenizer

log = logging.getLogger("radixserve.frontend")

# SERVING while the process runs, whatever the engines do (readiness is "" and Generation).
LIVENESS_SERVICE = "liveness"


def model_id_of(cfg: FrontendConfig) -> str:
    return cfg.served_model_name or os.path.basename(os.path.normpath(cfg.model_path))


def internal_keys(cfg: FrontendConfig) -> InternalKeys | None:
    """The keys of the links to the engines; a tcp:// link needs them (or --insecure-internal)."""
    keys = load_keys(cfg.internal_keys_dir)
    addrs = [f"tcp://{cfg.engine_dns_name}"] if cfg.engine_dns_name else cfg.scheduler_addrs
    for addr in addrs:
        check_link(addr, keys, cfg.insecure_internal, "the engines' address")
    return keys


def routing_params(cfg: FrontendConfig) -> RoutingParams:
    return RoutingParams(
        policy=cfg.routing_policy,
        load_factor=cfg.routing_load_factor,
        balance_abs=cfg.routing_balance_abs_threshold,
        balance_rel=cfg.routing_balance_rel_threshold,
        min_match_tokens=cfg.routing_min_match_tokens,
        load_cost_tokens=cfg.routing_load_cost_tokens,
        hot_prefix_forks=cfg.routing_hot_prefix_forks,
    )


def chat_parsers(cfg: FrontendConfig, tokenizer: Tokenizer) -> ChatParsers:
    """--tool-call-parser (auto: from the template that renders tools) and --reasoning-parser."""
    template = None
    if tokenizer.hf.chat_template is not None:
        # A tokenizer may keep several named templates; this is the one tools render with.
        with contextlib.suppress(ValueError):  # several, none the default: chat fails anyway
            template = tokenizer.hf.get_chat_template(tools=[{}])
    parsers = ChatParsers.from_flags(cfg.tool_call_parser, cfg.reasoning_parser, template)
    tool = parsers.tool_parser.name if parsers.tool_parser else "none (tools are refused)"
    log.info("frontend: tool-call parser %s, reasoning parser %s", tool, cfg.reasoning_parser)
    return parsers


class FrontendServer:
    """Builds and runs the frontend; ``start`` binds (port 0 picks a free one), ``stop`` ends."""

    def __init__(self, cfg: FrontendConfig) -> None:
        self.cfg = cfg
        self.grpc_port = 0
        self.http_port = -1
        self._grpc: grpc.aio.Server | None = None
        self._http: HttpServer | None = None
        self._health = None
        self.engines: EngineClient | None = None
        self.key_limits = KeyConcurrency()  # --max-concurrent-requests-per-key, from start

    async def _on_engine_health(self, healthy: bool) -> None:
        await aset_serving(self._health, [SERVICE_NAME], healthy)

    async def start(self) -> None:
        cfg = self.cfg
        tokenizer = Tokenizer(cfg.model_path)
        keys = ApiKeys(cfg.api_key, cfg.admin_api_key, cfg.metrics_auth)
        # The key first (nothing of an unauthenticated call is parsed), then our parsing.
        interceptors = [keys.grpc_interceptor(), ParseRequests()]
        self._grpc = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
        self._health = add_health_and_reflection(self._grpc, [SERVICE_NAME])
        # NOT_SERVING until the engines answer (they may start after us).
        await aset_serving(self._health, [SERVICE_NAME], False)
        assert isinstance(self._health, health.aio.HealthServicer)  # an aio server's kind
        await self._health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        resolver = make_resolver(
            cfg.scheduler_addrs,
            cfg.scheduler_control_addrs,
            cfg.engine_dns_name,
            cfg.engine_zmq_port,
            cfg.engine_control_port,
            cfg.engine_resolve_interval,
            cfg.engine_dns_server,
        )
        metrics = FrontendMetrics(model_id_of(cfg))
        self.engines = EngineClient(
            resolver,
            cfg.max_model_len,
            on_health=self._on_engine_health,
            routing=routing_params(cfg),
            keys=internal_keys(cfg),
            metrics=metrics.routing,
            control_tls=ClientTls.of(cfg.control_ssl_ca_certs, cfg.control_ssl_server_name),
        )
        frontend = Frontend(tokenizer, self.engines, model_id_of(cfg), metrics)
        # One count per key across both doors: HTTP and gRPC requests share the limit.
        self.key_limits = key_limits = KeyConcurrency(
            cfg.max_concurrent_requests_per_key, on_refused=lambda: metrics.on_refused(REASON)
        )
        add_generation_servicer(self._grpc, frontend, key_limits)
        tls = server_credentials(cfg.ssl_certfile, cfg.ssl_keyfile, cfg.ssl_ca_certs)
        self.grpc_port = bind(self._grpc, cfg.host, cfg.port, "frontend gRPC (--port)", tls)
        await self._grpc.start()
        await self.engines.start()
        if cfg.http_port != -1:
            self._http = HttpServer(
                frontend,
                cfg.host,
                cfg.http_port,
                max_request_bytes=cfg.max_request_bytes,
                body_timeout_s=cfg.request_body_timeout,
                keys=keys,
                parsers=chat_parsers(cfg, tokenizer),
                tls=HttpTls(cfg.ssl_certfile, cfg.ssl_keyfile, cfg.ssl_ca_certs),
                key_limits=key_limits,
            )
            self.http_port = await self._http.start()
        http = f"{cfg.host}:{self.http_port}" if self._http else "off"
        extra = (
            f", metrics on {cfg.host}:{metrics.serve(cfg.host, cfg.metrics_port)}"
            if cfg.enable_metrics
            else ""
        )
        auth = "API key required" if keys.enabled else "no API key (--api-key)"
        if cfg.ssl_certfile:
            auth += ", TLS" + (" with client certificates" if cfg.ssl_ca_certs else "")
        log.info(
            "frontend: gRPC on %s:%d, HTTP on %s%s; %s",
            cfg.host,
            self.grpc_port,
            http,
            extra,
            auth,
        )

    async def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING and no new calls at once; running streams get ``grace_s`` to drain."""
        grace = self.cfg.shutdown_grace_period if grace_s is None else grace_s
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        drains = []
        if self._http is not None:
            drains.append(self._http.stop(grace))
        if self._grpc is not None:
            drains.append(self._grpc.stop(grace))
        await asyncio.gather(*drains)
        if self.engines is not None:
            await self.engines.close()


async def serve(cfg: FrontendConfig, stop: asyncio.Event) -> None:
    server = FrontendServer(cfg)
    try:
        await server.start()
        await stop.wait()
    finally:
        await server.stop()


async def _serve_until_signal(cfg: FrontendConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(cfg, stop)


def main(cfg: FrontendConfig) -> None:
    """Blocks serving the frontend; returns after SIGTERM or SIGINT."""
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    tracing.setup_tracing("radixserve-frontend", cfg.otlp_traces_endpoint)
    try:
        asyncio.run(_serve_until_signal(cfg))
    except InsecureLink as e:
        raise SystemExit(f"frontend: {e}") from None
    finally:
        tracing.shutdown()  # flush buffered spans
    log.info("frontend: stopped")
