"""The standard gRPC extras every radixserve server carries: health checking and reflection.

Works for both ``grpc.server`` (scheduler, worker) and ``grpc.aio.server`` (frontend). The
health servicer kind follows the server kind, because the synchronous servicer blocks on
threading conditions, which would stall an asyncio event loop.

    health = add_health_and_reflection(server, ["radixserve.v1.Generation"])
    set_serving(health, ["radixserve.v1.Generation"], True)          # grpc.server
    await aset_serving(health, ["radixserve.v1.Generation"], True)   # grpc.aio.server
"""

from __future__ import annotations

from typing import TypeAlias

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.hostport import host_port

HealthServicer: TypeAlias = health.HealthServicer | health.aio.HealthServicer

# Messages larger than this are refused with RESOURCE_EXHAUSTED before they are parsed (a
# 128k-token prompt as ids is ~0.7 MB); stated rather than left to grpc's default.
MAX_MESSAGE_BYTES = 16 << 20
# Every server: a port already bound fails instead of being silently shared (grpc enables
# SO_REUSEPORT by default, so a second server on a port took a share of its connections).
SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Liveness, apart from readiness ("" and the application services): SERVING while the
# process runs, whatever its peers do, so an orchestrator restarts only a process that hangs
# or died, never one whose peer is down (the chart's liveness probes ask this name).
LIVENESS_SERVICE = "liveness"
# How a scheduler's GetStats refusal starts while it drains after SIGTERM: frontends send it
# nothing new but keep what runs there (unlike UNAVAILABLE: gone, its requests failed).
DRAINING = "draining"


def add_health_and_reflection(server, service_names: list[str]) -> HealthServicer:
    """Registers grpc.health.v1 and server reflection on ``server``; returns the health servicer.

    ``service_names`` are the full names of the application services (e.g.
    ``generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name``). A synchronous
    server starts SERVING for "" and every name; an aio server starts with only "" SERVING
    (the aio servicer's setter is a coroutine): call ``aset_serving`` once the loop runs.
    """
    is_aio = isinstance(server, grpc.aio.Server)
    servicer = health.aio.HealthServicer() if is_aio else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    if not is_aio:
        set_serving(servicer, service_names, True)
        servicer.set(LIVENESS_SERVICE, _SERVING)
    return servicer


def _statuses(service_names: list[str], serving: bool):
    status = _SERVING if serving else _NOT_SERVING
    return [(name, status) for name in ["", *service_names]]


def set_serving(servicer: health.HealthServicer, service_names: list[str], serving: bool) -> None:
    """Sets "" and every name to SERVING or NOT_SERVING (synchronous servicer)."""
    for name, status in _statuses(service_names, serving):
        servicer.set(name, status)


async def aset_serving(
    servicer: health.aio.HealthServicer, service_names: list[str], serving: bool
) -> None:
    """Sets "" and every name to SERVING or NOT_SERVING (aio servicer)."""
    for name, status in _statuses(service_names, serving):
        await servicer.set(name, status)


def bind(
    server, host: str, port: int, what: str, credentials: grpc.ServerCredentials | None = None
) -> int:
    """add_insecure_port (add_secure_port with ``credentials``: TLS) that fails loudly,
    naming the port: the bound port (port 0: a free one). ``server`` must have been made
    with SERVER_OPTIONS (no port sharing)."""
    addr = host_port(host, port)
    try:
        if credentials is None:
            bound = server.add_insecure_port(addr)
        else:
            bound = server.add_secure_port(addr, credentials)
    except RuntimeError as e:  # grpc raises instead of returning 0 in some versions
        raise OSError(f"{what}: cannot bind {host}:{port} ({e}); is the port in use?") from e
    if not bound:
        raise OSError(f"{what}: cannot bind {host}:{port}; is the port in use?")
    return bound
