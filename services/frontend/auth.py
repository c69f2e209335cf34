"""The API key of the public surface: HTTP routes and gRPC methods alike.

With ``--api-key`` set every request needs ``Authorization: Bearer <key>`` except health
probes: a route is open only when listed here, so a new one is protected by default. Admin
routes take ``--admin-api-key`` when set. The check is plain ASGI, so streams pass through
unbuffered (starlette's BaseHTTPMiddleware would buffer them).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from services.common.bearer import AioBearerInterceptor, MethodKeys, bearer_matches
from services.frontend.openai_errors import ApiError
from services.frontend.server import SERVICE_NAME

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

# Probes (the kubelet cannot send a key from a Secret) answer without one.
READY_PATHS = ("/health", "/healthz", "/ready", "/readyz", "/readiness")
LIVE_PATHS = ("/livez", "/live", "/liveness")
HEALTH_PATHS = frozenset(READY_PATHS + LIVE_PATHS)
ADMIN_PATHS = frozenset({"/flush_cache", "/abort_request"})  # it aborts others' requests
ADMIN_RPCS = frozenset({f"/{SERVICE_NAME}/FlushCache"})
METRICS_PATH = "/metrics"


@dataclass(frozen=True)
class ApiKeys:
    api_key: str = field(default="", repr=False)
    admin_api_key: str = field(default="", repr=False)
    # /metrics on the HTTP port takes the key too (when one is set).
    metrics_auth: bool = True

    @property
    def enabled(self) -> bool:
        return bool(self.api_key or self.admin_api_key)

    def key_for_path(self, path: str) -> str:
        """The key an HTTP path needs ("" for none)."""
        if path in HEALTH_PATHS or (path == METRICS_PATH and not self.metrics_auth):
            return ""
        if path in ADMIN_PATHS:
            return self.admin_api_key or self.api_key
        return self.api_key

    def grpc_interceptor(self) -> AioBearerInterceptor:
        return AioBearerInterceptor(MethodKeys(self.api_key, self.admin_api_key, ADMIN_RPCS))


class ApiKeyAuth:
    """ASGI middleware: 401 in OpenAI's error shape unless the request carries its path's key."""

    def __init__(self, app: App, keys: ApiKeys) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            key = self.keys.key_for_path(scope["path"])
            if key and not bearer_matches(_authorization(scope), key):
                if scope["type"] == "websocket":  # policy violation, before accepting
                    await send({"type": "websocket.close", "code": 1008})
                else:
                    await _unauthorized(send, _authorization(scope) is None)
                return
        await self.app(scope, receive, send)


def _authorization(scope: Scope) -> bytes | None:
    return next((v for k, v in scope.get("headers", []) if k == b"authorization"), None)


async def _unauthorized(send: Send, missing: bool) -> None:
    message = (
        "missing API key: send the header 'Authorization: Bearer <key>'"
        if missing
        else "invalid API key"
    )
    body_dict = ApiError(401, message).body()
    body_dict["error"]["code"] = "invalid_api_key"
    body = json.dumps(body_dict).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b"Bearer"),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})
