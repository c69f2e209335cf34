"""The scheduler's side of constrained decoding, against a fake worker: a constrained
request takes no KV until its grammar is ready, a refused grammar ends it with the
compiler's message, the worker's grammar verdicts end requests alone."""

from __future__ import annotations

from radixserve.internal.v1 import engine_pb2
from services.common.config import SchedulerConfig
from services.common.transport import pack_i32
from services.scheduler.scheduler import Scheduler
from tests.fake_worker import FRONTEND, FakeWorker, FakeWorkerSocket, expected, run


class GrammarFakeWorker(FakeWorker):
    """Settles each grammar after ``delay`` batches (ready, or ``errors[rid]``); ends a
    request by its grammar after ``terminate_after[rid]`` tokens or rejects at ``reject_at``."""

    def __init__(self, delay: int = 3, **kw):
        super().__init__(4096, **kw)
        self.delay = delay
        self.errors: dict[str, tuple[str, str]] = {}
        self.terminate_after: dict[str, int] = {}
        self.reject_at: dict[str, int] = {}
        self.dead_end_at: dict[str, int] = {}
        self.pending: dict[str, int] = {}
        self.generated: dict[str, int] = {}
        self.asked: list[str] = []

    def forward(self, batch: engine_pb2.ForwardBatch) -> engine_pb2.ForwardResult:
        for g in batch.grammars:
            self.asked.append(g.rid)
            self.pending[g.rid] = self.delay
        result = super().forward(batch)
        for r, tok in zip(batch.reqs, result.tokens, strict=True):
            if r.sample:
                n = self.generated[r.rid] = self.generated.get(r.rid, 0) + 1
                if n == self.terminate_after.get(r.rid):
                    tok.grammar_terminated = True
                if n == self.reject_at.get(r.rid):
                    tok.grammar_error = (
                        f"the grammar rejected the sampled token (id {tok.token_id})"
                    )
                if n == self.dead_end_at.get(r.rid):
                    tok.grammar_error = "the constraint allows no token here"
                    tok.grammar_dead_end = True
        for rid in list(self.pending):
            self.pending[rid] -= 1
            if self.pending[rid] <= 0:
                del self.pending[rid]
                error, code = self.errors.get(rid, ("", ""))
                result.grammars.add(rid=rid, error=error, error_code=code)
        return result


def _make(worker: GrammarFakeWorker, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), FakeWorkerSocket(worker), worker.info)


def _submit(
    sched: Scheduler, rid: str, prompt: list[int], max_tokens: int, regex: str = ""
) -> None:
    sp = engine_pb2.SamplingParams(max_tokens=max_tokens, temperature=0)
    if regex:
        sp.constraint.regex = regex
    sched.add_request(
        FRONTEND, engine_pb2.TokenizedRequest(rid=rid, input_ids=pack_i32(prompt), sampling=sp)
    )


def _batches_with(worker: FakeWorker, rid: str) -> list[int]:
    return [i for i, b in enumerate(worker.batches) if any(r.rid == rid for r in b.reqs)]


def test_constrained_request_waits_for_its_grammar_without_kv():
    worker = GrammarFakeWorker(delay=6)
    sched = _make(worker)
    _submit(sched, "free", [1, 2, 3, 4], 12)
    _submit(sched, "c", [5, 6, 7, 8], 4, regex=r"\d+")
    final = run(sched)
    assert final["free"].token_ids == expected([1, 2, 3, 4], 12)
    assert final["c"].finish_reason == "length" and len(final["c"].token_ids) == 4
    assert worker.asked == ["c"]  # asked once
    first_c = _batches_with(worker, "c")[0]
    asked_in = next(i for i, b in enumerate(worker.batches) if b.grammars)
    assert first_c >= asked_in + worker.delay - 1  # not scheduled before it was ready
    # The unconstrained request decoded while the grammar compiled.
    assert any(i < first_c for i in _batches_with(worker, "free")[1:])
    carried = next(r for r in worker.batches[first_c].reqs if r.rid == "c")
    assert carried.is_new and carried.sampling.constraint.regex == r"\d+"


def test_grammar_only_batches_when_nothing_else_runs():
    worker = GrammarFakeWorker(delay=3)
    sched = _make(worker)
    _submit(sched, "c", [5, 6, 7], 2, regex="a+")
    final = run(sched)
    assert final["c"].finish_reason == "length"
    assert not worker.batches[0].reqs and worker.batches[0].grammars  # a poll batch first


def test_refused_grammar_ends_the_request_before_any_kv():
    worker = GrammarFakeWorker(delay=2)
    worker.errors["bad"] = ("Regex parsing error at position 1: Unclosed '['", "INVALID_ARGUMENT")
    sched = _make(worker)
    _submit(sched, "free", [1, 2, 3], 8)
    _submit(sched, "bad", [4, 5, 6], 8, regex="[")
    final = run(sched)
    bad = final["bad"]
    assert bad.finish_reason == "abort" and bad.error_code == "INVALID_ARGUMENT"
    assert "Unclosed" in bad.finish_message
    assert not _batches_with(worker, "bad") and not bad.token_ids
    assert final["free"].token_ids == expected([1, 2, 3], 8)
    sched.check_idle()  # nothing leaked


def test_timeout_status_reaches_the_request():
    worker = GrammarFakeWorker(delay=1)
    worker.errors["slow"] = (
        "did not compile within --grammar-compile-timeout (10 s)",
        "DEADLINE_EXCEEDED",
    )
    sched = _make(worker)
    _submit(sched, "slow", [4, 5, 6], 8, regex="a")
    final = run(sched)
    assert final["slow"].error_code == "DEADLINE_EXCEEDED"
    assert "grammar-compile-timeout" in final["slow"].finish_message


def test_grammar_end_finishes_with_stop_and_rejection_aborts_alone():
    worker = GrammarFakeWorker(delay=1)
    worker.terminate_after["done"] = 3
    worker.reject_at["broken"] = 2
    sched = _make(worker)
    _submit(sched, "done", [1, 2, 3], 20, regex="a")
    _submit(sched, "broken", [4, 5, 6], 20, regex="b")
    _submit(sched, "free", [7, 8, 9], 10)
    final = run(sched)
    assert final["done"].finish_reason == "stop" and len(final["done"].token_ids) == 3
    assert final["done"].matched_stop_token == -1
    broken = final["broken"]
    assert broken.finish_reason == "abort" and broken.error_code == "INTERNAL"
    assert "rejected" in broken.finish_message and len(broken.token_ids) == 1
    assert final["free"].token_ids == expected([7, 8, 9], 10)
    sched.check_idle()


def test_a_grammar_dead_end_is_the_clients_error_and_frees_its_kv():
    worker = GrammarFakeWorker(delay=1)
    worker.dead_end_at["dead"] = 3
    sched = _make(worker)
    _submit(sched, "dead", [1, 2, 3], 20, regex="a")
    _submit(sched, "free", [7, 8, 9], 10)
    final = run(sched)
    dead = final["dead"]
    assert dead.finish_reason == "abort" and dead.error_code == "INVALID_ARGUMENT"
    assert "after 2 tokens" in dead.finish_message and "allows no token" in dead.finish_message
    assert final["free"].token_ids == expected([7, 8, 9], 10)
    sched.check_idle()


def test_aborted_while_compiling_is_dropped():
    worker = GrammarFakeWorker(delay=4)
    sched = _make(worker)
    _submit(sched, "c", [5, 6, 7], 4, regex="a")
    sched.step()
    sched.abort("c", "cancelled by the client")
    final = run(sched)
    assert final["c"].finish_reason == "abort"
    assert not _batches_with(worker, "c")
    sched.check_idle()
