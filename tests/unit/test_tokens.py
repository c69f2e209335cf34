"""The scheduler's token containers (services/scheduler/tokens.py): int32 arrays that the
radix tree compares in C. The danger they bring is silent: an array never equals a list,
so any container that reaches the tree unconverted would match nothing."""

from __future__ import annotations

from array import array

import numpy as np
import pytest
import torch

from radixserve.internal.v1 import engine_pb2
from services.common.transport import pack_i32
from services.scheduler.allocator import KVSlotAllocator
from services.scheduler.radix_cache import RadixCache
from services.scheduler.request import Req
from services.scheduler.tokens import as_tokens, tokens_from_wire


@pytest.mark.parametrize(
    "seq",
    [[5, 6, 7], (5, 6, 7), array("q", [5, 6, 7]), np.array([5, 6, 7]), torch.tensor([5, 6, 7])],
)
def test_any_sequence_of_ids_becomes_an_int32_array(seq):
    out = as_tokens(seq)
    assert out.typecode == "i" and out.tolist() == [5, 6, 7]


def test_an_int32_array_is_taken_as_is():
    a = array("i", [1, 2])
    assert as_tokens(a) is a


def test_an_id_outside_int32_is_refused_by_name():
    with pytest.raises(ValueError, match="int32"):
        as_tokens([1, 2**31])


def test_wire_bytes_round_trip_and_a_torn_payload_is_refused():
    ids = [0, 1, 31999, 2**31 - 1]
    assert tokens_from_wire(pack_i32(ids)).tolist() == ids
    with pytest.raises(ValueError):
        tokens_from_wire(pack_i32(ids)[:-1])


def test_the_cache_matches_whatever_container_inserted_or_asked():
    alloc = KVSlotAllocator(64)
    cache = RadixCache(alloc)
    seq = list(range(10, 30))
    slots = alloc.alloc(len(seq))
    assert slots is not None
    cache.insert_prefix(seq, slots)  # a list in: stored as an array
    for probe in (seq, tuple(seq), array("i", seq), np.array(seq), torch.tensor(seq)):
        m = cache.match_prefix(probe, peek=True)
        assert m.slots == slots, type(probe)


def test_a_request_keeps_its_ids_as_arrays_and_fill_ids_joins_them():
    req = Req(rid="r", identity=b"f", input_ids=[1, 2, 3], sampling=engine_pb2.SamplingParams())
    req.output_ids.append(9)
    assert req.input_ids.typecode == req.output_ids.typecode == "i"
    assert req.fill_ids.tolist() == [1, 2, 3, 9]
