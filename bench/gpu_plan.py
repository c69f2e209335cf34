"""The GPU check's steps, their estimated seconds on the device and the device call: the one
table bench/gpu_check.sh (order, caps, --dry-run) and bench/gpu_bench.py (section budgets) read.

    python3 bench/gpu_plan.py dry-run [STEPS]   # each step's estimate and cap, the total
    python3 bench/gpu_plan.py est|cap STEPS     # their estimate / cap, seconds
    python3 bench/gpu_plan.py steps             # the step names in order

Estimates, not measurements (no GPU has run the check yet): the compile figures come from
bench/gpu_compile.py here (129 specialisations, ~0.4 s of compiling each on one core), the
server's start from its CPU smoke run (~20 s) plus CUDA-graph capture; the bench sections
from their sizes and the time caps they already obey. Steps of one phase run side by side
(the tests only compile and check, the server row times nothing that they disturb), so a
phase costs its longest step. The first real run's timings replace these.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    name: str
    estimate_s: int
    phase: int  # steps of one phase run concurrently
    what: str

    @property
    def cap_s(self) -> int:
        """The step's own time limit: its estimate with room, within the whole deadline."""
        return int(self.estimate_s * 1.6) + 10


STEPS = (
    Step("wheels", 10, 0, "install the carried wheels (.whl/) into a private folder"),
    Step("preflight", 15, 1, "imports of every step with the image's missing packages blocked"),
    Step("tests", 75, 2, "tests/unit/test_kernels.py, test_awq_kernel.py compiled, pytest -n 8"),
    Step("server", 90, 2, "radixserve serve on CUDA vs transformers; a radixserve bench burst"),
    Step("model", 45, 3, "model logits vs transformers, prefix extend, CUDA graphs, sampling"),
    Step("kernels", 45, 4, "decode attention, extend attention vs SDPA, hicache copy GB/s"),
    Step("awq", 35, 5, "AWQ int4 GEMM accuracy and speed vs fp16 matmul"),
    Step("profile", 70, 6, "the default config on a 7B-shaped model: KV slots, decode split"),
    Step("tokens", 45, 7, "decode tokens/s, graphs on/off, batch 1 and 32; verify step; TP=1 vs N"),
)
BENCH_STEPS = ("model", "kernels", "awq", "profile", "tokens")  # one gpu_bench.py process
DEADLINE_S = 360  # the whole check; the device call's timeout_s leaves a margin above it
DEVICE_TIMEOUT_S = 450
BY_NAME = {s.name: s for s in STEPS}


def total_s(names: list[str]) -> int:
    """Wall seconds of these steps: per phase, the longest step."""
    phases: dict[int, int] = {}
    for s in STEPS:
        if s.name in names:
            phases[s.phase] = max(phases.get(s.phase, 0), s.estimate_s)
    return sum(phases.values())


def dry_run(names: list[str]) -> str:
    lines = ["| step | phase | estimate | cap | what |", "|---|---|---|---|---|"]
    for s in STEPS:
        if s.name in names:
            lines.append(f"| {s.name} | {s.phase} | {s.estimate_s} s | {s.cap_s} s | {s.what} |")
    total = total_s(names)
    lines.append(
        f"total (each phase its longest step): {total} s = {total / 60:.1f} min; deadline "
        f"{DEADLINE_S} s; device call timeout_s {DEVICE_TIMEOUT_S}"
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    names = argv[1].split(",") if len(argv) > 1 and argv[1] else [s.name for s in STEPS]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        print(
            f"gpu_plan: unknown step {', '.join(unknown)}; steps: {' '.join(BY_NAME)}",
            file=sys.stderr,
        )
        return 2
    if argv[0] == "dry-run":
        print(dry_run(names))
    elif argv[0] == "est":
        print(total_s(names))
    elif argv[0] == "cap":
        print(sum(BY_NAME[n].cap_s for n in names))
    elif argv[0] == "steps":
        print(" ".join(s.name for s in STEPS))
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
