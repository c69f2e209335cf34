"""The storage tier's pages in a Redis-protocol server, shared by every engine using it.

    key    radixserve:kv:<32 hex digits>   write  SET key page NX [EX ttl] (pipelined)
    read   MGET of every key asked         clear  SCAN MATCH radixserve:kv:* + UNLINK

A failing server costs at most the socket timeout and counts as a miss; after a failed
connection calls fail at once for ``retry_after`` seconds, then it reconnects.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TypeVar, cast
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.worker.page_store import BackendError

log = logging.getLogger(__name__)

PREFIX = b"radixserve:kv:"
RETRY_AFTER = 1.0  # seconds a failed connection is not tried again
SCHEMES = ("redis", "rediss")
CLEAR_BATCH = 1000  # keys one SCAN step asks for and one UNLINK deletes

T = TypeVar("T")


def redacted(url: str) -> str:
    """The URL without its password (what the logs may show)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + host))


class RedisBackend:
    def __init__(
        self,
        url: str,
        ttl: int = 86400,
        timeout: float = 0.05,
        password: str = "",
        tls_ca: str = "",
        retry_after: float = RETRY_AFTER,
    ):
        scheme = urlsplit(url).scheme
        if scheme not in SCHEMES:
            raise ValueError(f"--hicache-storage-url must be redis:// or rediss://, not {scheme!r}")
        self.where = redacted(url)
        self.ttl = ttl
        self.retry_after = retry_after
        self._down_until = 0.0
        self._down = False
        tls = {"ssl_ca_certs": tls_ca} if tls_ca and scheme == "rediss" else {}
        self.client = redis.Redis.from_url(
            url,
            password=password or None,  # a password in the URL wins
            socket_connect_timeout=timeout,
            socket_timeout=timeout,  # per read of the socket: a large page still arrives
            retry=Retry(NoBackoff(), 0),  # one try; the down window below instead of retries
            health_check_interval=0,
            **tls,
        )

    def start(self) -> None:
        self._call("ping", self.client.ping)

    def get_many(self, keys: list[bytes]) -> Iterable[bytes | None]:
        if not keys:
            return []
        names = [PREFIX + k.hex().encode() for k in keys]
        return cast(list[bytes | None], self._call("read", lambda: self.client.mget(names)))

    def put_absent(self, pages: list[tuple[bytes, bytes]]) -> list[bool | OSError]:
        pipe = self.client.pipeline(transaction=False)
        for key, blob in pages:
            pipe.set(PREFIX + key.hex().encode(), blob, nx=True, ex=self.ttl or None)
        replies = self._call("write", lambda: pipe.execute(raise_on_error=False))
        return [_put_result(r) for r in replies]

    def delete(self, key: bytes) -> None:
        self._call("delete", lambda: self.client.unlink(PREFIX + key.hex().encode()))

    def clear(self) -> int:
        return self._call("clear", self._clear)

    def _clear(self) -> int:
        n, names = 0, []
        for name in self.client.scan_iter(match=PREFIX + b"*", count=CLEAR_BATCH):
            names.append(name)
            if len(names) == CLEAR_BATCH:
                n += self.client.unlink(*names)
                names = []
        return n + (self.client.unlink(*names) if names else 0)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """fn's answer; a redis error becomes a BackendError, and a failed connection marks
        the server down for retry_after seconds."""
        if self._down and time.monotonic() < self._down_until:
            wait = f"tried again {self.retry_after:g} s after a failure"
            raise BackendError("down", f"{self.where} is unreachable ({wait})")
        try:
            out = fn()
        except (redis.ConnectionError, redis.TimeoutError) as e:
            self._down, self._down_until = True, time.monotonic() + self.retry_after
            raise BackendError(type(e).__name__, f"{what} ({type(e).__name__}): {e}") from e
        except redis.RedisError as e:  # a reply: out of memory, wrong password, ...
            raise BackendError(type(e).__name__, f"{what} ({type(e).__name__}): {e}") from e
        if self._down:
            self._down = False
            log.info("storage tier: %s is reachable again", self.where)
        return out


def _put_result(reply: object) -> bool | OSError:
    """SET NX's reply: True (stored), None (the key was there), or the error it got."""
    if isinstance(reply, Exception):
        return BackendError(type(reply).__name__, f"write ({type(reply).__name__}): {reply}")
    return bool(reply)
