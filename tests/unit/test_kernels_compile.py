"""Every Triton kernel specialisation the GPU check launches compiles for sm_90 with the GPU
machine's Triton (3.6, installed beside .venv by `make test`), without a GPU: no register
spills, shared memory within the H200's per-block limit (bench/gpu_compile.py). Catches
layout, shared-memory and register problems the interpreter cannot see, with the compiler
the device will really use."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / ".gpu-rehearsal" / "site"


def test_every_launched_specialisation_compiles_for_sm90_within_limits():
    if not (SITE / "triton").is_dir():
        pytest.skip(
            "no .gpu-rehearsal/site/triton: `make gpu-rehearsal` could not install "
            "triton==3.6.* (registry unreachable?)"
        )
    env = {**os.environ, "PYTHONPATH": f"{SITE}:{ROOT}"}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run(
        [sys.executable, "bench/gpu_compile.py", "--jobs", str(min(os.cpu_count() or 1, 4))],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| _")]
    kernels = {row.split()[1] for row in rows}
    # Every kernel of kernels/ is in the set, at the many shapes the check launches.
    assert kernels == {
        "_extend_kernel",
        "_decode_split_kernel",
        "_decode_merge_kernel",
        "_store_kv_kernel",
        "_awq_gemm_kernel",
    }, kernels
    assert len(rows) >= 100, out.stdout
    assert all(row.rstrip(" |").endswith("PASS") for row in rows)
