"""The storage tier of the hierarchical cache (issue 36): pages named by their tokens
outlive the host tier and the worker. Through the fake worker, which reads every token
back through its slots, a prompt whose KV came back from storage gives the answer of the
true sequence, and a page of one namespace never serves another."""

from __future__ import annotations

import random

import pytest

from radixserve.internal.v1 import engine_pb2
from services.scheduler.storage_tier import engine_seed, page_keys
from services.scheduler.tokens import as_tokens
from services.scheduler.worker_link import WorkerLost
from tests.fake_worker import expected, make, run, submit


def _sched(storage: dict, page_size: int = 1, host: int = 4096, **kw):
    return make(
        num_slots=kw.pop("num_slots", 1024),
        max_running=4,
        host_slots=host,
        storage=storage,
        storage_page_tokens=16,
        page_size=page_size,
        **kw,
    )


def test_page_keys_chain_over_every_token_before_and_the_namespace():
    seed = engine_seed("m", "w1", "float32", 2, 1, 4)
    toks = as_tokens(list(range(1, 65)))
    keys = page_keys(seed, "", toks, 0, 4, 16)
    assert len(set(keys)) == 4 and all(len(k) == 16 for k in keys)
    assert page_keys(seed, "", toks, 2, 4, 16) == keys[2:]  # a suffix of the same chain
    other = as_tokens([7] + list(range(2, 65)))  # the first token differs
    assert not set(page_keys(seed, "", other, 0, 4, 16)) & set(keys)
    assert not set(page_keys(seed, "salt", toks, 0, 4, 16)) & set(keys)
    for other_seed in (("m2", "w1"), ("m", "w2")):  # another name, or the same over other weights
        seed2 = engine_seed(*other_seed, "float32", 2, 1, 4)
        assert not set(page_keys(seed2, "", toks, 0, 4, 16)) & set(keys)


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_restarted_worker_serves_prompts_from_storage_token_exact(page_size):
    """write_through puts every page on the volume; a new worker (empty device and host
    tiers) on the same volume then loads the prompts' pages instead of computing them."""
    storage: dict = {}
    rng = random.Random(3)
    prompts = {f"p{i}": [rng.randrange(1, 900) for _ in range(100)] for i in range(6)}
    sched, _ = _sched(storage, page_size, hicache_write_policy="write_through")
    for rid, p in prompts.items():
        submit(sched, rid, p, 8)
    first = run(sched)
    sched.check_idle()
    assert storage, "write_through wrote no page"

    sched, worker = _sched(storage, page_size)  # the restart: a new tree, new tiers
    for rid, p in prompts.items():
        submit(sched, rid, p, 8)
    again = run(sched)
    for rid, p in prompts.items():
        assert list(first[rid].token_ids) == list(again[rid].token_ids) == expected(p, 8)
        assert again[rid].cached_tokens == 96  # six whole pages of the 99 before the last
        assert again[rid].cached_storage_tokens == 96 and again[rid].cached_host_tokens == 0
        assert first[rid].cached_storage_tokens == first[rid].cached_host_tokens == 0
    assert worker.copied["s2h"] == 6 * 96
    sched.check_idle()
    stats = sched.stats()
    assert stats.storage_loaded_tokens == 6 * 96


def test_a_page_of_one_namespace_never_serves_another():
    storage: dict = {}
    prompt = list(range(1, 80))
    sched, _ = _sched(storage, hicache_write_policy="write_through")
    submit(sched, "a", prompt, 4, cache_salt="alice")
    run(sched)
    sched, worker = _sched(storage)
    submit(sched, "b", prompt, 4, cache_salt="bob")
    submit(sched, "c", prompt, 4)  # no salt: another namespace again
    got = run(sched)
    assert got["b"].cached_tokens == got["c"].cached_tokens == 0
    assert worker.copied["s2h"] == 0
    assert list(got["b"].token_ids) == expected(prompt, 4)
    submit(sched, "a2", prompt, 4, cache_salt="alice")
    assert run(sched)["a2"].cached_tokens == 64


@pytest.mark.parametrize("page_size", [1, 16])
def test_chat_beyond_device_and_host_tiers_comes_back_from_storage(page_size):
    """Sessions that outgrow both the pool and a small host tier: write_back demotes to
    the host tier, whose evictions are on the volume already; every answer is exact and
    later turns hit the storage tier."""
    storage: dict = {}
    rng = random.Random(11)
    sched, worker = _sched(storage, page_size, host=768, num_slots=640)
    sessions = {s: [rng.randrange(1, 900) for _ in range(90)] for s in range(10)}
    for turn in range(3):
        for s, hist in sessions.items():
            submit(sched, f"s{s}t{turn}", hist, 10)
        final = run(sched)
        for s, hist in sessions.items():
            got = final[f"s{s}t{turn}"]
            assert not got.error_code, got.finish_message
            assert list(got.token_ids) == expected(hist, 10)
            hist += list(got.token_ids) + [rng.randrange(1, 900) for _ in range(16)]
        sched.check_idle()
    assert worker.copied["d2s"] > 0 and worker.copied["s2h"] > 0


def test_lost_pages_are_computed_and_a_failed_batch_answers_its_loads_with_nothing():
    storage: dict = {}
    prompt = list(range(1, 120))
    sched, _ = _sched(storage, hicache_write_policy="write_through")
    submit(sched, "a", prompt, 4)
    run(sched)
    # Pages 3.. are gone (deleted as corrupt, or another engine's volume was wiped).
    keys = page_keys(engine_seed("fake", "", "float32", 2, 1, 4), "", as_tokens(prompt), 0, 7, 16)
    for k in keys[3:]:
        storage.pop(k, None)
    sched, worker = _sched(storage)
    submit(sched, "b", prompt, 4)
    got = run(sched)["b"]
    assert got.cached_tokens == 48 and list(got.token_ids) == expected(prompt, 4)
    sched.check_idle()

    # A batch whose answer lacks the load (it failed): the request is computed.
    sched, worker = _sched(storage)
    real = worker.forward

    def forgetful(batch):
        result = real(batch)
        del result.storage_loads[:]
        return result

    worker.forward = forgetful  # type: ignore[method-assign]
    submit(sched, "c", prompt, 4)
    got = run(sched)["c"]
    assert got.cached_tokens == 0 and list(got.token_ids) == expected(prompt, 4)
    assert sched.stats().storage_missed_tokens > 0 and sched.stats().storage_failed_loads == 1
    sched.check_idle()


def test_an_aborted_request_waiting_on_storage_leaves_nothing_held():
    storage: dict = {}
    prompt = list(range(1, 120))
    sched, _ = _sched(storage, hicache_write_policy="write_through")
    submit(sched, "a", prompt, 4)
    run(sched)
    sched, _ = _sched(storage)
    submit(sched, "b", prompt, 4)
    sched.abort("b", "client went away")
    run(sched)
    sched.check_idle()
    submit(sched, "c", prompt, 4)  # the aborted request's load still filled the tree
    assert run(sched)["c"].cached_tokens == 112


def test_flush_keeps_the_volume_unless_asked_and_says_when_there_is_none():
    storage: dict = {}
    sched, _ = _sched(storage, hicache_write_policy="write_through")
    submit(sched, "a", list(range(1, 80)), 4)
    run(sched)
    assert sched.flush_cache().flushed and storage  # device and host tiers only
    reply = sched.flush_cache(storage=True)
    assert reply.flushed and "storage tier included" in reply.message
    run(sched)  # the deletion rides on the next batch
    assert not storage
    plain, _ = make(num_slots=256, host_slots=512)
    reply = plain.flush_cache(storage=True)
    assert not reply.flushed and "--hicache-storage-dir" in reply.message


def test_a_worker_lost_mid_load_leaves_nothing_held_and_its_successor_loads_again():
    """kill -9 of the worker while a storage load is in flight: the request fails
    UNAVAILABLE, the load's host slots come back, and the restarted worker (new, empty
    tiers on the same volume) loads the pages again, token-exact."""
    from tests.fake_worker import FakeWorker, FakeWorkerSocket

    storage: dict = {}
    prompt = list(range(1, 120))
    sched, _ = _sched(storage, hicache_write_policy="write_through")
    submit(sched, "a", prompt, 4)
    run(sched)
    sched, _ = _sched(storage)
    sock = sched.link.sock
    real_send = sock.send

    def killed_on_load(payload, flags=0, copy=True):  # the worker dies with the load's batch
        if any(c.direction == 4 for c in _copies(payload)):
            sched.link.lost = lambda: "the worker's socket closed"
            return
        real_send(payload, flags, copy)

    sock.send = killed_on_load
    submit(sched, "b", prompt, 4)
    with pytest.raises(WorkerLost):
        sched.step()
    assert sched.kv.cache.storage is not None and sched.kv.cache.storage.pending
    assert sched.fail_all("the engine lost its worker") == 1
    sched.check_idle()
    worker = FakeWorker(1024, 4, host_slots=4096, storage=storage, storage_page_tokens=16)
    sched.attach_worker(FakeWorkerSocket(worker), worker.info)
    submit(sched, "c", prompt, 4)
    got = run(sched)["c"]
    assert got.cached_tokens == 112 and list(got.token_ids) == expected(prompt, 4)
    assert got.cached_storage_tokens == 112
    sched.check_idle()


def _copies(payload: bytes) -> list:
    msg = engine_pb2.SchedulerToWorker()
    msg.ParseFromString(bytes(payload))
    return list(msg.forward.copies) if msg.HasField("forward") else []
