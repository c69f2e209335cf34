"""radixserve's Python client: gRPC underneath, blocking (Client) and asyncio (AsyncClient).

    from radixserve.client import Client

    with Client("localhost:30000") as client:
        print(client.generate("Beautiful is better than", max_tokens=16).text)
        product = client.generate(
            "Describe a laptop as JSON.",
            structured_output={"product_name": str, "price": float, "features": list[str]},
        ).parsed  # a dict that fits the spec; the server constrained the output to it

docs/client.md is the guide.
"""

from radixserve.client.aio import AsyncClient
from radixserve.client.errors import (
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    RadixServeError,
    ResourceExhausted,
    StructuredOutputError,
    Unauthenticated,
    Unavailable,
)
from radixserve.client.requests import GenerateOptions, Prompt
from radixserve.client.structured import OutputSpec, output_spec
from radixserve.client.sync import Client
from radixserve.client.types import (
    Chunk,
    Completion,
    FlushResult,
    ModelInfo,
    Timings,
    TokenLogprob,
    Tokens,
    TopLogprob,
    Usage,
)

__all__ = [
    "AlreadyExists",
    "AsyncClient",
    "Cancelled",
    "Chunk",
    "Client",
    "Completion",
    "DeadlineExceeded",
    "FailedPrecondition",
    "FlushResult",
    "GenerateOptions",
    "InternalError",
    "InvalidArgument",
    "ModelInfo",
    "NotFound",
    "OutputSpec",
    "PermissionDenied",
    "Prompt",
    "RadixServeError",
    "ResourceExhausted",
    "StructuredOutputError",
    "Timings",
    "TokenLogprob",
    "Tokens",
    "TopLogprob",
    "Unauthenticated",
    "Unavailable",
    "Usage",
    "output_spec",
]
