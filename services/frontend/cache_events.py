"""Following one engine's CacheEvents stream (ZeroMQ SUB) into its CacheIndex.

The protocol (seq, heartbeats, snapshots on connect, restart or gap) is in docs/routing.md.
Messages that arrive while a snapshot is asked wait in the socket's queue, so none is lost
and none applies twice. Every frame is parsed and checked; a malformed one is counted and
ignored.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from radixserve.internal.v1 import engine_pb2
from services.common import transport
from services.common.curve import SocketSetup
from services.common.page_keys import KEY_BYTES
from services.frontend.cache_index import CacheIndex

log = logging.getLogger(__name__)

EVENTS_SILENT_S = 5.0
RESYNC_RETRY_S = 1.0
SNAPSHOT_TIMEOUT_S = 5.0
POLL_MS = 250

# Why a snapshot was asked (the resync counter's label).
RESYNC_REASONS = ("connect", "restart", "gap")

Snapshot = Callable[[], Awaitable[engine_pb2.CacheEvents]]


def check_events(msg: engine_pb2.CacheEvents) -> None:
    """BadFrame unless the message can be applied: whole keys, and a geometry with them."""
    for name in ("stored", "removed"):
        if len(getattr(msg, name)) % KEY_BYTES:
            raise transport.BadFrame(f"{name} is not a whole number of {KEY_BYTES}-byte keys")
    if msg.block_tokens <= 0 and (msg.stored or msg.removed or msg.snapshot):
        raise transport.BadFrame(f"block_tokens {msg.block_tokens} with keys")


def host_of(control_addr: str) -> str:
    """The host part of a gRPC "host:port" address ("[v6]" keeps its brackets)."""
    return control_addr.rpartition(":")[0]


class EventFollower:
    """The stream's bookkeeping, without sockets; ``wanted``: why a snapshot is needed, or None."""

    def __init__(self, index: CacheIndex, on_load: Callable[[int], None] | None = None) -> None:
        self.index = index
        self.on_load = on_load
        self.instance: str | None = None
        self.seq = 0
        self.synced = False
        self.wanted: str | None = "connect"

    def on_message(self, msg: engine_pb2.CacheEvents) -> None:
        """One checked message of the stream (check_events)."""
        if self.on_load is not None and msg.HasField("num_requests"):
            self.on_load(msg.num_requests)
        index = self.index
        regeared = msg.block_tokens and (msg.block_tokens, msg.seed) != (
            index.block_tokens,
            index.seed,
        )
        if msg.instance_id != self.instance or (self.synced and regeared):
            restarted = self.instance is not None
            index.clear()
            self.instance, self.synced = msg.instance_id, False
            self.wanted = "restart" if restarted else "connect"
            return
        if not self.synced or msg.seq <= self.seq:
            return  # waiting for the snapshot, which holds this; or a heartbeat
        # A heartbeat past our seq says the message of that seq was lost: a gap too.
        changes = msg.cleared or msg.stored or msg.removed
        if msg.seq > self.seq + 1 or not changes:
            self.synced, self.wanted = False, "gap"  # the index stays, nearly right, till then
            return
        index.apply(msg.cleared, msg.stored, msg.removed)
        self.seq = msg.seq

    def on_snapshot(self, snap: engine_pb2.CacheEvents) -> None:
        """The whole tree at ``snap.seq`` (checked): the index becomes it."""
        if snap.instance_id != self.instance:
            self.index.clear()  # another process than the one we followed: nothing pending
        self.index.replace(snap.block_tokens, snap.seed, snap.stored)
        self.instance, self.seq = snap.instance_id, snap.seq
        self.synced, self.wanted = True, None

    def forget(self) -> None:
        """The stream fell silent: nothing is known until it speaks again."""
        self.index.clear()
        self.instance, self.synced, self.wanted = None, False, None


class CacheSubscriber:
    """A SUB socket on one engine's CacheEvents and the task that follows it."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        addr: str,
        index: CacheIndex,
        snapshot: Snapshot,
        setup: SocketSetup | None = None,
        name: str = "",
        on_resync: Callable[[str], None] | None = None,
        on_load: Callable[[int], None] | None = None,
    ) -> None:
        self.addr, self.name = addr, name
        self.follower = EventFollower(index, on_load)
        self.drops = transport.DropLog(f"cache events of engine {name}")
        self.resyncs = 0
        self._snapshot, self._on_resync = snapshot, on_resync
        self._failing = False
        sock = transport.subscriber(ctx, addr, setup)
        assert isinstance(sock, zmq.asyncio.Socket)  # an asyncio context makes asyncio sockets
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._run())

    def close(self) -> None:
        """Stops following (the index is the caller's to clear)."""
        self._task.cancel()
        self._sock.close(linger=0)

    async def _run(self) -> None:
        follower = self.follower
        next_try = heard = time.monotonic()
        while True:
            if follower.wanted and time.monotonic() >= next_try:
                if not await self._resync():
                    next_try = time.monotonic() + RESYNC_RETRY_S
            if await self._sock.poll(POLL_MS):
                self.on_frames(await self._sock.recv_multipart())
                heard = time.monotonic()
            elif follower.instance is not None and time.monotonic() - heard > EVENTS_SILENT_S:
                log.warning(
                    "engine %s: no cache events for %.0f s; its index is dropped until they resume",
                    self.name,
                    EVENTS_SILENT_S,
                )
                follower.forget()

    def on_frames(self, frames: list[bytes]) -> None:
        """One message off the socket: applied, or counted and ignored when malformed."""
        if len(frames) != 1:
            self.drops.note(f"{len(frames)} frames, expected one CacheEvents")
            return
        try:
            msg = transport.decode(engine_pb2.CacheEvents, frames[0])
            check_events(msg)
        except transport.BadFrame as e:
            self.drops.note(e)
            return
        self.follower.on_message(msg)

    async def _resync(self) -> bool:
        reason = self.follower.wanted or "connect"
        try:
            snap = await self._snapshot()
            check_events(snap)
            if snap.block_tokens <= 0:
                raise transport.BadFrame("a snapshot without block_tokens")
        except Exception as e:  # an engine without the RPC, a timeout, a bad answer
            level = logging.DEBUG if self._failing else logging.WARNING
            log.log(level, "engine %s: cache snapshot failed (%r); retrying", self.name, e)
            self._failing = True
            return False
        self._failing = False
        self.follower.on_snapshot(snap)
        self.resyncs += 1
        if self._on_resync is not None:
            self._on_resync(reason)
        log.debug(
            "engine %s: cache snapshot (%s) at seq %d, %d keys",
            self.name,
            reason,
            snap.seq,
            len(self.follower.index),
        )
        return True
