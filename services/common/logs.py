"""One log format for the three processes, each line tagged with the service's name."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str, service: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s [{service}] %(levelname)s %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
