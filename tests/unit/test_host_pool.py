"""The worker's side of the hierarchical cache: the host tier's buffers and the copies the
scheduler sends, run in order; a malformed copy is refused whole, copying nothing."""

from __future__ import annotations

import pytest
import torch

from radixserve.internal.v1 import engine_pb2
from services.common.transport import pack_i32
from services.worker.host_pool import D2H, D2S, H2D, S2H, HostPool, host_tier_tokens
from services.worker.kv_pool import KVPool, KVShape
from services.worker.page_store import PageStore

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)


def _copy(direction: int, src: list[int], dst: list[int]) -> engine_pb2.KVCopy:
    return engine_pb2.KVCopy(direction=direction, src_slots=pack_i32(src), dst_slots=pack_i32(dst))


def test_a_round_trip_through_the_host_tier_returns_the_same_kv():
    pool, host = KVPool(SHAPE, 16, torch.device("cpu")), HostPool(SHAPE, 32, pin=False)
    pool.k_buffer.normal_()
    pool.v_buffer.normal_()
    k, v = pool.k_buffer[:, [3, 4, 5]].clone(), pool.v_buffer[:, [3, 4, 5]].clone()
    host.apply([_copy(D2H, [3, 4, 5], [30, 31, 32])], pool)
    pool.k_buffer[:, 3:6] = 0  # the device slots go to other requests meanwhile
    host.apply([_copy(H2D, [30, 31, 32], [9, 10, 11])], pool)
    assert torch.equal(pool.k_buffer[:, [9, 10, 11]], k)
    assert torch.equal(pool.v_buffer[:, [9, 10, 11]], v)
    assert host.bytes_moved[D2H] == host.bytes_moved[H2D] == 3 * 2 * 2 * 2 * 4 * 4


@pytest.mark.parametrize(
    "bad, words",
    [
        (_copy(7, [1], [1]), "unknown direction"),
        (_copy(D2H, [1, 2], [1]), "2 source slots but 1"),
        (_copy(D2H, [17], [1]), "source slot is outside 1..16"),
        (_copy(H2D, [1], [0]), "destination slot is outside 1..16"),
        (_copy(D2H, [1], [33]), "destination slot is outside 1..32"),
        (engine_pb2.KVCopy(direction=D2H, src_slots=b"abc", dst_slots=b"abc"), "whole number"),
    ],
)
def test_a_malformed_copy_is_refused_and_nothing_moves(bad, words):
    pool, host = KVPool(SHAPE, 16, torch.device("cpu")), HostPool(SHAPE, 32, pin=False)
    pool.k_buffer.normal_()
    before = host.k_buffer.clone()
    with pytest.raises(ValueError, match=words):
        host.apply([_copy(D2H, [1], [2]), bad], pool)  # the good one before it does not run
    assert torch.equal(host.k_buffer, before)


def test_the_host_tier_is_sized_by_ratio_or_gib_and_bounded_by_memory():
    per_token = SHAPE.bytes_per_token()
    assert host_tier_tokens(SHAPE, 1000, 2.0, 0.0) == 2000
    assert host_tier_tokens(SHAPE, 1000, 2.0, 1.0) == 2**30 // per_token  # size wins
    assert host_tier_tokens(SHAPE, 1000, 0.0, 0.0) == 0
    with pytest.raises(ValueError, match="more than 80%"):
        host_tier_tokens(SHAPE, 1000, 0.0, 1e6)
    with pytest.raises(ValueError, match=">= 0"):
        host_tier_tokens(SHAPE, 1000, -1.0, 0.0)


def test_the_directions_are_engine_protos():
    assert (D2H, H2D) == (
        engine_pb2.KVCopy.DIRECTION_DEVICE_TO_HOST,
        engine_pb2.KVCopy.DIRECTION_HOST_TO_DEVICE,
    )


# -- the storage tier behind the host tier (page_store.py) ----------------------------------
P = 4  # page_tokens


def _key(i: int) -> bytes:
    return bytes([i]) * 16


def _storage_copy(direction: int, keys: list[bytes], slots: list[int], load_id: int = 0):
    field = "src_slots" if direction == D2S else "dst_slots"
    return engine_pb2.KVCopy(
        direction=direction, keys=b"".join(keys), load_id=load_id, **{field: pack_i32(slots)}
    )


def _tiers(tmp_path, host_slots: int = 32):
    pool = KVPool(SHAPE, 16, torch.device("cpu"))
    pool.k_buffer.normal_()
    pool.v_buffer.normal_()
    return pool, HostPool(SHAPE, host_slots, pin=False, store=PageStore(tmp_path, SHAPE, P))


def test_pages_go_to_storage_and_come_back_into_the_given_host_slots(tmp_path):
    pool, host = _tiers(tmp_path)
    dev = [3, 4, 5, 6, 11, 12, 13, 14]  # two pages, not contiguous in the device pool
    k, v = pool.k_buffer[:, dev].clone(), pool.v_buffer[:, dev].clone()
    assert host.apply([_storage_copy(D2S, [_key(1), _key(2)], dev)], pool) == []
    host.store.drain()
    assert host.store.counters.pages_written == 2
    pool.k_buffer.zero_()  # the device slots go to other requests meanwhile
    pool.v_buffer.zero_()

    dst = [20, 21, 22, 23, 8, 9, 10, 11]
    loads = host.apply([_storage_copy(S2H, [_key(1), _key(2)], dst, load_id=7)], pool)
    assert loads == [(7, 2)]
    assert torch.equal(host.k_buffer[:, dst], k)
    assert torch.equal(host.v_buffer[:, dst], v)
    untouched = [s for s in range(host.num_slots + 1) if s not in dst]
    assert not host.k_buffer[:, untouched].any() and not host.v_buffer[:, untouched].any()
    slot_bytes = 2 * SHAPE.num_layers * SHAPE.num_kv_heads * SHAPE.head_dim * 4
    assert host.bytes_moved[D2S] == host.bytes_moved[S2H] == 8 * slot_bytes


def test_a_load_stops_at_the_first_page_storage_lacks(tmp_path):
    pool, host = _tiers(tmp_path)
    host.apply([_storage_copy(D2S, [_key(1), _key(3)], [1, 2, 3, 4, 5, 6, 7, 8])], pool)
    host.store.drain()
    k = pool.k_buffer[:, [1, 2, 3, 4]].clone()
    dst = list(range(10, 22))  # three pages: key 1, key 2 (never stored), key 3
    copies = [
        _storage_copy(S2H, [_key(1), _key(2), _key(3)], dst, load_id=5),
        _storage_copy(S2H, [_key(9)], [30, 31, 32, 29], load_id=6),
    ]
    assert host.apply(copies, pool) == [(5, 1), (6, 0)]
    assert torch.equal(host.k_buffer[:, dst[:P]], k)
    assert not host.k_buffer[:, dst[P:]].any()  # page 3 is on disk but follows a miss
    assert not host.v_buffer[:, dst[P:]].any()
    assert not host.k_buffer[:, 29:33].any()
    slot_bytes = 2 * SHAPE.num_layers * SHAPE.num_kv_heads * SHAPE.head_dim * 4
    assert host.bytes_moved[S2H] == P * slot_bytes  # only what was found moved


@pytest.mark.parametrize(
    "bad, words",
    [
        (engine_pb2.KVCopy(direction=D2S, keys=b"x" * 17, src_slots=pack_i32([1, 2, 3, 4])),
         "17 bytes of page keys is not a whole number of keys"),
        (_storage_copy(D2S, [_key(1)], [1, 2, 3]), "1 pages of 4 tokens but 3 slots"),
        (_storage_copy(S2H, [_key(1)], [1, 2, 3, 4, 5]), "1 pages of 4 tokens but 5 slots"),
        (_storage_copy(D2S, [_key(1)], [1, 2, 3, 17]), "source slot is outside 1..16"),
        (_storage_copy(S2H, [_key(1)], [0, 1, 2, 3]), "destination slot is outside 1..32"),
        (_storage_copy(S2H, [_key(1)], [30, 31, 32, 33]), "destination slot is outside 1..32"),
    ],
)  # fmt: skip
def test_a_malformed_storage_copy_is_refused_and_nothing_moves(tmp_path, bad, words):
    pool, host = _tiers(tmp_path)
    host.apply([_storage_copy(D2S, [_key(1)], [1, 2, 3, 4])], pool)
    host.store.drain()
    before, written = host.k_buffer.clone(), host.store.counters.pages_written
    good = [
        _copy(D2H, [5], [6]),
        _storage_copy(D2S, [_key(2)], [5, 6, 7, 8]),
        _storage_copy(S2H, [_key(1)], [10, 11, 12, 13], load_id=1),
    ]
    with pytest.raises(ValueError, match=words):
        host.apply([*good, bad], pool)  # none of the good ones before it runs
    host.store.drain()
    assert torch.equal(host.k_buffer, before)
    assert host.store.counters.pages_written == written == 1
    assert host.store.counters.pages_read == 0
    assert not host.store.backend.path(_key(2)).exists()


@pytest.mark.parametrize("direction", [D2S, S2H])
def test_a_storage_copy_without_a_storage_tier_is_refused(direction):
    pool, host = KVPool(SHAPE, 16, torch.device("cpu")), HostPool(SHAPE, 32, pin=False)
    pool.k_buffer.normal_()
    before = host.k_buffer.clone()
    with pytest.raises(ValueError, match="no storage tier"):
        host.apply([_copy(D2H, [1], [2]), _storage_copy(direction, [_key(1)], [1, 2, 3, 4])], pool)
    assert torch.equal(host.k_buffer, before)


def test_the_storage_directions_are_engine_protos():
    assert (D2S, S2H) == (
        engine_pb2.KVCopy.DIRECTION_DEVICE_TO_STORAGE,
        engine_pb2.KVCopy.DIRECTION_STORAGE_TO_HOST,
    )
