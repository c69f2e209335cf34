"""The worker's side of the hierarchical cache: the host tier's buffers and the copies the
scheduler sends, run in order; a malformed copy is refused whole, copying nothing."""

from __future__ import annotations

import pytest
import torch

from radixserve.internal.v1 import engine_pb2
from services.common.transport import pack_i32
from services.worker.host_pool import D2H, H2D, HostPool, host_tier_tokens
from services.worker.kv_pool import KVPool, KVShape

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
