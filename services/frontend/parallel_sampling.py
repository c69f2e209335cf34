"""n samples of one prompt that share its KV (GenerateRequest.n).

As SGLang does it: the prompt goes first alone with max_tokens 0, so the radix tree holds it;
then the n samples go to the same engine and find it cached, so it is computed once. Sample
i has rid ``<rid>_<i>`` (so /abort_request of the rid aborts every sample) and seed + i
where seeded, which makes it token for token the request with that seed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence

from radixserve.internal.v1 import engine_pb2
from radixserve.v1 import generation_pb2 as pb

_SEEDS = 2**64


def prefill_request(treq: engine_pb2.TokenizedRequest) -> engine_pb2.TokenizedRequest:
    """The prompt alone, left in the radix tree, nothing sampled."""
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

    The first failure closes the others (aborting their requests) and is raised. A stream
    closed before it started runs no ``finally``: the caller releases its request.
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
