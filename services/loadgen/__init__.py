"""`radixserve bench`, the load generator: a serving benchmark client for any OpenAI server.

A client beside the services, measuring any server from outside as users meet it: `serving`
runs requests and computes the figures; `workloads` builds the prompts.
"""

from services.loadgen.serving import add_bench_args, benchmark, run_bench

__all__ = ["add_bench_args", "benchmark", "run_bench"]
