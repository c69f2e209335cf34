"""The scheduler loop against a model-free worker that detects any wrong KV slot."""

from __future__ import annotations

import math
import random
import re

import pytest

from radixserve.internal.v1 import engine_pb2
from services.common.config import SchedulerConfig
from services.common.transport import pack_i32
from services.scheduler.scheduler import Scheduler
from services.scheduler.step_costs import MIN_TOKENS, StepCosts
from tests.fake_worker import FRONTEND, FakeWorker, FakeWorkerSocket, expected, make, run, submit


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 900) for _ in range(n)]


def test_single_request_then_cache_hit():
    sched, _ = make()
    prompt = list(range(1, 41))
    submit(sched, "a", prompt, 8)
    first = run(sched)["a"]
    assert list(first.token_ids) == expected(prompt, 8)
    assert (
        first.finish_reason,
        first.prompt_tokens,
        first.cached_tokens,
        first.completion_tokens,
    ) == ("length", 40, 0, 8)
    submit(sched, "b", prompt, 8)
    second = run(sched)["b"]
    assert list(second.token_ids) == expected(prompt, 8)
    assert second.cached_tokens == 39  # everything but the last prompt token


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("policy", ["lpm", "fcfs", "dfs-weight", "lof", "random", "priority"])
def test_concurrent_shared_prefixes_are_token_exact(page_size, policy):
    rng = random.Random(7)
    sched, _ = make(
        num_slots=6000, page_size=page_size, schedule_policy=policy, chunked_prefill_size=64
    )
    systems = [rand_prompt(rng, rng.randrange(20, 120)) for _ in range(4)]
    want = {}
    for i in range(40):
        prompt = rng.choice(systems) + rand_prompt(rng, rng.randrange(1, 30))
        n = rng.randrange(1, 24)
        want[f"r{i}"] = expected(prompt, n)
        submit(sched, f"r{i}", prompt, n)
    got = run(sched)
    assert {rid: list(d.token_ids) for rid, d in got.items()} == want
    assert sum(d.cached_tokens for d in got.values()) > 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_small_pool_forces_retraction_and_stays_exact(page_size, caplog):
    rng = random.Random(3)
    sched, _ = make(num_slots=640, max_running=16, page_size=page_size, chunked_prefill_size=48)
    want = {}
    for i in range(24):
        prompt = rand_prompt(rng, rng.randrange(10, 60))
        want[f"r{i}"] = expected(prompt, 100)
        submit(sched, f"r{i}", prompt, 100)
    with caplog.at_level("WARNING", logger="radixserve.scheduler"):
        got = run(sched)
    assert {rid: list(d.token_ids) for rid, d in got.items()} == want
    assert "Retract requests" in caplog.text


def test_abort_mid_decode_frees_every_slot():
    sched, _ = make(num_slots=2000)
    submit(sched, "keep", list(range(1, 30)), 20)
    submit(sched, "gone", list(range(100, 150)), 200)

    def abort_at(step):
        if step == 5:
            sched.abort("gone", "client cancelled")

    got = run(sched, on_step=abort_at)
    assert got["gone"].finish_reason == "abort"
    assert 0 < got["gone"].completion_tokens < 200
    assert list(got["keep"].token_ids) == expected(list(range(1, 30)), 20)
    size = sched.kv.cache.size_info()
    assert sched.kv.allocator.num_free + size.evictable == sched.kv.total and size.protected == 0


def test_flush_refused_while_running_then_removes_hits():
    sched, _ = make()
    prompt = list(range(1, 60))
    submit(sched, "a", prompt, 4)
    refused = sched.flush_cache()
    assert not refused.flushed and "1 waiting" in refused.message
    run(sched)
    assert sched.flush_cache().flushed
    assert sched.kv.allocator.num_free == sched.kv.total
    submit(sched, "b", prompt, 4)
    assert run(sched)["b"].cached_tokens == 0


def test_disabled_cache_never_hits():
    sched, _ = make(disable_radix_cache=True)
    prompt = list(range(1, 50))
    for rid in ("a", "b"):
        submit(sched, rid, prompt, 5)
        d = run(sched)[rid]
        assert d.cached_tokens == 0 and list(d.token_ids) == expected(prompt, 5)


def test_cache_salt_separates_namespaces():
    sched, _ = make()
    prompt = list(range(1, 50))
    submit(sched, "a", prompt, 2, cache_salt="tenant-a")
    run(sched)
    submit(sched, "b", prompt, 2, cache_salt="tenant-b")
    assert run(sched)["b"].cached_tokens == 0
    submit(sched, "c", prompt, 2, cache_salt="tenant-a")
    assert run(sched)["c"].cached_tokens == len(prompt) - 1


def test_too_large_request_is_rejected_and_server_keeps_serving():
    sched, _ = make(num_slots=100)
    submit(sched, "big", list(range(1, 90)), 50)
    got = run(sched)["big"]
    assert got.error_code == "RESOURCE_EXHAUSTED" and "needs 139 KV slots" in got.finish_message
    submit(sched, "ok", list(range(1, 20)), 5)
    assert list(run(sched)["ok"].token_ids) == expected(list(range(1, 20)), 5)


def test_concurrent_shared_prefix_is_computed_once():
    """Seed experiment 5 in miniature: 30 requests sent at once share a 300-token prefix."""
    rng = random.Random(5)
    prefix = rand_prompt(rng, 300)
    sched, worker = make(num_slots=20000, max_running=32)
    for i in range(30):
        submit(sched, f"r{i}", prefix + [901 + i % 90], 1)
    got = run(sched)
    hit = sum(d.cached_tokens for d in got.values()) / sum(d.prompt_tokens for d in got.values())
    assert hit > 0.9
    computed = sum(len(r.input_ids) // 4 for b in worker.batches for r in b.reqs)
    assert computed < 2 * 301 + 30


def test_eos_stops_unless_ignored():
    sched, _ = make()
    prompt = list(range(1, 20))
    first = expected(prompt, 1)[0]
    sched.info.eos_token_ids.append(first)  # the first token the fake model emits is "EOS"
    submit(sched, "a", prompt, 10)
    got = run(sched)["a"]
    assert (
        got.finish_reason == "stop"
        and got.completion_tokens == 1
        and got.matched_stop_token == first
    )
    msg_sampling = engine_pb2.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    sched.add_request(
        FRONTEND,
        engine_pb2.TokenizedRequest(rid="b", input_ids=pack_i32(prompt), sampling=msg_sampling),
    )
    assert run(sched)["b"].completion_tokens == 10


def test_a_restarted_worker_stops_the_scheduler():
    """A new worker process has an empty KV pool: the tree's slots would read garbage."""
    from services.scheduler.worker_link import WorkerError

    worker = FakeWorker(1000)
    worker.info.instance_id = "first"
    sched = Scheduler(SchedulerConfig(), FakeWorkerSocket(worker), worker.info)
    original = worker.forward

    def forward(batch):
        result = original(batch)
        result.worker_instance = "first" if batch.batch_id == 1 else "second"
        return result

    worker.forward = forward
    submit(sched, "a", list(range(1, 20)), 5)
    assert sched.step()  # batch 1: same worker
    with pytest.raises(WorkerError, match="restarted"):
        sched.step()


@pytest.mark.parametrize("page_size", [1, 16])
def test_overlap_schedule_is_exact_and_really_overlaps(page_size):
    """Same tokens with and without the overlap schedule, EOS seen a step late included."""
    rng = random.Random(11)
    prompts = [rand_prompt(rng, rng.randrange(5, 70)) for _ in range(20)]
    lengths = [rng.randrange(1, 40) for _ in prompts]
    eos = expected(prompts[3], 5)[4]  # request 3 stops at its 5th token; others may too
    got = {}
    for overlap in (False, True):
        sched, worker = make(
            num_slots=900,
            page_size=page_size,
            chunked_prefill_size=32,
            disable_overlap_schedule=not overlap,
        )
        sched.info.eos_token_ids.append(eos)
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
            submit(sched, f"r{i}", p, n)
        got[overlap] = {rid: (list(d.token_ids), d.finish_reason) for rid, d in run(sched).items()}
        ahead = sum(r.use_last_sampled for b in worker.batches for r in b.reqs)
        assert (ahead > 0) == overlap
    assert got[True] == got[False]
    assert got[True]["r3"] == (expected(prompts[3], 5), "stop")
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        toks = expected(p, n)
        cut = toks.index(eos) + 1 if eos in toks else n
        assert got[True][f"r{i}"][0] == toks[:cut]


@pytest.mark.parametrize("overlap", [True, False])
def test_batch_log_lines_in_sglang_format(overlap, caplog):
    sched, _ = make(decode_log_interval=5, disable_overlap_schedule=not overlap)
    submit(sched, "a", list(range(1, 26)), 30)
    with caplog.at_level("INFO", logger="radixserve.scheduler"):
        run(sched)
    assert re.search(
        r"Prefill batch\. #new-seq: 1, #new-token: 25, #cached-token: 0, token usage: \d\.\d\d, "
        r"#running-req: 0, #queue-req: 0, cuda graph: False",
        caplog.text,
    )
    decode = re.findall(
        r"Decode batch\. #running-req: \d+, #token: \d+, token usage: \d\.\d\d, cuda graph: False, "
        r"gen throughput \(token/s\): [\d.]+, #queue-req: 0",
        caplog.text,
    )
    assert len(decode) == 29 // 5  # 29 decode steps after the prefill's first token


@pytest.mark.parametrize("overlap", [True, False])
def test_finished_request_leaves_all_but_its_last_token(overlap):
    """A stop seen a step late (overlap) still leaves prompt + output - 1 tokens in the tree."""
    prompt = list(range(1, 30))
    sched, _ = make(disable_overlap_schedule=not overlap)
    sched.info.eos_token_ids.append(expected(prompt, 6)[5])  # stops at its 6th token
    submit(sched, "a", prompt, 50)
    got = run(sched)["a"]
    assert (got.finish_reason, got.completion_tokens) == ("stop", 6)
    assert sched.kv.cache.size_info().evictable == len(prompt) + 6 - 1


# -- mixed batches: prefill tokens ride along with the running requests' decode steps ----
def _stall_workload(sched, rng, late_at: int = 3):
    """4 streams decoding, then 3 long prompts arriving at step ``late_at``."""
    want, late = {}, {}
    for i in range(4):
        prompt = rand_prompt(rng, rng.randrange(5, 30))
        want[f"d{i}"] = expected(prompt, 40)
        submit(sched, f"d{i}", prompt, 40)
    for i in range(3):
        late[f"p{i}"] = rand_prompt(rng, rng.randrange(150, 300))
        want[f"p{i}"] = expected(late[f"p{i}"], 5)

    def arrive(step):
        if step == late_at:
            for rid, prompt in late.items():
                submit(sched, rid, prompt, 5)

    return want, arrive


def _prefill_tokens(batch) -> int:
    return sum(len(r.input_ids) // 4 for r in batch.reqs if len(r.input_ids) // 4 > 1)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("overlap", [True, False])
def test_mixed_batches_keep_every_stream_decoding_and_stay_exact(page_size, overlap):
    got = {}
    for mixed in (0, 64):
        sched, worker = make(
            num_slots=3000,
            page_size=page_size,
            mixed_prefill_tokens=mixed,
            disable_overlap_schedule=not overlap,
        )
        want, arrive = _stall_workload(sched, random.Random(21))
        got[mixed] = {rid: list(d.token_ids) for rid, d in run(sched, on_step=arrive).items()}
        assert got[mixed] == want
        mixed_batches = [
            b for b in worker.batches if not b.is_decode and any(not r.is_new for r in b.reqs)
        ]
        if mixed:
            # The long prompts ran as 64-token slices, each beside all 4 streams' next token.
            assert len(mixed_batches) >= sum(150 // 64 for _ in range(3))
            assert all(_prefill_tokens(b) <= 64 for b in worker.batches[1:])
            assert all(sum(r.rid.startswith("d") for r in b.reqs) == 4 for b in mixed_batches)
        else:
            assert not any(
                b.reqs[0].rid.startswith("p") and any(r.rid.startswith("d") for r in b.reqs)
                for b in worker.batches
            )
    assert got[0] == got[64]


@pytest.mark.parametrize("overlap", [True, False])
def test_mixed_batches_shrink_where_prefill_tokens_are_slow(overlap):
    """A model whose prefill tokens cost much against its decode step (a large model on a
    CPU): by the forward times the worker reports (0.1 s a decode step, 4 ms a prefill
    token), a mixed batch within --mixed-step-slowdown 2.5 decode steps carries at most
    1.5 x 0.1 / 0.004 = 37 prefill tokens, not --mixed-prefill-tokens 128; 0 keeps 128."""
    got, largest = {}, {}
    for slowdown in (2.5, 0.0):
        sched, worker = make(
            num_slots=3000, mixed_prefill_tokens=128, mixed_step_slowdown=slowdown,
            disable_overlap_schedule=not overlap,
        )  # fmt: skip
        worker.step_time = lambda b: (
            0.1 * any(len(r.input_ids) // 4 <= 1 for r in b.reqs) + 0.004 * _prefill_tokens(b)
        )
        want, arrive = _stall_workload(sched, random.Random(21))
        got[slowdown] = {rid: list(d.token_ids) for rid, d in run(sched, on_step=arrive).items()}
        assert got[slowdown] == want
        mixed = [b for b in worker.batches if not b.is_decode and any(not r.is_new for r in b.reqs)]
        # The first mixed batch is the one that measures a prefill token.
        largest[slowdown] = max(_prefill_tokens(b) for b in mixed[1:])
    assert 30 <= largest[2.5] <= 37 < 128 == largest[0.0]


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_a_bad_mixed_step_slowdown_is_refused_naming_the_flag(value):
    with pytest.raises(ValueError, match="--mixed-step-slowdown must be a finite number >= 0"):
        SchedulerConfig(mixed_step_slowdown=value)


@pytest.mark.parametrize("field", ["max_prefill_tokens", "mixed_prefill_tokens"])
def test_a_negative_prefill_budget_is_refused_naming_the_flag(field):
    flag = "--" + field.replace("_", "-")
    with pytest.raises(ValueError, match=f"{flag} must be >= 0, got -5"):
        SchedulerConfig(**{field: -5})
    SchedulerConfig(**{field: 0})  # 0 stays the documented default / off


def test_the_cli_refuses_a_bad_mixed_step_slowdown_without_a_traceback(capsys):
    from services.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["scheduler", "--mixed-step-slowdown", "nan"])
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("radixserve scheduler: --mixed-step-slowdown")


def test_step_costs_estimate_and_cap_the_mixed_budget():
    costs = StepCosts()
    assert costs.mixed_budget(2.5, 128) == 128  # nothing measured yet
    costs.observe(decode_rows=8, prefill_tokens=128, seconds=0.5)  # no decode step known
    assert costs.token_s == 0.0
    costs.observe(decode_rows=8, prefill_tokens=0, seconds=0.1)
    costs.observe(decode_rows=0, prefill_tokens=1000, seconds=3.0)  # a prefill batch
    assert costs.mixed_budget(2.5, 128) == int(1.5 * 0.1 / 0.003) == 50
    costs.observe(decode_rows=8, prefill_tokens=50, seconds=0.1 + 50 * 0.001)  # a mixed batch
    assert costs.token_s == pytest.approx(0.003 + 0.2 * (0.001 - 0.003))
    costs.observe(decode_rows=8, prefill_tokens=0, seconds=0.0)  # not reported: ignored
    assert costs.decode_s == 0.1
    assert costs.mixed_budget(0.0, 128) == 128  # off
    assert costs.mixed_budget(1.0001, 128) == MIN_TOKENS  # never below the floor
    assert costs.mixed_budget(1000.0, 128) == 128  # the fixed budget is the ceiling
    fast = StepCosts(decode_s=0.01, token_s=1e-6)  # a GPU: prefill tokens are cheap
    assert fast.mixed_budget(2.5, 128) == 128
    for bad in (float("nan"), float("inf"), -1.0):  # a worker's garbage is ignored
        costs.observe(decode_rows=8, prefill_tokens=0, seconds=bad)
        costs.observe(decode_rows=8, prefill_tokens=50, seconds=bad)
    assert costs.decode_s == 0.1 and math.isfinite(costs.token_s)
    huge = StepCosts(decode_s=1e308, token_s=1e-300)  # finite, but the ratio overflows
    assert huge.mixed_budget(3.0, 128) == 128


@pytest.mark.parametrize("overlap", [True, False])
def test_a_burst_of_arrivals_is_admitted_in_a_few_large_mixed_batches(overlap):
    """One stream decodes when 8 more prompts arrive together: the burst rides along at
    --mixed-burst-tokens a step (its tail too, though by then more decode than wait);
    afterwards one late prompt beside the 9 streams goes back to --mixed-prefill-tokens."""
    rng = random.Random(5)
    first, burst, late = rand_prompt(rng, 20), [rand_prompt(rng, 150) for _ in range(8)], []
    want = {"first": expected(first, 60)}
    want |= {f"b{i}": expected(p, 30) for i, p in enumerate(burst)}
    late.append(rand_prompt(rng, 200))
    want["late"] = expected(late[0], 5)
    admitted_by: dict[str, int] = {}
    for budget in (512, 0):
        sched, worker = make(
            num_slots=4000, mixed_prefill_tokens=64, mixed_burst_tokens=budget,
            disable_overlap_schedule=not overlap,
        )  # fmt: skip
        submit(sched, "first", first, 60)

        def arrive(step, sched=sched):
            if step == 2:
                for i, p in enumerate(burst):
                    submit(sched, f"b{i}", p, 30)
            if step == 12:  # the burst decodes now (30 tokens each)
                submit(sched, "late", late[0], 5)

        got = run(sched, on_step=arrive)
        assert {rid: list(d.token_ids) for rid, d in got.items()} == want
        mixed = [b for b in worker.batches if not b.is_decode and any(not r.is_new for r in b.reqs)]
        burst_batches = [
            b for b in mixed if any(r.rid[0] == "b" and len(r.input_ids) > 4 for r in b.reqs)
        ]
        admitted_by[str(budget)] = len(burst_batches)
        assert all(_prefill_tokens(b) <= max(budget, 64) for b in mixed)
        late_batches = [b for b in mixed if any(r.rid == "late" for r in b.reqs)]
        assert late_batches and all(_prefill_tokens(b) <= 64 for b in late_batches)
    assert admitted_by["512"] <= 3 < 8 <= admitted_by["0"]  # 1,200 tokens: 512 vs 64 a step


@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_batches_with_retraction_stay_exact(page_size, caplog):
    rng = random.Random(8)
    sched, _ = make(
        num_slots=700,
        max_running=16,
        page_size=page_size,
        chunked_prefill_size=48,
        mixed_prefill_tokens=32,
    )
    want = {}
    late = {}
    for i in range(24):
        prompt = rand_prompt(rng, rng.randrange(10, 80))
        want[f"r{i}"] = expected(prompt, 90)
        (late if i % 2 else {}).update({f"r{i}": prompt})
        if not i % 2:
            submit(sched, f"r{i}", prompt, 90)

    def arrive(step):
        if step == 4:
            for rid, prompt in late.items():
                submit(sched, rid, prompt, 90)

    with caplog.at_level("WARNING", logger="radixserve.scheduler"):
        got = run(sched, on_step=arrive)
    assert {rid: list(d.token_ids) for rid, d in got.items()} == want
    assert "Retract requests" in caplog.text


@pytest.mark.parametrize("overlap", [True, False])
def test_aborts_during_mixed_batches_free_every_slot(overlap):
    sched, _ = make(num_slots=3000, mixed_prefill_tokens=32, disable_overlap_schedule=not overlap)
    want, arrive = _stall_workload(sched, random.Random(4), late_at=2)

    def arrive_then_abort(step):
        arrive(step)
        if step == 6:  # one stream and one half-prefilled prompt go
            sched.abort("d1", "client cancelled")
            sched.abort("p0", "client cancelled")

    got = run(sched, on_step=arrive_then_abort)
    for rid, d in got.items():
        if rid in ("d1", "p0"):
            assert d.finish_reason == "abort"
            assert list(d.token_ids) == want[rid][: len(d.token_ids)]
        else:
            assert list(d.token_ids) == want[rid], rid
    size = sched.kv.cache.size_info()
    assert sched.kv.allocator.num_free + size.evictable == sched.kv.total and size.protected == 0


def test_idle_check_counts_slots_at_once_and_walks_the_tree_only_when_full(monkeypatch):
    sched, _ = make()
    walks = []
    real = sched.kv.check
    monkeypatch.setattr(sched.kv, "check", lambda: walks.append(1) or real())
    submit(sched, "a", list(range(1, 40)), 3)
    while sched.step():
        pass
    sched.check_idle(full=False)  # just gone idle: a burst may still be arriving
    assert walks == [] and sched.snapshot.evictable_tokens == 39 + 3 - 1  # stats refreshed
    sched.check_idle(full=True)  # idle a while: the whole tree is recounted, once
    sched.check_idle(full=True)
    assert walks == [1]
    sched.dirty_since_check = True
    monkeypatch.setattr(sched.kv, "held_by_requests", lambda: 5)  # the cheap check sees it
    with pytest.raises(Exception, match="do not add up"):
        sched.check_idle(full=False)


@pytest.mark.parametrize(
    "device, setting, largest",
    [("cpu", 0, 2048), ("cuda:0", 0, 8000), ("cpu", 4096, 4096)],
)
def test_prefill_batches_are_sized_by_the_workers_device_unless_set(device, setting, largest):
    """--max-prefill-tokens 0: 2,048 new tokens a batch on a CPU worker (a batch's first
    tokens leave only when all of it is computed), 8,192 on a GPU; a setting wins."""
    rng = random.Random(11)
    prompts = [rand_prompt(rng, 1000) for _ in range(8)]
    worker = FakeWorker(20_000)
    worker.info.device = device
    cfg = SchedulerConfig(max_prefill_tokens=setting)
    sched = Scheduler(cfg, FakeWorkerSocket(worker), worker.info)
    for i, p in enumerate(prompts):
        submit(sched, f"r{i}", p, 2)
    got = run(sched)
    assert {rid: list(d.token_ids) for rid, d in got.items()} == {
        f"r{i}": expected(p, 2) for i, p in enumerate(prompts)
    }
    sizes = [_prefill_tokens(b) for b in worker.batches if not b.is_decode]
    assert max(sizes) == largest, sizes
