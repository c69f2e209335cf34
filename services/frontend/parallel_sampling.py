"""n samples of one prompt that share its KV (GenerateRequest.n: OpenAI's ``n``, SGLang's
``sampling_params.n``).

As SGLang does it: the prompt goes first alone, as a request with max_tokens 0 (the
"prefill"), so that the radix tree holds it; then the n samples go to the same engine as n
requests whose prompt is cached but for its last token (always computed: its logits are
sampled). The prompt is computed once, not n times.

    request rid r, n = 3        r_prefill (max_tokens 0) ─► the prompt is in the tree
                                r_0, r_1, r_2 (seed, seed+1, seed+2) ─► interleaved out

Sample i has rid ``<rid>_<i>`` (SGLang's batch rule, so /abort_request of the rid aborts
every sample) and, when the request has a seed, seed + i (mod 2^64): a seeded draw depends
only on (seed, tokens so far), so sample i is token for token the request with that seed.
Unseeded samples draw from the worker's generator, independently.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence

from radixserve.internal.v1 import engine_pb2
from radixserve.v1 import generation_pb2 as pb

_SEEDS = 2**64


def prefill_request(treq: engine_pb2.TokenizedRequest) -> engine_pb2.TokenizedRequest:
    """The prompt alone: computed and left in the radix tree, nothing sampled. Only what
    decides which KV it may share (the ids, the cache salt) and its place in the queue are
    kept; no constraint, logprobs or penalties, which concern the samples."""
    out = engine_pb2.TokenizedRequest()
    out.CopyFrom(treq)
    out.rid = f"{treq.rid}_prefill"
    out.sampling.CopyFrom(engine_pb2.SamplingParams(max_tokens=0))
    return out


def sample_requests(treq: engine_pb2.TokenizedRequest, n: int) -> list[engine_pb2.TokenizedRequest]:
    """The n samples: the request itself under rid ``<rid>_<i>``, seed + i where seeded."""
    out = []
    for i in range(n):
        sample = engine_pb2.TokenizedRequest()
        sample.CopyFrom(treq)
        sample.rid = f"{treq.rid}_{i}"
        if treq.sampling.HasField("seed"):
            sample.sampling.seed = (treq.sampling.seed + i) % _SEEDS
        out.append(sample)
    return out


_Item = tuple[int, pb.GenerateResponse | BaseException | None]  # None: that stream ended


async def interleave(
    streams: Sequence[AsyncGenerator[pb.GenerateResponse, None]],
) -> AsyncGenerator[tuple[int, pb.GenerateResponse], None]:
    """The responses of every stream as they come, each with its stream's index.

    The first stream that fails ends it all: the others are closed (each closing aborts its
    request) and the failure is raised. Closing this generator closes them all the same way.
    A stream closed before it started runs no ``finally``: the caller releases its request.
    """
    out: asyncio.Queue[_Item] = asyncio.Queue()

    async def pump(i: int, stream: AsyncGenerator[pb.GenerateResponse, None]) -> None:
        try:
            async for resp in stream:
                out.put_nowait((i, resp))
        except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
            out.put_nowait((i, e))
        else:
            out.put_nowait((i, None))
        finally:
            await stream.aclose()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, item = await out.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
