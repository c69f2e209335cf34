"""`radixserve`: serve (all three services, supervised), one service, generate from a
server, or benchmark any OpenAI-compatible server."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from services.common.config import (
    FrontendConfig,
    SchedulerConfig,
    ServeConfig,
    WorkerConfig,
    add_dataclass_args,
    exit_usage,
    from_args,
)

SERVICES: dict[str, type] = {
    "frontend": FrontendConfig,
    "scheduler": SchedulerConfig,
    "worker": WorkerConfig,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="start frontend, scheduler and worker and supervise them",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    seen: set[str] = set()
    for config_cls in (FrontendConfig, SchedulerConfig, WorkerConfig, ServeConfig):
        add_dataclass_args(serve, config_cls, seen)
    serve.add_argument(
        "--startup-timeout",
        type=float,
        default=900.0,
        help="seconds to wait for all three services to report healthy",
    )
    for name, cls in SERVICES.items():
        p = sub.add_parser(
            name,
            help=f"start the {name} service alone (what its container runs)",
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        add_dataclass_args(p, cls)
    from services.frontend.client import add_generate_args
    from services.loadgen.serving import add_bench_args

    keys = sub.add_parser("keys", help="CURVE keys of the internal links (--internal-keys-dir)")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    gen = keys_sub.add_parser(
        "generate", help="write frontend/scheduler/worker keypairs and a control token"
    )
    gen.add_argument("dir", help="folder to write them into (created 0700)")
    add_generate_args(sub.add_parser("generate", help="stream a completion from a running server"))
    add_bench_args(
        sub.add_parser(
            "bench",
            help="benchmark an OpenAI-compatible server (this one, vLLM, SGLang, ...)",
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
    )
    return parser


def _service_main(name: str, cfg: Any) -> Callable[[Any], None]:
    """The service's entry point, imported only when asked for (the worker's pulls torch:
    its OpenMP wait setting goes into the environment first, libgomp reads it once)."""
    if name == "frontend":
        from services.frontend.main import main as frontend_main

        return frontend_main
    if name == "scheduler":
        from services.scheduler.main import main as scheduler_main

        return scheduler_main
    from services.worker import cpu_threads

    cpu_threads.set_openmp_wait(cfg.cpu_wait)
    try:
        cpu_threads.set_openmp_bind(
            cfg.cpu_bind, cfg.cpu_threads, cfg.device, cfg.tp_size, cfg.tp_rank
        )
    except ValueError as e:
        raise SystemExit(f"worker: {e}") from None
    from services.worker import host_memory  # before torch: see its docstring

    host_memory.tune()
    from services.worker.main import main as worker_main

    return worker_main


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.command == "serve":
        from services.cli.serve import serve

        return serve(ns)
    if ns.command == "keys":
        from services.common.curve import generate_keys

        generate_keys(ns.dir)
        print(f"radixserve: keys written to {ns.dir} (give it as --internal-keys-dir)")
        return 0
    if ns.command == "generate":
        from services.frontend.client import run_generate

        return run_generate(ns)
    if ns.command == "bench":
        from services.loadgen.serving import run_bench

        return run_bench(ns)
    try:
        cfg = from_args(SERVICES[ns.command], ns)
    except ValueError as e:  # a flag or RADIXSERVE_* variable out of its range
        exit_usage(f"radixserve {ns.command}", e)
    _service_main(ns.command, cfg)(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
