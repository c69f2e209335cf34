"""HTTP bodies are bounded in size (413) and in time (408) before any route parses them."""

import asyncio
import json

from services.frontend.http_limits import BodyLimit


class Recorder:
    def __init__(self):
        self.messages, self.app_body = [], None

    async def send(self, message):
        self.messages.append(message)

    async def app(self, scope, receive, send):
        self.app_body = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    def status(self):
        return self.messages[0]["status"]

    def error(self):
        return json.loads(self.messages[1]["body"])["error"]


def _scope(length=None):
    headers = [] if length is None else [(b"content-length", str(length).encode())]
    return {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}


def _chunks(*parts, stall_after=None):
    queue = list(parts)

    async def receive():
        if not queue:
            await asyncio.sleep(3600)  # a client that stopped sending
        chunk = queue.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(queue) or stall_after}

    return receive


def _run(scope, receive, max_bytes=100, timeout_s=5.0):
    rec = Recorder()
    asyncio.run(BodyLimit(rec.app, max_bytes, timeout_s)(scope, receive, rec.send))
    return rec


def test_body_within_limits_reaches_the_app_whole():
    rec = _run(_scope(), _chunks(b'{"a":', b" 1}"))
    assert rec.status() == 200 and rec.app_body == b'{"a": 1}'


def test_declared_length_over_the_limit_is_refused_unread():
    async def never():
        raise AssertionError("the body must not be read")

    rec = _run(_scope(length=10**9), never)
    assert rec.status() == 413 and rec.app_body is None
    assert "limit of 100 bytes" in rec.error()["message"]
    assert "--max-request-bytes" in rec.error()["message"]


def test_streamed_body_over_the_limit_is_refused():
    rec = _run(_scope(), _chunks(b"x" * 60, b"y" * 60))
    assert rec.status() == 413 and rec.app_body is None
    assert rec.error()["type"] == "invalid_request_error"


def test_half_sent_body_times_out():
    rec = _run(_scope(), _chunks(b'{"prompt": "', stall_after=True), timeout_s=0.2)
    assert rec.status() == 408 and "0.2 s" in rec.error()["message"]
