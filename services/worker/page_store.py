"""The storage tier of the hierarchical cache: KV pages kept by a backend, one value a page.

A page's 16-byte key is hashed by the scheduler from the namespace and every token up to
the page's end, so anyone computing the same tokens finds it again. A header and checksum
make a reader take a whole page of its own layout or none. Any backend failure is logged
once per kind, counted, and read as a miss: serving goes on. Writes run on their own thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import signal
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from services.worker.kv_pool import KVShape

log = logging.getLogger(__name__)

MAGIC = b"RXKVPG01"
KEY_BYTES = 16
# magic, key, layers, kv heads, head dim, tokens, dtype name (16 bytes), payload checksum
_HEADER = struct.Struct(f"<8s{KEY_BYTES}sIIII16s{KEY_BYTES}s")
WRITE_BACKLOG = 256  # pages queued for the writer beyond which new ones are dropped
WRITE_BATCH = 32  # queued pages the writer hands the backend at once (one round trip)


class BackendError(OSError):
    """A backend failure that is no OS error; ``kind`` names it in the once-per-kind log."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _kind(e: OSError) -> str:
    return getattr(e, "kind", None) or str(e.errno)


class PageBackend(Protocol):
    """Where the pages' bytes live. Each call may raise OSError (BackendError included):
    the store counts it as misses or failures, never lets it out."""

    where: str  # what the log names (a folder, a URL without its password)

    def start(self) -> None:
        """Opens the backend once (a folder made, a server asked); failing is logged."""

    def get_many(self, keys: list[bytes]) -> Iterable[bytes | None]:
        """The values of keys in order (None: absent); may be lazy."""
        ...

    def put_absent(self, pages: list[tuple[bytes, bytes]]) -> list[bool | OSError]:
        """Stores each page unless present; per page True, False (present) or the error."""
        ...

    def delete(self, key: bytes) -> None: ...

    def clear(self) -> int:
        """Deletes every page of this store; how many."""
        ...


class DirectoryBackend:
    """Pages as files ``root/ab/abcd....kv``: written to a temporary name and renamed, so
    two engines writing one page leave one whole page and a reader never sees half."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.where = str(self.root)
        if threading.current_thread() is threading.main_thread():
            # Past RLIMIT_FSIZE a write then fails (EFBIG) instead of killing the worker.
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def path(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / f"{name}.kv"

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def get_many(self, keys: list[bytes]) -> Iterable[bytes | None]:
        for key in keys:  # lazily: a file after the first bad one is never read
            try:
                yield self.path(key).read_bytes()
            except FileNotFoundError:
                yield None

    def put_absent(self, pages: list[tuple[bytes, bytes]]) -> list[bool | OSError]:
        return [self._put(key, blob) for key, blob in pages]

    def _put(self, key: bytes, blob: bytes) -> bool | OSError:
        path = self.path(key)
        with contextlib.suppress(OSError):
            if path.exists():
                return False
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)  # atomic: two engines writing one page leave one whole
        except OSError as e:
            with contextlib.suppress(OSError):  # the folder itself may be what is wrong
                tmp.unlink(missing_ok=True)
            return e
        return True

    def delete(self, key: bytes) -> None:
        self.path(key).unlink(missing_ok=True)

    def clear(self) -> int:
        n = 0
        for path in self.root.glob("*/*.kv"):
            path.unlink(missing_ok=True)
            n += 1
        return n


@dataclass
class StoreCounters:
    pages_written: int = 0
    pages_read: int = 0
    misses: int = 0
    write_failures: int = 0  # disk or server full, unwritable, unreachable, backlog full
    corrupt_pages: int = 0  # read back wrong (truncated, checksum, another layout): deleted
    bytes_written: int = 0
    bytes_read: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0


def split_keys(raw: bytes) -> list[bytes]:
    if len(raw) % KEY_BYTES:
        raise ValueError(f"KVCopy: {len(raw)} bytes of page keys is not a whole number of keys")
    return [raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]


class PageStore:
    """The pages of one model's KV layout in a backend (a folder given as a path)."""

    def __init__(self, backend: PageBackend | str | Path, shape: KVShape, page_tokens: int):
        self.backend = DirectoryBackend(backend) if isinstance(backend, str | Path) else backend
        self.shape = shape
        self.page_tokens = page_tokens
        self.counters = StoreCounters()
        self._logged: set[str] = set()
        self._dtype = str(shape.dtype).removeprefix("torch.").encode()
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue(WRITE_BACKLOG)
        try:
            self.backend.start()
        except OSError as e:
            self._fail(
                "start", f"cannot open {self.backend.where}: {e}; pages are misses until it works"
            )
        self._writer = threading.Thread(target=self._write_loop, name="page-store", daemon=True)
        self._writer.start()

    def _encode(self, key: bytes, k: torch.Tensor, v: torch.Tensor) -> bytes:
        payload = k.contiguous().view(torch.uint8).numpy().tobytes()
        payload += v.contiguous().view(torch.uint8).numpy().tobytes()
        s = self.shape
        header = _HEADER.pack(
            MAGIC, key, s.num_layers, s.num_kv_heads, s.head_dim, self.page_tokens,
            self._dtype, hashlib.blake2b(payload, digest_size=KEY_BYTES).digest(),
        )  # fmt: skip
        return header + payload

    def _decode(self, key: bytes, data: bytes) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k, v), each [layers, page_tokens, heads, dim]; None unless exactly this page."""
        s = self.shape
        if len(data) < _HEADER.size:
            return None
        magic, got_key, layers, heads, dim, tokens, dtype, digest = _HEADER.unpack_from(data)
        payload = memoryview(data)[_HEADER.size :]
        if (magic, got_key, layers, heads, dim, tokens, dtype.rstrip(b"\0")) != (
            MAGIC, key, s.num_layers, s.num_kv_heads, s.head_dim, self.page_tokens, self._dtype
        ):  # fmt: skip
            return None
        if len(payload) != self.page_tokens * s.bytes_per_token():  # k and v
            return None
        if hashlib.blake2b(payload, digest_size=KEY_BYTES).digest() != digest:
            return None
        flat = torch.frombuffer(bytearray(payload), dtype=s.dtype)
        k, v = flat.view(2, s.num_layers, self.page_tokens, s.num_kv_heads, s.head_dim)
        return k, v

    def write(self, keys: list[bytes], k: torch.Tensor, v: torch.Tensor) -> None:
        """Queues pages: k, v [layers, len(keys) * page_tokens, heads, dim] on the CPU,
        already copied out of the pool."""
        p = self.page_tokens
        for i, key in enumerate(keys):
            blob = self._encode(key, k[:, i * p : (i + 1) * p], v[:, i * p : (i + 1) * p])
            try:
                self._queue.put_nowait((key, blob))
            except queue.Full:
                self._fail("backlog", f"more than {WRITE_BACKLOG} pages wait for the store")

    def _write_loop(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < WRITE_BATCH and batch[-1] is not None:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._write_pages([item for item in batch if item is not None])
            except Exception as e:  # the writer must outlive any one page
                self._fail("write:unexpected", f"writing a KV page failed: {e!r}")
            finally:
                for _ in batch:
                    self._queue.task_done()
            if batch[-1] is None:
                return

    def _write_pages(self, pages: list[tuple[bytes, bytes]]) -> None:
        if not pages:
            return
        start = time.perf_counter()
        results: list[bool | OSError]
        try:
            results = self.backend.put_absent(pages)
        except OSError as e:  # the whole batch (a server unreachable)
            results = [e] * len(pages)
        for (_, blob), result in zip(pages, results, strict=True):
            if isinstance(result, OSError):
                self._fail(
                    f"write:{_kind(result)}",
                    f"cannot write a KV page to {self.backend.where}: {result}",
                )
            elif result:
                self.counters.pages_written += 1
                self.counters.bytes_written += len(blob)
        self.counters.write_seconds += time.perf_counter() - start

    def drain(self) -> None:
        """Waits until every queued page is written (tests, shutdown)."""
        self._queue.join()

    def read_leading(self, keys: list[bytes]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The pages of keys up to the first missing or unreadable one."""
        start = time.perf_counter()
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            for key, data in zip(keys, self.backend.get_many(keys), strict=False):
                page = self._checked(key, data)
                if page is None:
                    break
                out.append(page)
        except OSError as e:
            self._fail(f"read:{_kind(e)}", f"cannot read KV pages from {self.backend.where}: {e}")
        self.counters.pages_read += len(out)
        self.counters.misses += len(keys) - len(out)
        self.counters.read_seconds += time.perf_counter() - start
        return out

    def _checked(self, key: bytes, data: bytes | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        if data is None:
            return None
        page = self._decode(key, data)
        if page is None:
            self.counters.corrupt_pages += 1
            self._fail(
                "corrupt",
                f"page {key.hex()} in {self.backend.where} is not a whole page of this "
                "model's KV; deleted",
            )
            with contextlib.suppress(OSError):  # a read-only volume: still a miss
                self.backend.delete(key)
            return None
        self.counters.bytes_read += len(data)
        return page

    def clear(self) -> int:
        self.drain()
        try:
            return self.backend.clear()
        except OSError as e:
            self._fail(f"clear:{_kind(e)}", f"cannot delete the pages in {self.backend.where}: {e}")
            return 0

    def _fail(self, kind: str, message: str) -> None:
        if kind.startswith("write") or kind == "backlog":
            self.counters.write_failures += 1
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("storage tier: %s (further ones are counted, not logged)", message)
