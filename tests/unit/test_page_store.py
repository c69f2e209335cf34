"""The storage tier's pages on disk: written whole or not at all, read back exactly, and
anything wrong with the disk or a file (full, unwritable, corrupted, truncated, another
layout, another key) read as a miss and counted, never raised."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import threading

import pytest
import torch

from services.worker.kv_pool import KVShape
from services.worker.page_store import _HEADER, PageStore

REPO = pathlib.Path(__file__).resolve().parents[2]
SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
P = 4  # page_tokens
PAGE_BYTES = _HEADER.size + P * SHAPE.bytes_per_token()  # 72 + 4 * 128


def _key(i: int) -> bytes:
    return i.to_bytes(2, "little") * 8


def _kv(pages: int, shape: KVShape = SHAPE, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dims = (shape.num_layers, pages * P, shape.num_kv_heads, shape.head_dim)
    k = torch.randn(dims, generator=g).to(shape.dtype)
    v = torch.randn(dims, generator=g).to(shape.dtype)
    return k, v


def _page(t: torch.Tensor, i: int) -> torch.Tensor:
    return t[:, i * P : (i + 1) * P]


def _files(root: pathlib.Path, pattern: str) -> list[pathlib.Path]:
    return sorted(p for p in root.rglob(pattern) if p.is_file())


def _drain(store: PageStore, timeout: float = 10.0) -> None:
    """store.drain(), failing instead of hanging when the writer thread has died."""
    t = threading.Thread(target=store.drain, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the page writer stopped taking pages"
    assert store._writer.is_alive()


def _stored(tmp_path: pathlib.Path, n: int, shape: KVShape = SHAPE):
    """A store holding pages _key(0) .. _key(n - 1), and their (k, v)."""
    store = PageStore(tmp_path, shape, P)
    k, v = _kv(n, shape)
    store.write([_key(i) for i in range(n)], k, v)
    store.drain()
    return store, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_read_back_exactly_what_was_written(tmp_path, dtype):
    shape = KVShape(2, 2, 4, dtype)
    store, k, v = _stored(tmp_path, 2, shape)
    page_bytes = _HEADER.size + P * shape.bytes_per_token()
    assert store.counters.pages_written == 2
    assert store.counters.bytes_written == 2 * page_bytes
    assert len(_files(tmp_path, "*.kv")) == 2
    assert _files(tmp_path, "*.tmp") == []

    pages = store.read_leading([_key(0), _key(1)])
    assert len(pages) == 2
    for i, (pk, pv) in enumerate(pages):
        assert pk.dtype == pv.dtype == dtype
        assert pk.shape == pv.shape == (2, P, 2, 4)
        assert torch.equal(pk, _page(k, i))
        assert torch.equal(pv, _page(v, i))
    assert not torch.equal(pages[0][0], pages[1][0])  # two pages, not one twice
    assert store.counters.pages_read == 2
    assert store.counters.misses == 0
    assert store.counters.bytes_read == 2 * page_bytes
    assert store.counters.corrupt_pages == store.counters.write_failures == 0


def test_a_page_already_on_disk_is_not_written_again(tmp_path):
    store, k, v = _stored(tmp_path, 1)
    store.write([_key(0)], *_kv(1, seed=9))
    store.drain()
    assert store.counters.pages_written == 1
    (pk, pv), = store.read_leading([_key(0)])  # fmt: skip
    assert torch.equal(pk, _page(k, 0)) and torch.equal(pv, _page(v, 0))


def test_reading_stops_at_the_first_missing_page(tmp_path):
    store, k, _ = _stored(tmp_path, 2)
    missing = _key(99)
    pages = store.read_leading([_key(0), missing, _key(1)])
    assert len(pages) == 1
    assert torch.equal(pages[0][0], _page(k, 0))
    assert store.counters.pages_read == 1
    assert store.counters.misses == 2  # the missing page and the one after it
    assert store.read_leading([missing]) == []
    assert store.counters.misses == 3
    assert store.counters.corrupt_pages == 0  # a missing page is no corrupt one
    assert len(_files(tmp_path, "*.kv")) == 2


def _flip_payload_byte(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: pathlib.Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: _HEADER.size + (len(data) - _HEADER.size) // 2])


def _truncate_into_header(path: pathlib.Path) -> None:
    path.write_bytes(path.read_bytes()[: _HEADER.size - 5])


@pytest.mark.parametrize("damage", [_flip_payload_byte, _truncate, _truncate_into_header])
def test_a_damaged_page_is_a_miss_and_deleted_and_the_rest_still_serve(tmp_path, damage):
    store, k, _ = _stored(tmp_path, 3)
    bad = store.backend.path(_key(1))
    damage(bad)
    pages = store.read_leading([_key(0), _key(1), _key(2)])
    assert len(pages) == 1 and torch.equal(pages[0][0], _page(k, 0))
    assert store.counters.corrupt_pages == 1
    assert store.counters.misses == 2
    assert not bad.exists()
    # The store goes on serving the pages that are whole, and a missing page is now
    # just a miss, not counted as corrupt again.
    (pk, _), = store.read_leading([_key(2)])  # fmt: skip
    assert torch.equal(pk, _page(k, 2))
    assert store.read_leading([_key(1)]) == []
    assert store.counters.corrupt_pages == 1
    assert store.counters.pages_read == 2


@pytest.mark.parametrize(
    "other",
    [
        KVShape(2, 2, 8, torch.float32),
        KVShape(2, 2, 4, torch.bfloat16),
        KVShape(3, 2, 4, torch.float32),
    ],
    ids=["head_dim", "dtype", "layers"],
)
def test_a_page_of_another_layout_is_a_miss_and_deleted(tmp_path, other):
    store, k, _ = _stored(tmp_path, 2)
    foreign = PageStore(tmp_path, other, P)  # another model on the same volume
    foreign.write([_key(7)], *_kv(1, other))
    foreign.drain()
    assert foreign.counters.pages_written == 1
    assert store.backend.path(_key(7)).exists()
    assert store.read_leading([_key(7)]) == []
    assert store.counters.corrupt_pages == 1
    assert not store.backend.path(_key(7)).exists()
    assert len(store.read_leading([_key(0), _key(1)])) == 2


def test_another_page_tokens_is_another_layout(tmp_path):
    store, _, _ = _stored(tmp_path, 1)
    other = PageStore(tmp_path, SHAPE, 2 * P)
    assert other.read_leading([_key(0)]) == []
    assert other.counters.corrupt_pages == 1


def test_a_page_under_another_keys_name_is_a_miss(tmp_path):
    store, k, _ = _stored(tmp_path, 2)
    a, b = store.backend.path(_key(0)), store.backend.path(_key(5))
    b.parent.mkdir(exist_ok=True)
    b.write_bytes(a.read_bytes())  # a whole, valid page, but of key 0
    assert store.read_leading([_key(5)]) == []
    assert store.counters.corrupt_pages == 1
    assert not b.exists()
    (pk, _), = store.read_leading([_key(0)])  # fmt: skip
    assert torch.equal(pk, _page(k, 0))


def test_the_checksum_covers_the_payload(tmp_path):
    store, _, _ = _stored(tmp_path, 2)
    a, b = store.backend.path(_key(0)), store.backend.path(_key(1))
    a_data, b_data = a.read_bytes(), b.read_bytes()
    assert a_data[_HEADER.size :] != b_data[_HEADER.size :]
    a.write_bytes(a_data[: _HEADER.size] + b_data[_HEADER.size :])  # a's header, b's KV
    assert store.read_leading([_key(0), _key(1)]) == []
    assert store.counters.corrupt_pages == 1
    assert not a.exists() and b.exists()
    assert len(store.read_leading([_key(1)])) == 1


_DISK_FULL = """
import json, resource, sys
import torch
from services.worker.kv_pool import KVShape
from services.worker.page_store import PageStore

limit = int(sys.argv[1])
store = PageStore(sys.argv[2], KVShape(2, 2, 4, torch.float32), 4)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
k, v = torch.randn(2, 8, 2, 4), torch.randn(2, 8, 2, 4)
store.write([b"a" * 16, b"b" * 16], k, v)
store.drain()
print(json.dumps(vars(store.counters)))
"""


def test_a_full_disk_fails_the_write_without_killing_the_process(tmp_path):
    limit = PAGE_BYTES // 2  # every page is larger than what the disk takes
    root = tmp_path / "store"
    proc = subprocess.run(
        [sys.executable, "-c", _DISK_FULL, str(limit), str(root)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    counters = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counters["write_failures"] == 2
    assert counters["pages_written"] == 0
    assert counters["bytes_written"] == 0
    assert "cannot write a KV page" in proc.stderr  # logged once ...
    assert proc.stderr.count("cannot write a KV page") == 1  # ... not per page
    assert _files(root, "*.kv") == []
    assert _files(root, "*.tmp") == []
    assert _files(root, "*") == []


def test_an_unwritable_root_counts_failures_and_reads_nothing(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    store = PageStore(tmp_path / "file" / "store", SHAPE, P)  # does not raise
    k, v = _kv(2)
    store.write([_key(0), _key(1)], k, v)
    _drain(store)
    assert store.counters.write_failures == 2
    assert store.counters.pages_written == 0
    assert store.read_leading([_key(0), _key(1)]) == []
    assert store.counters.misses == 2
    # The writer survives the failures: later writes are still taken (and fail) too.
    store.write([_key(2)], *_kv(1))
    _drain(store)
    assert store.counters.write_failures == 3


def test_two_stores_racing_on_one_key_leave_one_whole_page(tmp_path):
    rounds = 50
    a, b = PageStore(tmp_path, SHAPE, P), PageStore(tmp_path, SHAPE, P)
    k, v = _kv(rounds)
    barrier = threading.Barrier(2)

    def writer(store: PageStore) -> None:
        for i in range(rounds):
            barrier.wait()  # both queue the same page at the same moment
            store.write([_key(i)], _page(k, i), _page(v, i))
        store.drain()

    threads = [threading.Thread(target=writer, args=(s,)) for s in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)

    assert a.counters.write_failures == b.counters.write_failures == 0
    assert rounds <= a.counters.pages_written + b.counters.pages_written <= 2 * rounds
    assert _files(tmp_path, "*.tmp") == []
    assert len(_files(tmp_path, "*.kv")) == rounds
    reader = PageStore(tmp_path, SHAPE, P)
    pages = reader.read_leading([_key(i) for i in range(rounds)])
    assert len(pages) == rounds
    for i, (pk, pv) in enumerate(pages):
        assert torch.equal(pk, _page(k, i)) and torch.equal(pv, _page(v, i))
    assert reader.counters.corrupt_pages == 0


def test_clear_deletes_every_page_and_counts_them(tmp_path):
    store, _, _ = _stored(tmp_path, 3)
    assert store.clear() == 3
    assert _files(tmp_path, "*.kv") == []
    assert store.read_leading([_key(0)]) == []
    assert store.clear() == 0
    store.write([_key(4)], *_kv(1))  # the store is still usable after a flush
    assert store.clear() == 1  # clear waits for queued pages, then deletes them


def test_a_corrupt_page_on_a_read_only_volume_is_still_a_miss(tmp_path, monkeypatch):
    store, _, _ = _stored(tmp_path, 2)
    _flip_payload_byte(store.backend.path(_key(0)))

    def refuse(self, missing_ok=False):
        raise PermissionError(30, "Read-only file system", str(self))

    monkeypatch.setattr(pathlib.Path, "unlink", refuse)
    assert store.read_leading([_key(0), _key(1)]) == []
    assert store.counters.corrupt_pages == 1
