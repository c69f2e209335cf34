"""The GPU check's result rows: each printed (stdout, flushed) and appended to the rows file
as soon as it is measured, so a run killed at its time limit keeps every figure it reached.

gpu_check.sh names the file in GPU_CHECK_ROWS (under $OUT when the device tool sets OUT) and
reads the verdict from it, and the step of each FAIL / SKIP row from GPU_CHECK_ROWS.steps
(GPU_CHECK_STEP names the running step); a script run alone prints its rows, keeps no file.
"""

from __future__ import annotations

import os
import sys

HEADER = "| check | measured | target | result |\n|---|---|---|---|"


def row(check: str, measured: str, target: str = "", verdict: str = "") -> str:
    cells = [c.replace("|", "/").replace("\n", " ") for c in (check, measured, target, verdict)]
    return "| " + " | ".join(cells) + " |"


def emit(check: str, measured: str, target: str = "", verdict: str = "") -> str:
    line = row(check, measured, target, verdict)
    print(line, flush=True)
    path = os.environ.get("GPU_CHECK_ROWS")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
        if verdict in ("FAIL", "SKIP"):  # which steps --only should rerun
            with open(path + ".steps", "a", encoding="utf-8") as f:
                f.write(f"{verdict} {os.environ.get('GPU_CHECK_STEP', '?')}\n")
    print(f"[row] {check}: {measured} {verdict}", file=sys.stderr, flush=True)
    return line


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"
