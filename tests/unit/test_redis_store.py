"""The storage tier's pages in a real redis-server (services/worker/redis_store.py): read
back exactly, written once, found with one MGET; and a server that is down, slow, killed,
full, or wants a password costs a bounded wait and counted misses or write failures, never
an exception out of the store."""

from __future__ import annotations

import argparse
import logging
import socket
import time

import pytest
import torch

from radixserve.internal.v1 import engine_pb2
from services.common.config import WorkerConfig, add_dataclass_args, from_args
from services.common.transport import pack_i32
from services.worker.host_pool import D2S, S2H, HostPool
from services.worker.kv_pool import KVPool, KVShape
from services.worker.page_store import _HEADER, PageStore
from services.worker.redis_store import PREFIX, RedisBackend, redacted
from tests.redis_util import RedisServer, make_tls_files
from tests.server_util import free_port

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
P = 4  # page_tokens
TIMEOUT = 0.5  # a live local server answers far sooner, even on a loaded machine


def _key(i: int) -> bytes:
    return i.to_bytes(2, "little") * 8


def _name(i: int) -> bytes:
    return PREFIX + _key(i).hex().encode()


def _kv(pages: int, shape: KVShape = SHAPE, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dims = (shape.num_layers, pages * P, shape.num_kv_heads, shape.head_dim)
    return torch.randn(dims, generator=g).to(shape.dtype), torch.randn(dims, generator=g).to(
        shape.dtype
    )


def _page(t: torch.Tensor, i: int) -> torch.Tensor:
    return t[:, i * P : (i + 1) * P]


def _store(url: str, shape: KVShape = SHAPE, **kw) -> PageStore:
    kw.setdefault("timeout", TIMEOUT)
    return PageStore(RedisBackend(url, **kw), shape, P)


def _stored(url: str, n: int, shape: KVShape = SHAPE, **kw):
    """A store holding pages _key(0) .. _key(n - 1), and their (k, v)."""
    store = _store(url, shape, **kw)
    k, v = _kv(n, shape)
    store.write([_key(i) for i in range(n)], k, v)
    store.drain()
    return store, k, v


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def server(shared):
    with shared.client() as c:
        c.flushall()
    return shared


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_read_back_exactly_what_was_written(server, dtype):
    shape = KVShape(2, 2, 4, dtype)
    store, k, v = _stored(server.url, 3, shape)
    page_bytes = _HEADER.size + P * shape.bytes_per_token()
    assert store.counters.pages_written == 3
    assert store.counters.bytes_written == 3 * page_bytes
    with server.client() as c:
        assert sorted(c.keys("*")) == sorted(_name(i) for i in range(3))
        assert all(len(c.get(_name(i))) == page_bytes for i in range(3))

    pages = store.read_leading([_key(i) for i in range(3)])
    assert len(pages) == 3
    for i, (pk, pv) in enumerate(pages):
        assert pk.dtype == pv.dtype == dtype and pk.shape == (2, P, 2, 4)
        assert torch.equal(pk, _page(k, i)) and torch.equal(pv, _page(v, i))
    assert not torch.equal(pages[0][0], pages[1][0])
    assert store.counters.pages_read == 3 and store.counters.misses == 0
    assert store.counters.bytes_read == 3 * page_bytes
    assert store.counters.corrupt_pages == store.counters.write_failures == 0


def test_another_engine_reads_the_pages_one_wrote(server):
    _, k, v = _stored(server.url, 2)
    other = _store(server.url)  # a second worker on the same server
    pages = other.read_leading([_key(0), _key(1)])
    assert [torch.equal(pk, _page(k, i)) for i, (pk, _) in enumerate(pages)] == [True, True]


def test_a_page_already_stored_is_not_written_again(server):
    store, k, v = _stored(server.url, 1)
    with server.client() as c:
        before = c.get(_name(0))
    store.write([_key(0)], *_kv(1, seed=9))  # same key, other bytes: SET NX keeps the first
    store.drain()
    assert store.counters.pages_written == 1 and store.counters.write_failures == 0
    with server.client() as c:
        assert c.get(_name(0)) == before
    (pk, pv), = store.read_leading([_key(0)])  # fmt: skip
    assert torch.equal(pk, _page(k, 0)) and torch.equal(pv, _page(v, 0))


def _calls(server: RedisServer, command: str) -> int:
    with server.client() as c:
        return int(c.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def test_the_probe_stops_at_the_first_missing_page_in_one_round_trip(server):
    store, k, _ = _stored(server.url, 3)
    mgets = _calls(server, "mget")
    pages = store.read_leading([_key(0), _key(99), _key(1), _key(2)])
    assert _calls(server, "mget") == mgets + 1
    assert len(pages) == 1 and torch.equal(pages[0][0], _page(k, 0))
    assert store.counters.misses == 3  # the missing page and the ones after it
    assert store.counters.corrupt_pages == 0
    assert store.read_leading([]) == []


def test_pages_expire_after_the_ttl(server):
    _stored(server.url, 1, ttl=600)
    with server.client() as c:
        assert 590 <= c.ttl(_name(0)) <= 600
    forever = _store(server.url, ttl=0)
    forever.write([_key(1)], *_kv(1))
    forever.drain()
    with server.client() as c:
        assert c.ttl(_name(1)) == -1  # no expiry


def _flip_payload_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0xFF])


def _truncate(data: bytes) -> bytes:
    return data[: _HEADER.size + (len(data) - _HEADER.size) // 2]


def _truncate_into_header(data: bytes) -> bytes:
    return data[: _HEADER.size - 5]


@pytest.mark.parametrize("damage", [_flip_payload_byte, _truncate, _truncate_into_header])
def test_a_damaged_value_is_a_miss_and_deleted(server, damage):
    store, k, _ = _stored(server.url, 3)
    with server.client() as c:
        c.set(_name(1), damage(c.get(_name(1))))
        pages = store.read_leading([_key(0), _key(1), _key(2)])
        assert len(pages) == 1 and torch.equal(pages[0][0], _page(k, 0))
        assert store.counters.corrupt_pages == 1 and store.counters.misses == 2
        assert not c.exists(_name(1))
    (pk, _), = store.read_leading([_key(2)])  # fmt: skip
    assert torch.equal(pk, _page(k, 2))
    assert store.read_leading([_key(1)]) == [] and store.counters.corrupt_pages == 1


def test_a_page_under_another_keys_name_is_a_miss(server):
    store, _, _ = _stored(server.url, 1)
    with server.client() as c:
        c.set(_name(5), c.get(_name(0)))  # a whole, valid page, but of key 0
        assert store.read_leading([_key(5)]) == []
        assert store.counters.corrupt_pages == 1 and not c.exists(_name(5))


@pytest.mark.parametrize(
    "other",
    [KVShape(2, 2, 8, torch.float32), KVShape(2, 2, 4, torch.bfloat16)],
    ids=["head_dim", "dtype"],
)
def test_a_page_of_another_layout_is_a_miss_and_deleted(server, other):
    store, _, _ = _stored(server.url, 2)
    foreign = _store(server.url, other)  # another model on the same server
    foreign.write([_key(7)], *_kv(1, other))
    foreign.drain()
    assert foreign.counters.pages_written == 1
    assert store.read_leading([_key(7)]) == []
    assert store.counters.corrupt_pages == 1
    with server.client() as c:
        assert not c.exists(_name(7))
    assert len(store.read_leading([_key(0), _key(1)])) == 2


def test_clear_deletes_only_radixserve_pages(server):
    store, _, _ = _stored(server.url, 3)
    with server.client() as c:
        c.set(b"someone:else", b"x")
        c.set(b"radixserve:other", b"y")
        assert store.clear() == 3
        assert sorted(c.keys("*")) == [b"radixserve:other", b"someone:else"]
    assert store.read_leading([_key(0)]) == []
    assert store.clear() == 0
    store.write([_key(4)], *_kv(1))  # still usable after a flush
    assert store.clear() == 1  # clear waits for queued pages, then deletes them


def test_a_password_is_required_and_honoured(tmp_path, caplog):
    with RedisServer(tmp_path, password="s3cret") as server:
        # Without it: every write fails and every read misses, counted, nothing raised.
        caplog.set_level(logging.WARNING)
        bare = _store(server.url)
        bare.write([_key(0), _key(1)], *_kv(2))
        bare.drain()
        assert bare.counters.write_failures == 2 and bare.counters.pages_written == 0
        assert bare.read_leading([_key(0)]) == [] and bare.counters.misses == 1
        assert "s3cret" not in caplog.text
        with server.client() as c:
            assert c.dbsize() == 0
        # From the flag (a chart's Secret, by environment) or in the URL.
        store, k, _ = _stored(server.url, 2, password="s3cret")
        assert store.counters.pages_written == 2
        in_url = _store(server.url.replace("//", "//:s3cret@"))
        assert "s3cret" not in in_url.backend.where
        assert len(in_url.read_leading([_key(0), _key(1)])) == 2


def test_the_url_in_logs_has_no_password():
    assert redacted("redis://:pw@host:6379/0") == "redis://:***@host:6379/0"
    assert redacted("rediss://user:pw@host/1") == "rediss://user:***@host/1"
    assert redacted("redis://host:6379") == "redis://host:6379"


def test_a_store_that_is_down_costs_at_most_the_timeout(caplog):
    caplog.set_level(logging.WARNING)
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens: refused at once
    start = time.perf_counter()
    store = _store(url, timeout=0.1, retry_after=60)
    assert store.read_leading([_key(0), _key(1)]) == []
    store.write([_key(0)], *_kv(1))
    store.drain()
    assert time.perf_counter() - start < 1.0
    assert store.counters.misses == 2 and store.counters.write_failures == 1
    assert store.clear() == 0
    assert caplog.text.count("cannot read KV pages") == 1
    # A port that accepts and never answers (a hung or blackholed server): one timeout,
    # then the server is known down and later calls do not wait at all.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        start = time.perf_counter()
        slow = _store(f"redis://127.0.0.1:{silent.getsockname()[1]}/0", timeout=0.1)
        assert slow.read_leading([_key(0)]) == []  # its PING at start timed out, once
        assert 0.1 <= time.perf_counter() - start < 0.6
        start = time.perf_counter()
        for _ in range(20):
            assert slow.read_leading([_key(0)]) == []
        assert time.perf_counter() - start < 0.2
        assert slow.counters.misses == 21


def test_a_store_killed_and_restarted_is_used_again(tmp_path, caplog):
    with RedisServer(tmp_path) as server:
        store, k, _ = _stored(server.url, 2, retry_after=0.2)
        assert len(store.read_leading([_key(0), _key(1)])) == 2
        server.kill()
        assert store.read_leading([_key(0), _key(1)]) == []  # gone: misses, no exception
        store.write([_key(2)], *_kv(1))
        store.drain()
        assert store.counters.write_failures == 1
        server.start()  # same port, empty (no persistence)
        time.sleep(0.25)  # past retry_after
        caplog.set_level(logging.INFO)
        k2, v2 = _kv(2, seed=5)
        store.write([_key(0), _key(1)], k2, v2)
        store.drain()
        assert store.counters.pages_written == 4
        pages = store.read_leading([_key(0), _key(1)])
        assert len(pages) == 2 and torch.equal(pages[1][0], _page(k2, 1))
        assert "reachable again" in caplog.text


def test_a_full_store_counts_write_failures_and_keeps_serving(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    with RedisServer(tmp_path, maxmemory="64mb") as server:
        store, k, _ = _stored(server.url, 2)
        with server.client() as c:
            c.config_set("maxmemory", 1)  # below what it uses: noeviction refuses writes
        store.write([_key(i) for i in range(2, 6)], *_kv(4))
        store.drain()
        assert store.counters.write_failures == 4 and store.counters.pages_written == 2
        assert caplog.text.count("cannot write a KV page") == 1  # logged once, OOM named
        assert "OutOfMemoryError" in caplog.text
        pages = store.read_leading([_key(0), _key(1), _key(2)])  # reads still served
        assert len(pages) == 2 and torch.equal(pages[0][0], _page(k, 0))
        with server.client() as c:
            c.config_set("maxmemory", "64mb")
        store.write([_key(2)], *_kv(1))
        store.drain()
        assert store.counters.pages_written == 3


def test_tls_with_a_ca_file(tmp_path):
    tls = make_tls_files(tmp_path)
    with RedisServer(tmp_path / "data", tls=tls) as server:
        store, k, _ = _stored(server.url, 2, tls_ca=str(tls[2]))
        assert store.counters.pages_written == 2
        assert len(store.read_leading([_key(0), _key(1)])) == 2
        untrusted = _store(server.url)  # the system's CAs do not know this one: a miss
        assert untrusted.read_leading([_key(0)]) == [] and untrusted.counters.misses == 1


def _storage_copy(direction: int, keys: list[bytes], slots: list[int], load_id: int = 0):
    field = "src_slots" if direction == D2S else "dst_slots"
    return engine_pb2.KVCopy(
        direction=direction, keys=b"".join(keys), load_id=load_id, **{field: pack_i32(slots)}
    )


@pytest.mark.parametrize("up", [True, False], ids=["up", "down"])
def test_the_workers_copies_through_the_server_never_fail_the_batch(server, up):
    """What host_pool.py runs for a batch: pages to the server and back into host slots;
    with the server down the load answers 0 pages (computed instead), the batch goes on."""
    url = server.url if up else f"redis://127.0.0.1:{free_port()}/0"
    pool = KVPool(SHAPE, 16, torch.device("cpu"))
    pool.k_buffer.normal_()
    pool.v_buffer.normal_()
    host = HostPool(SHAPE, 32, pin=False, store=_store(url))
    dev = [3, 4, 5, 6, 11, 12, 13, 14]  # two pages
    assert host.apply([_storage_copy(D2S, [_key(1), _key(2)], dev)], pool) == []
    assert host.store is not None
    host.store.drain()
    dst = list(range(20, 28))
    loads = host.apply([_storage_copy(S2H, [_key(1), _key(2)], dst, load_id=7)], pool)
    assert loads == [(7, 2 if up else 0)]
    if up:
        assert torch.equal(host.k_buffer[:, dst], pool.k_buffer[:, dev])
        assert torch.equal(host.v_buffer[:, dst], pool.v_buffer[:, dev])
    else:
        assert host.store.counters.write_failures == 2 and host.store.counters.misses == 2


# -- the flags ------------------------------------------------------------------------------
def _parse(monkeypatch, *argv: str, **env: str) -> WorkerConfig:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, WorkerConfig)
    return from_args(WorkerConfig, parser.parse_args(list(argv)))


def test_the_flags_and_their_defaults(monkeypatch):
    cfg = _parse(
        monkeypatch,
        "--hicache-storage-url",
        "redis://cache:6379/0",
        RADIXSERVE_HICACHE_STORAGE_PASSWORD="from-a-secret",
    )
    assert cfg.hicache_storage_url == "redis://cache:6379/0"
    assert (cfg.hicache_storage_ttl, cfg.hicache_storage_timeout_ms) == (86400, 50)
    assert cfg.hicache_storage_password == "from-a-secret"
    assert "from-a-secret" not in repr(cfg)


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        (
            dict(hicache_storage_dir="/pages", hicache_storage_url="redis://h/0"),
            "--hicache-storage-dir and --hicache-storage-url are exclusive",
        ),
        (dict(hicache_storage_url="http://:pw@h/0"), "redis:// or rediss://, got http://"),
        (
            dict(hicache_storage_url="redis://h/0", hicache_storage_tls_ca="/ca.crt"),
            "--hicache-storage-tls-ca needs a rediss://",
        ),
        (dict(hicache_storage_ttl=-1), "--hicache-storage-ttl must be >= 0"),
        (dict(hicache_storage_timeout_ms=0), "--hicache-storage-timeout-ms must be >= 1"),
    ],
)
def test_bad_flags_are_refused_naming_them(kw, says):
    with pytest.raises(ValueError, match=says) as e:
        WorkerConfig(**kw)
    assert "pw" not in str(e.value)
