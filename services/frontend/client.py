"""``radixserve generate "..."``: streams a completion from a running server to stdout."""

from __future__ import annotations

import argparse
import os
import sys

import grpc

from radixserve.v1 import generation_pb2 as pb
from radixserve.v1 import generation_pb2_grpc


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt (a user message with --chat)")
    parser.add_argument(
        "--target", default="127.0.0.1:30000", help="frontend gRPC address host:port"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="new tokens at most (server default 128)"
    )
    parser.add_argument(
        "--temperature", type=float, default=None, help="0 = greedy (server default 1.0)"
    )
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument(
        "--seed", type=int, default=None, help="the same seed gives the same tokens"
    )
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message through the chat template",
    )
    parser.add_argument(
        "--show-stats", action="store_true", help="print finish reason and token counts to stderr"
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds before giving up (default: none)"
    )


def build_request(ns: argparse.Namespace) -> pb.GenerateRequest:
    sp = pb.SamplingParams(stop=ns.stop)
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        value = getattr(ns, name, None)
        if value is not None:
            setattr(sp, name, value)
    req = pb.GenerateRequest(sampling=sp)
    if ns.chat:
        req.messages.messages.add(role="user", content=ns.prompt)
    else:
        req.text = ns.prompt
    return req


def _print_stats(final: pb.GenerateResponse) -> None:
    t = final.timings
    print(
        f"\n[finish_reason={final.finish_reason}"
        + (f" matched_stop={final.matched_stop!r}" if final.matched_stop else "")
        + f" prompt_tokens={final.prompt_tokens} cached_tokens={final.cached_tokens}"
        f" completion_tokens={final.completion_tokens} total_time={t.total_time:.3f}s"
        f" queue={t.queue_time:.3f}s prefill={t.prefill_time:.3f}s decode={t.decode_time:.3f}s]",
        file=sys.stderr,
    )


def run_generate(ns: argparse.Namespace) -> int:
    """Streams the completion; returns the process exit code (0 ok, 1 on an RPC error)."""
    final = None
    with grpc.insecure_channel(ns.target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            # The server's API key, from the environment only (argv is visible in ps).
            key = os.environ.get("RADIXSERVE_API_KEY", "")
            metadata = [("authorization", f"Bearer {key}")] if key else None
            for resp in stub.Generate(build_request(ns), timeout=ns.timeout, metadata=metadata):
                sys.stdout.write(resp.text)
                sys.stdout.flush()
                final = resp
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    if ns.show_stats and final is not None:
        _print_stats(final)
    return 0
