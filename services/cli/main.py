"""`radixserve`: serve (all three services, supervised), one service, or generate from a server."""

from __future__ import annotations

import argparse
import sys

from services.common.config import (
    FrontendConfig,
    SchedulerConfig,
    WorkerConfig,
    add_dataclass_args,
    from_args,
)

SERVICES = {"frontend": FrontendConfig, "scheduler": SchedulerConfig, "worker": WorkerConfig}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="start frontend, scheduler and worker and supervise them",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    seen: set[str] = set()
    for cls in (FrontendConfig, SchedulerConfig, WorkerConfig):
        add_dataclass_args(serve, cls, seen)
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

    add_generate_args(sub.add_parser("generate", help="stream a completion from a running server"))
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.command == "serve":
        from services.cli.serve import serve

        return serve(ns)
    if ns.command == "generate":
        from services.frontend.client import run_generate

        return run_generate(ns)
    cfg = from_args(SERVICES[ns.command], ns)
    if ns.command == "frontend":
        from services.frontend.main import main as run
    elif ns.command == "scheduler":
        from services.scheduler.main import main as run
    else:
        from services.worker.main import main as run
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
