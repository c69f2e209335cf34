"""Smoke test of a running radixserve: GetModelInfo, then one short greedy Generate.

Run by `helm test` (in the frontend image) and by tests/test_container_entrypoints.py, so
the check a cluster runs is the one CI runs on loopback. Sends the API key of
RADIXSERVE_API_KEY when set. Exits non-zero with a readable line on any failure.

    python smoke_test.py --target HOST:PORT [--prompt Hello] [--max-tokens 4] [--expect-engines N]
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc

from radixserve.v1 import generation_pb2, generation_pb2_grpc


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="frontend gRPC address host:port")
    p.add_argument("--prompt", default="Hello")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--expect-engines", type=int, default=0, help="0: do not check")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per call")
    return p.parse_args(argv)


def _auth() -> list[tuple[str, str]] | None:
    """The server's API key (env RADIXSERVE_API_KEY, from the chart's Secret) as metadata."""
    key = os.environ.get("RADIXSERVE_API_KEY", "")
    return [("authorization", f"Bearer {key}")] if key else None


def _check_model_info(stub, args: argparse.Namespace) -> None:
    info = stub.GetModelInfo(
        generation_pb2.GetModelInfoRequest(), timeout=args.timeout, metadata=_auth()
    )
    print(
        f"model_id={info.model_id!r} max_model_len={info.max_model_len} "
        f"page_size={info.page_size} num_engines={info.num_engines}"
    )
    if not info.model_id or info.max_model_len <= 0:
        sys.exit(f"GetModelInfo returned no model: {info}")
    if args.expect_engines and info.num_engines != args.expect_engines:
        sys.exit(f"frontend sees {info.num_engines} engines, expected {args.expect_engines}")


def _check_generate(stub, args: argparse.Namespace) -> None:
    request = generation_pb2.GenerateRequest(
        text=args.prompt,
        sampling=generation_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=0),
    )
    last, tokens, text = None, 0, ""
    for last in stub.Generate(request, timeout=args.timeout, metadata=_auth()):
        tokens += len(last.token_ids)
        text += last.text
    if last is None or not last.finish_reason:
        sys.exit("Generate ended without a final message carrying finish_reason")
    if tokens < 1 or last.completion_tokens != tokens or tokens > args.max_tokens:
        sys.exit(
            f"Generate streamed {tokens} tokens, completion_tokens={last.completion_tokens}, "
            f"max_tokens={args.max_tokens}"
        )
    print(f"generated {tokens} tokens, finish_reason={last.finish_reason!r}: {text!r}")


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    with grpc.insecure_channel(args.target) as channel:
        grpc.channel_ready_future(channel).result(timeout=args.timeout)
        stub = generation_pb2_grpc.GenerationStub(channel)
        _check_model_info(stub, args)
        _check_generate(stub, args)
    print("smoke test passed")


if __name__ == "__main__":
    main()
