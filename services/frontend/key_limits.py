"""--max-concurrent-requests-per-key: one tenant may not fill the engines' queues.

A generation (HTTP or gRPC) holds one slot of its bearer token from arrival until its answer
ends, however it ends; one request is one slot whatever its ``n`` or batch size. Beyond the
limit it is refused at once (HTTP 429 with Retry-After, gRPC RESOURCE_EXHAUSTED). Slots are
keyed by the token sent, not the configured key, so several keys would each be bounded.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable, Iterable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

from services.frontend.openai_errors import ApiError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

FLAG = "--max-concurrent-requests-per-key"
REASON = "key_concurrency"  # the metric's label
RETRY_AFTER_S = 1  # a slot frees when any of the key's requests ends: soon, usually
GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/generate"})


class KeyBusy(Exception):
    """The key already has its limit of requests in flight."""


def bearer_token(header: str | bytes | None) -> bytes:
    """The token of an ``Authorization: Bearer <token>`` value (b"" for none)."""
    if not header:
        return b""
    raw = header.encode("utf-8", "replace") if isinstance(header, str) else header
    scheme, _, token = raw.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


class KeyConcurrency:
    """Requests in flight per bearer token; ``limit`` 0 counts nothing and refuses nothing."""

    def __init__(self, limit: int = 0, on_refused: Callable[[], None] | None = None) -> None:
        self.limit = limit
        self._on_refused = on_refused
        # sha256 of the token (never the secret) -> requests in flight; no zero entries, so
        # unchecked tokens cannot grow it past what is in flight.
        self._held: dict[bytes, int] = {}

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    @property
    def message(self) -> str:
        return (
            f"too many concurrent requests for this API key: at most {self.limit} may be in "
            f"flight ({FLAG}); retry when one ends"
        )

    def in_flight(self, token: bytes) -> int:
        return self._held.get(_digest(token), 0)

    @contextmanager
    def hold(self, token: bytes) -> Iterator[None]:
        """One slot of ``token`` for the ``with`` body; raises KeyBusy when none is free."""
        if not self.enabled:
            yield
            return
        key = _digest(token)
        if self._held.get(key, 0) >= self.limit:
            if self._on_refused is not None:
                self._on_refused()
            raise KeyBusy(self.message)
        self._held[key] = self._held.get(key, 0) + 1
        try:
            yield
        finally:
            left = self._held[key] - 1
            if left:
                self._held[key] = left
            else:
                del self._held[key]


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def metadata_token(metadata: Iterable[tuple[str, Any]] | None) -> bytes:
    return bearer_token(next((v for k, v in metadata or () if k == "authorization"), None))


class KeyConcurrencyLimit:
    """ASGI middleware: a generating route holds its key's slot until its answer is sent."""

    def __init__(self, app: App, limits: KeyConcurrency) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.limits.enabled or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] not in GENERATE_PATHS or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope.get("headers", []) if k == b"authorization"), None)
        try:
            with self.limits.hold(bearer_token(header)):
                await self.app(scope, receive, send)
        except KeyBusy as e:
            await _too_many(send, str(e))


async def _too_many(send: Send, message: str) -> None:
    body = json.dumps(ApiError(429, message).body()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode()),
    ]
    await send({"type": "http.response.start", "status": 429, "headers": headers})
    await send({"type": "http.response.body", "body": body})
