"""Bounds on what an HTTP client may send, enforced before any route runs.

An ASGI middleware buffers the body up to ``max_bytes`` (else 413) within ``timeout_s``
(else 408), so one hostile client costs at most that much memory and connection time.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from services.frontend.openai_errors import ApiError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class BodyLimit:
    def __init__(self, app: App, max_bytes: int, timeout_s: float):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        try:
            self._check_length(scope)
            body = await self._read(receive)
        except _Refused as e:
            await _answer(send, e.status, e.message)
            return
        await self.app(scope, _replay(body, receive), send)

    def _check_length(self, scope: Scope) -> None:
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                raise _Refused(413, self._too_large(int(value)))

    async def _read(self, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size, deadline = 0, time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), timeout=max(left, 0.001))
            except TimeoutError:
                raise _Refused(
                    408, f"request body not received within {self.timeout_s:g} s"
                ) from None
            if message["type"] == "http.disconnect":
                raise _Refused(400, "client disconnected while sending the body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _Refused(413, self._too_large(size))
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self, size: int) -> str:
        return (
            f"request body of {size} bytes or more exceeds the limit of {self.max_bytes} "
            "bytes (--max-request-bytes)"
        )


def _replay(body: bytes, receive: Receive) -> Receive:
    """The buffered body as one message; later calls wait for the client's disconnect."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _answer(send: Send, status: int, message: str) -> None:
    body = json.dumps(ApiError(status, message).body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
