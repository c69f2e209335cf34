"""What every call of a client carries: its metadata (the API key among it) and its timeout."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

API_KEY_ENV = "RADIXSERVE_API_KEY"

# Channel options of every client: generous message sizes, since a long prompt's token
# ids or a large JSON Schema can pass gRPC's 4 MB default.
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
)


@dataclass(frozen=True)
class CallSettings:
    metadata: tuple[tuple[str, str], ...]
    timeout: float | None

    @classmethod
    def of(
        cls,
        api_key: str | None,
        metadata: Mapping[str, str] | Sequence[tuple[str, str]],
        timeout: float | None,
    ) -> CallSettings:
        pairs = list(metadata.items()) if isinstance(metadata, Mapping) else list(metadata)
        if api_key is None:  # not given: the server's own variable, as the CLI reads it
            api_key = os.environ.get(API_KEY_ENV) or None
        if api_key:
            pairs.append(("authorization", f"Bearer {api_key}"))
        # gRPC metadata keys are lower case; a capitalised one is refused at call time.
        return cls(tuple((k.lower(), v) for k, v in pairs), timeout)

    def timeout_for(self, timeout: float | None) -> float | None:
        """A call's timeout: its own when given, else the client's (None = no limit)."""
        return self.timeout if timeout is None else timeout


def channel_options(extra: Sequence[tuple[str, object]]) -> list[tuple[str, object]]:
    """The client's channel options, then the caller's (a later one wins in gRPC)."""
    return [*CHANNEL_OPTIONS, *extra]
