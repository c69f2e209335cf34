"""Public API messages <-> the engine's own (radixserve.internal.v1), converted once here.

The engine never imports the public proto, so a field added to the public API touches only
the frontend. Stop strings stay behind: the engine sees token ids, never text.
"""

from __future__ import annotations

from collections.abc import Iterable

from radixserve.internal.v1 import engine_pb2
from radixserve.v1 import generation_pb2 as pb


def _shared_optionals() -> tuple[str, ...]:
    """Optional scalars of the same name on both sides: copied when set, unset otherwise."""
    public = pb.SamplingParams.DESCRIPTOR.fields_by_name
    return tuple(
        f.name
        for f in engine_pb2.SamplingParams.DESCRIPTOR.fields
        if f.has_presence and f.message_type is None and f.name in public
    )


_SAMPLING_OPTIONAL = _shared_optionals()


def sampling_to_engine(sp: pb.SamplingParams) -> engine_pb2.SamplingParams:
    """The engine's copy of validated public sampling params, without the stop strings."""
    out = engine_pb2.SamplingParams(
        stop_token_ids=sp.stop_token_ids,
        ignore_eos=sp.ignore_eos,
        disable_speculation=sp.disable_speculation,
        logprobs=sp.logprobs,
        prompt_logprobs=sp.prompt_logprobs,
    )
    for name in _SAMPLING_OPTIONAL:
        if sp.HasField(name):
            setattr(out, name, getattr(sp, name))
    out.logit_bias.extend(
        engine_pb2.LogitBias(token_id=e.token_id, bias=e.bias) for e in sp.logit_bias
    )
    kind = sp.WhichOneof("constraint")
    if kind is not None:  # the same oneof member names on both sides
        setattr(out.constraint, kind, getattr(sp, kind))
    return out


def logprobs_to_public(lps: Iterable[engine_pb2.TokenLogprob]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[pb.TopLogprob(token_id=t.token_id, logprob=t.logprob) for t in lp.top],
        )
        for lp in lps
    ]


def flush_to_public(reply: engine_pb2.FlushReply) -> pb.FlushCacheResponse:
    return pb.FlushCacheResponse(flushed=reply.flushed, message=reply.message)
