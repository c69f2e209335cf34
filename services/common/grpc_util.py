"""Health checking and reflection for every server, ``grpc.server`` and ``grpc.aio.server``.

The servicer's kind follows the server's: the synchronous one would stall an event loop.
"""

from __future__ import annotations

from typing import TypeAlias

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.hostport import host_port

HealthServicer: TypeAlias = health.HealthServicer | health.aio.HealthServicer

# Larger messages are refused (RESOURCE_EXHAUSTED) before they are parsed.
MAX_MESSAGE_BYTES = 16 << 20
# A port already bound fails instead of being shared (grpc enables SO_REUSEPORT by default).
SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Liveness, apart from readiness: SERVING while the process runs whatever its peers do, so
# an orchestrator restarts only a hung or dead process, never one whose peer is down.
LIVENESS_SERVICE = "liveness"
# Starts a draining scheduler's GetStats refusal: send it nothing new, keep what runs there.
DRAINING = "draining"


def add_health_and_reflection(server, service_names: list[str]) -> HealthServicer:
    """Registers health and reflection; returns the servicer. A sync server starts SERVING for
    "" and ``service_names``, an aio one for "" only: call ``aset_serving`` in the loop."""
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
    """Binds (TLS with ``credentials``) and returns the bound port (0: a free one); OSError
    naming the port on failure. ``server`` must use SERVER_OPTIONS (no port sharing)."""
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
