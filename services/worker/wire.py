"""The worker's wire format, in one place: protobuf in, plain dataclasses out, and back.

    ForwardBatch  --decode_batch-->  Batch          (checked against the runner's limits)
    ForwardOutput --encode_result--> ForwardResult
    RunnerInfo    --encode_info-->   WorkerInfo

Checks needing only the message and fixed limits happen here, before anything is written;
those needing runner state stay in the runner. main.py and offline.py both use ``forward``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Protocol

import numpy as np

from radixserve.internal.v1 import engine_pb2
from services.common.sampling_limits import LOGIT_BIAS_RANGE, MAX_TOP_LOGPROBS
from services.common.transport import unpack_i32
from services.worker.batch import (
    Batch,
    Constraint,
    ForwardOutput,
    GrammarStatus,
    PromptScore,
    ReqInput,
    RunnerInfo,
    SlotStart,
)
from services.worker.sampling import SamplingSpec


class Runner(Protocol):
    """What the wire drives: ModelRunner, or a wrapper of it (benchmarks time forward)."""

    def info(self) -> RunnerInfo: ...

    def forward(self, batch: Batch) -> ForwardOutput: ...


@dataclass(frozen=True)
class Limits:
    max_running_requests: int
    max_context: int
    vocab_size: int
    num_slots: int  # KV slots 1 .. num_slots are valid; 0 is padding

    @classmethod
    def of(cls, info: RunnerInfo) -> Limits:
        return cls(
            info.max_running_requests,
            info.max_model_len,
            info.vocab_size,
            info.max_total_num_tokens,
        )


class GrammarHost(Protocol):
    def prepare(self, rid: str, c: Constraint) -> None: ...

    def settled(self, wait_s: float = 0.0) -> list[GrammarStatus]: ...


# A batch with no requests (only waiting on grammars) is answered when a grammar settles
# or after this long, so the scheduler neither spins nor sleeps long.
GRAMMAR_POLL_WAIT_S = 0.02


def forward(runner: Runner, msg: engine_pb2.ForwardBatch) -> engine_pb2.ForwardResult:
    """One batch through ``runner``. Raises ValueError (nothing written) when malformed.
    Grammars settled by the end ride on the result."""
    grammars: GrammarHost | None = getattr(runner, "grammars", None)
    loads: list[tuple[int, int]] = []
    if msg.copies:  # before the forward that reads them
        copy_kv = getattr(runner, "copy_kv", None)
        if copy_kv is None:
            raise ValueError("this worker has no host tier")
        loads = copy_kv(list(msg.copies)) or []
    refused = _prepare_grammars(grammars, msg.grammars)
    if not msg.reqs:
        result = engine_pb2.ForwardResult(batch_id=msg.batch_id)
    else:
        batch = decode_batch(msg, Limits.of(runner.info()))
        result = encode_result(msg.batch_id, runner.forward(batch))
    wait = 0.0 if msg.reqs or msg.copies else GRAMMAR_POLL_WAIT_S
    settled = grammars.settled(wait) if grammars is not None else []
    result.grammars.extend(encode_grammar_status(st) for st in refused + settled)
    result.storage_loads.extend(engine_pb2.StorageLoad(load_id=i, pages=n) for i, n in loads)
    return result


def _prepare_grammars(
    grammars: GrammarHost | None, reqs: Sequence[engine_pb2.GrammarCompile]
) -> list[GrammarStatus]:
    refused = []
    for g in reqs:
        c = constraint_of(g.constraint)
        if c is None:
            refused.append(GrammarStatus(g.rid, "empty constraint", "INVALID_ARGUMENT"))
        elif grammars is None:
            refused.append(GrammarStatus(g.rid, "this worker has no grammar support", "INTERNAL"))
        else:
            grammars.prepare(g.rid, c)
    return refused


def constraint_of(msg: engine_pb2.Constraint) -> Constraint | None:
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    return Constraint(kind, "" if kind == "json_object" else getattr(msg, kind))


def encode_grammar_status(st: GrammarStatus) -> engine_pb2.GrammarStatus:
    return engine_pb2.GrammarStatus(rid=st.rid, error=st.error, error_code=st.error_code)


def decode_batch(msg: engine_pb2.ForwardBatch, limits: Limits) -> Batch:
    batch = Batch(msg.is_decode, [decode_request(r, msg.is_decode, limits) for r in msg.reqs])
    check_batch(batch, limits)
    return batch


def decode_request(msg: engine_pb2.ForwardRequest, is_decode: bool, limits: Limits) -> ReqInput:
    req = ReqInput(
        req_slot=msg.req_slot,
        input_ids=unpack_i32(msg.input_ids),
        out_slots=unpack_i32(msg.out_slots),
        prefix_len=msg.prefix_len,
        sample=msg.sample,
        use_last_sampled=msg.use_last_sampled,
        start=_slot_start(msg) if msg.is_new else None,
        rid=msg.rid,
        score=None if is_decode or not msg.prompt_logprob_targets else _prompt_score(msg),
        drafts=unpack_i32(msg.draft_tokens) if msg.draft_tokens else None,
    )
    _check_request(req, is_decode, limits)
    if req.score is not None:
        _check_score(req, req.score, limits)
    return req


def _prompt_score(msg: engine_pb2.ForwardRequest) -> PromptScore:
    targets = unpack_i32(msg.prompt_logprob_targets)
    return PromptScore(msg.prompt_logprob_row, targets, msg.prompt_top_logprobs)


def _check_score(req: ReqInput, s: PromptScore, limits: Limits) -> None:
    n_new = len(req.out_slots)
    if s.row < 0 or s.row + len(s.targets) > n_new:
        raise ValueError(
            f"{req.where}: prompt logprob rows [{s.row}, {s.row + len(s.targets)}) "
            f"outside its {n_new} new tokens"
        )
    if not 0 <= s.top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"{req.where}: prompt_top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
    if s.targets.min() < 0 or s.targets.max() >= limits.vocab_size:
        raise ValueError(
            f"{req.where}: prompt_logprob_targets outside the vocabulary [0, {limits.vocab_size})"
        )


def _slot_start(msg: engine_pb2.ForwardRequest) -> SlotStart:
    sampling = msg.sampling if msg.HasField("sampling") else None
    return SlotStart(
        prefix_slots=unpack_i32(msg.prefix_slots),
        sampling=sampling_spec(sampling, msg.eos_token_ids),
        output_ids=unpack_i32(msg.output_ids),
        keep_last_sampled=msg.use_last_sampled,
        constraint=constraint_of(sampling.constraint) if sampling is not None else None,
    )


def _check_request(req: ReqInput, is_decode: bool, limits: Limits) -> None:
    where, n_new = req.where, len(req.input_ids)
    if not 0 <= req.req_slot < limits.max_running_requests:
        raise ValueError(f"{where}: req_slot out of range [0, {limits.max_running_requests})")
    if req.use_last_sampled:
        if n_new:
            raise ValueError(
                f"{where}: use_last_sampled needs empty input_ids and a token sampled before"
            )
        n_new = 1
    if n_new == 0:
        raise ValueError(f"{where}: no input_ids")
    if req.drafts is not None:
        _check_drafts(req, is_decode)
        n_new += len(req.drafts)
    if len(req.out_slots) != n_new:
        what = "input_ids + draft_tokens" if req.drafts is not None else "input_ids"
        raise ValueError(f"{where}: {len(req.out_slots)} out_slots for {n_new} {what}")
    if is_decode and n_new != 1:
        raise ValueError(f"{where}: a decode batch carries 1 token per request, got {n_new}")
    if req.prefix_len < 0 or req.prefix_len + n_new > limits.max_context:
        raise ValueError(
            f"{where}: prefix_len {req.prefix_len} + {n_new} new tokens exceeds the context "
            f"length {limits.max_context}"
        )
    if req.start is not None and len(req.start.prefix_slots) != req.prefix_len:
        raise ValueError(
            f"{where}: {len(req.start.prefix_slots)} prefix_slots for prefix_len {req.prefix_len}"
        )
    ban = req.start.sampling.min_tokens_ban if req.start is not None else ()
    if ban and not (min(ban) >= 0 and max(ban) < limits.vocab_size):
        raise ValueError(
            f"{where}: min_tokens masks a token outside the vocabulary [0, {limits.vocab_size})"
        )
    bias = req.start.sampling.logit_bias if req.start is not None else ()
    if not all(0 <= t < limits.vocab_size for t, _ in bias):
        raise ValueError(
            f"{where}: logit_bias names a token outside the vocabulary [0, {limits.vocab_size})"
        )
    if not all(abs(b) <= LOGIT_BIAS_RANGE for _, b in bias):  # NaN fails too
        raise ValueError(
            f"{where}: a logit_bias is outside [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]"
        )


def _check_drafts(req: ReqInput, is_decode: bool) -> None:
    where = req.where
    if is_decode:
        raise ValueError(
            f"{where}: draft_tokens in a batch marked is_decode (a verify step is not)"
        )
    if not req.sample:
        raise ValueError(f"{where}: draft_tokens need sample set (they are verified by sampling)")
    if req.use_last_sampled:
        raise ValueError(f"{where}: draft_tokens cannot follow use_last_sampled")


def check_batch(batch: Batch, limits: Limits) -> None:
    slots = [r.req_slot for r in batch.reqs]
    if len(set(slots)) != len(slots):
        raise ValueError("a req_slot appears twice in one batch")
    ids = np.concatenate(
        [r.input_ids for r in batch.reqs] + [r.drafts for r in batch.reqs if r.drafts is not None]
    )
    if len(ids) and (ids.min() < 0 or ids.max() >= limits.vocab_size):
        raise ValueError(f"input_ids out of the vocabulary [0, {limits.vocab_size})")
    kv = np.concatenate(
        [r.out_slots for r in batch.reqs]
        + [r.start.prefix_slots for r in batch.reqs if r.start is not None]
    )
    if kv.min() < 1 or kv.max() > limits.num_slots:
        raise ValueError(f"KV slot out of range [1, {limits.num_slots}] (slot 0 is padding)")


def sampling_spec(
    p: engine_pb2.SamplingParams | None, eos_token_ids: Sequence[int] = ()
) -> SamplingSpec:
    if p is None:
        return SamplingSpec()
    given = {name: getattr(p, name) for name in _SPEC_OPTIONALS if p.HasField(name)}
    return SamplingSpec(
        **given,
        logprobs=p.logprobs or given.get("top_logprobs", 0) > 0,
        min_tokens_ban=min_tokens_ban(p, eos_token_ids),
        logit_bias=tuple((e.token_id, e.bias) for e in p.logit_bias),
    )


# SamplingSpec's fields that are optional scalars of the same name in the engine's message.
_SPEC_OPTIONALS = tuple(
    f.name
    for f in fields(SamplingSpec)
    if (d := engine_pb2.SamplingParams.DESCRIPTOR.fields_by_name.get(f.name)) is not None
    and d.has_presence
    and d.message_type is None
)


def min_tokens_ban(p: engine_pb2.SamplingParams, eos_token_ids: Sequence[int]) -> tuple[int, ...]:
    if not p.min_tokens:
        return ()
    ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
    return tuple(sorted(ids))


def encode_result(batch_id: int, out: ForwardOutput) -> engine_pb2.ForwardResult:
    tokens = [
        sampled_token(tid, lp, top)
        for tid, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True)
    ]
    for i, (done, error) in enumerate(zip(out.grammar_terminated, out.grammar_errors, strict=True)):
        tokens[i].grammar_terminated, tokens[i].grammar_error = done, error
    for i, dead in enumerate(out.grammar_dead_ends):
        tokens[i].grammar_dead_end = dead
    for i, scored in enumerate(out.prompt_logprobs):
        if scored:
            tokens[i].prompt_logprobs.extend(token_logprob(*s) for s in scored)
    for i, extra in enumerate(out.extra_token_ids):
        tokens[i].extra_token_ids.extend(extra)
        if out.extra_logprobs and out.extra_logprobs[i]:
            tokens[i].extra_logprobs.extend(
                token_logprob(t, lp, top)
                for t, (lp, top) in zip(extra, out.extra_logprobs[i], strict=True)
            )
    return engine_pb2.ForwardResult(
        batch_id=batch_id,
        tokens=tokens,
        forward_time=out.forward_time,
        cuda_graph=out.cuda_graph,
    )


def sampled_token(
    token_id: int, logprob: float | None, top: list[tuple[int, float]] | None
) -> engine_pb2.SampledToken:
    token = engine_pb2.SampledToken(token_id=token_id)
    if logprob is not None:
        token.logprob.token_id = token_id
        token.logprob.logprob = logprob
        for tid, lp in top or []:
            token.logprob.top.append(engine_pb2.TopLogprob(token_id=tid, logprob=lp))
    return token


def token_logprob(
    token_id: int, logprob: float, top: list[tuple[int, float]]
) -> engine_pb2.TokenLogprob:
    return engine_pb2.TokenLogprob(
        token_id=token_id,
        logprob=logprob,
        top=[engine_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top],
    )


def encode_info(info: RunnerInfo, instance_id: str = "") -> engine_pb2.WorkerInfo:
    return engine_pb2.WorkerInfo(**asdict(info), instance_id=instance_id)
