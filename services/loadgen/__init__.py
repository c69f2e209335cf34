"""`radixserve bench`, the load generator: a serving benchmark client for any OpenAI server.

It lives beside the services, not in them, because it is a client: it measures a server
(radixserve or a peer such as vLLM) from outside, over streaming /v1/completions, the way
users meet it. `serving` runs requests and computes the figures; `workloads` builds the
prompts.
"""

from services.loadgen.serving import add_bench_args, benchmark, run_bench

__all__ = ["add_bench_args", "benchmark", "run_bench"]
