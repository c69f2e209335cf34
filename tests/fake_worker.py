"""A model-free worker that makes KV mistakes visible, for scheduler tests.

Its "KV pool" stores, per slot, the (token, position) written there. Each request's next
token is a hash of the tokens it reads back through its table row, so a scheduler that
hands out a wrong, stale or reused slot produces different tokens than `expected()`, which
computes the same hash over the true sequence. Speaks the real protobuf messages.

A verify step (speculative decoding: draft_tokens) is run as the real worker runs it: the
last token and the drafts are written to their slots, the "model" gives its token after
each of them (read back through the slots, like any other), and the longest prefix of
drafts equal to those tokens is accepted, plus the token after it.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable

from radixserve.internal.v1 import engine_pb2
from services.common.config import SchedulerConfig
from services.common.transport import pack_i32, unpack_i32
from services.scheduler.scheduler import Scheduler

VOCAB = 1000
EOS = 999


def next_token(context: list[int]) -> int:
    digest = hashlib.blake2b(repr(context).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % (VOCAB - 1)  # never EOS: lengths stay predictable


def copying_model(period: int, every: int = 8) -> Callable[[list[int]], int]:
    """A copy-prone fake model (speculation tests): it repeats the token ``period`` back,
    except where the hash of the whole context says otherwise (one step in ``every``), so
    it still depends on every slot read back and drafts from its own text mostly succeed."""

    def model(context: list[int]) -> int:
        h = next_token(context)
        if len(context) < period or h % every == 0:
            return h
        return context[-period] if context[-period] >= 0 else h

    return model


def fake_logprob(context: list[int]) -> float:
    """The fake "logprob" of whatever follows context (prompt logprobs)."""
    return -next_token(context) / VOCAB


def expected_prompt_logprobs(prompt: list[int], start: int = 0) -> list[tuple[int, float]]:
    """(token, fake logprob) of prompt[q] for q from max(start, 1) on."""
    return [(prompt[q], fake_logprob(prompt[:q])) for q in range(max(start, 1), len(prompt))]


def expected(
    prompt: list[int], max_tokens: int, model: Callable[[list[int]], int] = next_token
) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(model(seq))
        seq.append(out[-1])
    return out


class FakeWorker:
    def __init__(
        self,
        num_slots: int,
        max_running: int = 16,
        max_model_len: int = 4096,
        host_slots: int = 0,
        storage: dict[bytes, list[tuple[int, int]]] | None = None,
        storage_page_tokens: int = 0,
        model: Callable[[list[int]], int] = next_token,
    ):
        self.model = model  # the next token after a context read back through the slots
        self.pool: dict[int, tuple[int, int]] = {}
        self.host: dict[int, tuple[int, int]] = {}  # the host tier's slots, alike
        self.host_slots = host_slots
        # The storage tier: page key -> the page's (token, position) per slot. Pass one dict
        # to several workers for a volume they share (or a worker restarted on it).
        self.storage = storage
        self.storage_page_tokens = storage_page_tokens if storage is not None else 0
        self.copied = {"d2h": 0, "h2d": 0, "d2s": 0, "s2h": 0}
        self.rows: dict[int, list[int]] = {}
        self.last: dict[int, int] = {}  # req_slot -> token sampled last (overlap schedule input)
        self.num_slots = num_slots
        self.batches: list[engine_pb2.ForwardBatch] = []
        # Set: each result reports this many seconds of forward time (a cost model).
        self.step_time: Callable[[engine_pb2.ForwardBatch], float] | None = None
        self.info = engine_pb2.WorkerInfo(
            model_id="fake",
            architecture="Fake",
            vocab_size=VOCAB,
            max_model_len=max_model_len,
            max_total_num_tokens=num_slots,
            max_running_requests=max_running,
            device="cpu",
            dtype="float32",
            num_parameters=1000,
            num_layers=2,
            hidden_size=8,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=4,
            intermediate_size=16,
            eos_token_ids=[EOS],
            host_total_num_tokens=host_slots,
            storage_page_tokens=self.storage_page_tokens,
        )

    def forward(self, batch: engine_pb2.ForwardBatch) -> engine_pb2.ForwardResult:
        self.batches.append(batch)
        result = engine_pb2.ForwardResult(batch_id=batch.batch_id)
        for c in batch.copies:  # before the forward, in order, as the real worker
            if c.direction >= engine_pb2.KVCopy.DIRECTION_DEVICE_TO_STORAGE:
                self._storage_copy(c, result)
            else:
                self._copy(c)
        if self.step_time is not None:
            result.forward_time = self.step_time(batch)
        for r in batch.reqs:
            ids, out = unpack_i32(r.input_ids).tolist(), unpack_i32(r.out_slots).tolist()
            drafts = unpack_i32(r.draft_tokens).tolist()
            assert not drafts or (r.sample and not r.use_last_sampled and not batch.is_decode)
            ids += drafts
            if r.use_last_sampled:
                assert not ids and r.req_slot in self.last, (
                    "use_last_sampled without a sampled token"
                )
                ids = [self.last[r.req_slot]]
            assert len(ids) == len(out) > 0, "input_ids and out_slots differ in length"
            assert all(0 < s <= self.num_slots for s in out), f"slot out of range in {out}"
            row = self.rows.setdefault(r.req_slot, [])
            if r.is_new:
                row[:] = unpack_i32(r.prefix_slots).tolist()
            assert len(row) >= r.prefix_len, "prefix_len beyond what the table row holds"
            del row[r.prefix_len :]
            for i, (tok, slot) in enumerate(zip(ids, out, strict=True)):
                self.pool[slot] = (tok, r.prefix_len + i)
            row.extend(out)
            context = []
            for pos, slot in enumerate(row):
                tok, where = self.pool.get(slot, (-1, -1))
                context.append(tok if where == pos else -1)  # a slot written for another position
            tok = self.model(context) if r.sample else -1
            committed = [tok]
            if drafts:  # the token after the last input token, then after each draft
                end = len(context) - len(drafts)
                committed = [self.model(context[:end])]
                for d in drafts:
                    if committed[-1] != d:
                        break
                    end += 1
                    committed.append(self.model(context[:end]))
            if r.sample:
                self.last[r.req_slot] = committed[-1]
            scored = result.tokens.add(token_id=committed[0], extra_token_ids=committed[1:])
            for k, target in enumerate(unpack_i32(r.prompt_logprob_targets).tolist()):
                # Scored through the KV read back, like the sampled token.
                end = r.prefix_len + r.prompt_logprob_row + k + 1
                scored.prompt_logprobs.add(token_id=target, logprob=fake_logprob(context[:end]))
        return result

    def _copy(self, c: engine_pb2.KVCopy) -> None:
        src, dst = unpack_i32(c.src_slots).tolist(), unpack_i32(c.dst_slots).tolist()
        assert len(src) == len(dst) > 0, "a KV copy of mismatched or no slots"
        to_host = c.direction == engine_pb2.KVCopy.DIRECTION_DEVICE_TO_HOST
        frm, to = (self.pool, self.host) if to_host else (self.host, self.pool)
        top_src, top_dst = (
            (self.num_slots, self.host_slots) if to_host else (self.host_slots, self.num_slots)
        )
        assert all(0 < s <= top_src for s in src) and all(0 < d <= top_dst for d in dst)
        for s_, d in zip(src, dst, strict=True):
            to[d] = frm.get(s_, (-1, -1))  # an unwritten slot copies as garbage
        self.copied["d2h" if to_host else "h2d"] += len(src)

    def _storage_copy(self, c: engine_pb2.KVCopy, result: engine_pb2.ForwardResult) -> None:
        assert self.storage is not None, "a storage copy to a worker without a storage tier"
        if c.direction == engine_pb2.KVCopy.DIRECTION_STORAGE_CLEAR:
            self.storage.clear()
            return
        p, raw = self.storage_page_tokens, c.keys
        keys = [raw[i : i + 16] for i in range(0, len(raw), 16)]
        assert keys and len(raw) == 16 * len(keys)
        if c.direction == engine_pb2.KVCopy.DIRECTION_DEVICE_TO_STORAGE:
            src = unpack_i32(c.src_slots).tolist()
            assert len(src) == p * len(keys) and all(0 < s <= self.num_slots for s in src)
            for i, key in enumerate(keys):
                page = [self.pool.get(s, (-1, -1)) for s in src[i * p : (i + 1) * p]]
                self.storage.setdefault(key, page)  # the first writer's page stays
            self.copied["d2s"] += len(src)
            return
        dst = unpack_i32(c.dst_slots).tolist()
        assert len(dst) == p * len(keys) and all(0 < d <= self.host_slots for d in dst)
        found = 0
        for key in keys:
            page = self.storage.get(key)
            if page is None:
                break
            for d, kv in zip(dst[found * p : (found + 1) * p], page, strict=True):
                self.host[d] = kv
            found += 1
        self.copied["s2h"] += found * p
        result.storage_loads.add(load_id=c.load_id, pages=found)


class FakeWorkerSocket:
    """Stands in for the scheduler's DEALER socket: each send is run at once, replies queue up."""

    def __init__(self, worker: FakeWorker):
        self.worker = worker
        self.replies: deque[bytes] = deque()  # in order, as the real worker answers

    def send(self, payload, flags: int = 0, copy: bool = True):
        msg = engine_pb2.SchedulerToWorker()
        msg.ParseFromString(bytes(payload))
        if msg.HasField("info"):
            out = engine_pb2.WorkerToScheduler(info=self.worker.info)
        else:
            out = engine_pb2.WorkerToScheduler(result=self.worker.forward(msg.forward))
        self.replies.append(out.SerializeToString())

    def poll(self, timeout: int = 0) -> bool:
        return bool(self.replies)

    def recv(self, flags: int = 0) -> bytes:
        return self.replies.popleft()


# -- driving a real Scheduler against the fake worker (unit and property tests) ----------
FRONTEND = b"frontend-1"


def make(
    num_slots: int = 4096,
    max_running: int = 16,
    host_slots: int = 0,
    storage: dict | None = None,
    storage_page_tokens: int = 16,
    model: Callable[[list[int]], int] = next_token,
    **cfg,
) -> tuple[Scheduler, FakeWorker]:
    worker = FakeWorker(
        num_slots, max_running, host_slots=host_slots, storage=storage,
        storage_page_tokens=storage_page_tokens, model=model,
    )  # fmt: skip
    sched = Scheduler(SchedulerConfig(**cfg), FakeWorkerSocket(worker), worker.info)
    return sched, worker


def submit(sched: Scheduler, rid: str, prompt: list[int], max_tokens: int, **kw) -> None:
    sampling = engine_pb2.SamplingParams(max_tokens=max_tokens, temperature=0)
    msg = engine_pb2.TokenizedRequest(rid=rid, input_ids=pack_i32(prompt), sampling=sampling, **kw)
    sched.add_request(FRONTEND, msg)


def run(
    sched: Scheduler, max_steps: int = 100_000, on_step=None
) -> dict[str, engine_pb2.TokenDelta]:
    """Steps until idle; returns each request's tokens and final delta."""
    tokens: dict[str, list[int]] = {}
    final: dict[str, engine_pb2.TokenDelta] = {}

    def collect() -> None:
        for deltas in sched.outbox.take().values():
            for d in deltas:
                tokens.setdefault(d.rid, []).extend(d.token_ids)
                if d.finish_reason:
                    final[d.rid] = d

    for step in range(max_steps):
        worked = sched.step()
        collect()
        if on_step:
            on_step(step)
        if not worked:
            sched.check_idle()
            if not sched.has_requests():  # on_step may have submitted more
                break
    collect()  # what on_step's last call emitted (a request it submitted and aborted)
    for rid, d in final.items():
        d.token_ids[:] = tokens.get(rid, [])
    return final


# A workload request: (which shared prefix, own tail, max_tokens, the step it arrives at).
Arrival = tuple[int, list[int], int, int]


def run_arrivals(
    sched: Scheduler, reqs: list[Arrival], prefixes: list[list[int]], aborts: dict[int, int]
) -> None:
    """Runs the requests, each submitted at its step (at once if the engine went idle
    before it), request i aborted at step ``aborts[i]``; every one that is not aborted
    gets exactly the tokens of its true sequence, an aborted one a prefix of them."""
    want, arrivals = {}, {}
    for i, (p, tail, n, at) in enumerate(reqs):
        prompt = prefixes[p] + tail
        want[f"r{i}"] = expected(prompt, n)
        arrivals.setdefault(at, []).append((f"r{i}", prompt, n))
    plan = {step: f"r{i}" for i, step in aborts.items() if i < len(reqs)}
    for rid, prompt, n in arrivals.pop(0, []):
        submit(sched, rid, prompt, n)

    def on_step(step: int) -> None:
        # The engine went idle before a later arrival: it comes now, so run() goes on.
        due = step if sched.has_requests() else max(arrivals, default=step)
        for at in [at for at in arrivals if at <= due]:
            for rid, prompt, n in arrivals.pop(at):
                submit(sched, rid, prompt, n)
        if step in plan:
            sched.abort(plan[step], "test abort")

    got = run(sched, on_step=on_step)
    assert set(got) == set(want)
    for rid, d in got.items():
        if d.finish_reason == "abort" and rid in plan.values():
            assert list(d.token_ids) == want[rid][: len(d.token_ids)]  # a prefix of the truth
        else:
            assert (list(d.token_ids), d.finish_reason) == (want[rid], "length"), rid


def assert_pool_whole(sched: Scheduler) -> None:
    """Idle: no request holds KV, nothing is locked, every slot is free or evictable cache."""
    size = sched.kv.cache.size_info()
    assert size.protected == 0 and sched.kv.held_by_requests() == 0
    assert sched.kv.allocator.num_free + size.evictable == sched.kv.total
