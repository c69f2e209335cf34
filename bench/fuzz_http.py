"""Schemathesis against a live server for longer: tests/e2e/test_openapi_fuzz.py's run
with many more examples per operation. Prints what it tried, the answers by route and
status, and every failure; exits 1 on any failure or if the pool is not whole after.

    .venv/bin/python bench/fuzz_http.py --examples 500
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # for tests.* when run as `python bench/...`

import httpx  # noqa: E402

from tests.e2e.test_openapi_fuzz import (  # noqa: E402
    SERVER_FLAGS,
    fuzz,
    load_schema,
    serves_and_pool_is_whole,
)
from tests.server_util import Server  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=300, help="per operation")
    args = ap.parse_args()
    with Server(*SERVER_FLAGS, metrics=True) as server:
        base = f"http://127.0.0.1:{server.http_port}"
        model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        start = time.monotonic()
        result = fuzz(load_schema(server), model, args.examples)
        took = time.monotonic() - start
        for key, n in sorted(result.statuses.items()):
            print(f"{n:6d}  {key}")
        print(f"{result.tried} examples in {took:.0f} s, {len(result.failures)} failures")
        for failure in result.failures:
            print("\n" + failure)
        serves_and_pool_is_whole(server)
        print("after: serves a completion, KV pool whole")
    return 1 if result.failures else 0


if __name__ == "__main__":
    sys.exit(main())
