"""ZeroMQ wrapped once: sockets that carry protobuf messages, one message per frame, no pickle.

Frontend DEALER -> scheduler ROUTER -> (DEALER) worker ROUTER; frontend SUB -> scheduler PUB
(CacheEvents). ``ipc://`` per instance by default, ``tcp://`` in pods.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import zmq
import zmq.asyncio
from google.protobuf.message import DecodeError, Message

from services.common.hostport import zmq_endpoint

M = TypeVar("M", bound=Message)
log = logging.getLogger(__name__)

# A frame larger than this makes libzmq drop the peer's connection before anything is
# parsed (the largest real message, a ForwardBatch of a full prefill, is a few MB).
MAX_FRAME_BYTES = 256 << 20


class BadFrame(ValueError):
    """What a peer sent is not one well-formed message of the expected type."""


class DropLog:
    """Counts dropped frames, logging once per ``every_s`` (garbage must not flood the log)."""

    def __init__(self, socket_name: str, every_s: float = 10.0):
        self.socket_name, self.every_s = socket_name, every_s
        self.dropped = 0
        self._last_log = -float("inf")

    def note(self, reason: object) -> None:
        self.dropped += 1
        now = time.monotonic()
        if now - self._last_log >= self.every_s:
            self._last_log = now
            log.warning(
                "%s: dropped a malformed frame (%s); %d dropped so far",
                self.socket_name,
                reason,
                self.dropped,
            )


def private_ipc_dir() -> str:
    """This user's folder for ipc sockets: created 0700; an existing one must be ours and
    closed to others, or another local user could plant or read our sockets."""
    folder = os.path.join(tempfile.gettempdir(), f"radixserve-{os.getuid()}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise PermissionError(f"{folder} is not a directory owned by uid {os.getuid()}; refusing")
    if info.st_mode & 0o077:
        raise PermissionError(
            f"{folder} is open to other users (mode {stat.S_IMODE(info.st_mode):o}); "
            "refusing to put sockets there (chmod 700 it or remove it)"
        )
    return folder


def new_ipc_addr(name: str) -> str:
    """A fresh per-instance ipc:// address, so two servers can share a machine."""
    folder = private_ipc_dir()
    return f"ipc://{folder}/{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"


def endpoint(sock: zmq.Socket, addr: str) -> str:
    """``addr`` ready for ``sock`` to bind or connect: an IPv6 host bracketed and the
    socket's IPv6 option on (libzmq refuses IPv6 addresses without it)."""
    addr = zmq_endpoint(addr)
    if "://[" in addr:
        sock.setsockopt(zmq.IPV6, 1)
    return addr


def _configure(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    # Unbounded queues: backpressure is the scheduler's job (admission), not the socket's.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)


def dealer(
    ctx: zmq.Context,
    addr: str,
    identity: bytes | None = None,
    setup: Callable[[zmq.Socket], None] | None = None,
) -> zmq.Socket:
    """``setup`` (CURVE keys, services/common/curve.py) runs before the socket connects."""
    sock = ctx.socket(zmq.DEALER)
    _configure(sock)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity)
    if setup is not None:
        setup(sock)
    sock.connect(endpoint(sock, addr))
    return sock


def router(
    ctx: zmq.Context, addr: str, setup: Callable[[zmq.Socket], None] | None = None
) -> zmq.Socket:
    """``setup`` (CURVE keys and ZAP, services/common/curve.py) runs before the socket binds."""
    sock = ctx.socket(zmq.ROUTER)
    _configure(sock)
    if setup is not None:
        setup(sock)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    # Fail loudly instead of dropping a reply to a peer that went away.
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.bind(endpoint(sock, addr))
    return sock


def subscriber(
    ctx: zmq.Context,
    addr: str,
    setup: Callable[[zmq.Socket], None] | None = None,
    max_queued: int = 10_000,
) -> zmq.Socket:
    """A SUB socket for everything published at ``addr``, its queue bounded (``max_queued``):
    the stream resyncs from a snapshot, so a slow reader drops (seen in sequence numbers)."""
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, max_queued)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    addr = endpoint(sock, addr)
    if setup is not None:
        setup(sock)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(addr)
    return sock


def decode(cls: type[M], payload: bytes) -> M:
    """Parses one message; BadFrame (never another exception) when it is not one."""
    msg = cls()
    try:
        msg.ParseFromString(payload)
    except (DecodeError, RuntimeError, ValueError) as e:  # protobuf's C and Python parsers
        raise BadFrame(f"not a {cls.__name__}: {e}") from e
    return msg


def send(sock: zmq.Socket, msg: Message, identity: bytes | None = None, flags: int = 0):
    """Sends on a DEALER (no identity) or a ROUTER (to ``identity``). Awaitable on async sockets."""
    payload = msg.SerializeToString()
    if identity is None:
        return sock.send(payload, flags=flags, copy=False)
    return sock.send_multipart([identity, payload], flags=flags, copy=False)


def recv(sock: zmq.Socket, cls: type[M], flags: int = 0) -> M:
    """Receives one message on a synchronous DEALER."""
    return decode(cls, sock.recv(flags=flags))


def recv_routed(sock: zmq.Socket, cls: type[M], flags: int = 0) -> tuple[bytes, M]:
    """(identity, message) from a synchronous ROUTER; BadFrame unless exactly those two."""
    frames = sock.recv_multipart(flags=flags)
    if len(frames) != 2:
        raise BadFrame(f"{len(frames)} frames, expected identity + one message")
    identity, payload = frames
    return identity, decode(cls, payload)


async def arecv(sock: zmq.asyncio.Socket, cls: type[M]) -> M:
    """Receives one message on an asyncio DEALER."""
    return decode(cls, await sock.recv())


def pack_i32(values) -> bytes:
    """Integers as the little-endian int32 bytes that bulk proto fields carry."""
    return np.asarray(values, dtype="<i4").tobytes()


def unpack_i32(payload: bytes):
    """The inverse of pack_i32: a read-only int32 numpy array over the bytes (no copy)."""
    return np.frombuffer(payload, dtype="<i4")
