"""bench/gpu_check.sh --smoke: the GPU check's own script, run on CPU (tiny shapes, Triton
interpreted, graph rows skipped, the whole server on CPU), so that it cannot rot between the
rare GPU runs; and what keeps its first GPU run from ending early: no import of a package the
GPU image lacks, a verdict line that comes last even when the deadline or a signal stops it,
and a plan that fits the device call."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHON": sys.executable, "PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/")}


def gpu_check(*args: str, out: Path, timeout: float = 540) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "bench/gpu_check.sh", *args],
        cwd=ROOT,
        env={**ENV, "OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def rows_of(text: str) -> dict[str, str]:
    return {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if " | " in line}


def test_gpu_check_smoke_runs_every_section_and_passes(tmp_path):
    proc = gpu_check("--smoke", out=tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert out.strip().splitlines()[-1] == "GPU CHECK (--smoke, CPU): PASS"
    rows = rows_of(out)
    for check in (
        "preflight: every step imports without",
        "model logits vs transformers, triton backend",
        "model logits vs transformers, torch backend",
        "prefix-cached extend",
        "seeded top-k/top-p sampling",
        # The whole server (three processes) against transformers, then a bench burst.
        "server greedy vs transformers, cache miss",
        "server greedy vs transformers, cache hit",
        "server greedy vs transformers, chunked prefill",
        "server JSON-schema constraint",
        "radixserve bench, generated-shared-prefix burst",
    ):
        row = next((r for k, r in rows.items() if k.startswith(check)), None)
        assert row is not None and row.rstrip(" |").endswith("PASS"), (check, out)
    graph_row = next(r for k, r in rows.items() if k.startswith("CUDA-graph replay vs eager"))
    assert "skipped: needs a GPU" in graph_row
    assert any(k.startswith("decode step 4 x 64") for k in rows)
    tp_row = next(r for k, r in rows.items() if k.startswith("tensor parallelism, TP=1 vs TP=N"))
    assert "not run: 0 GPU(s) here" in tp_row
    assert "ERROR" not in out
    # Every row was kept in $OUT as it came, the verdict last.
    kept = (tmp_path / "gpu_check.md").read_text().strip().splitlines()
    assert kept[-1] == "GPU CHECK (--smoke, CPU): PASS"
    assert set(rows_of("\n".join(kept))) == set(rows)


def test_a_step_the_deadline_cannot_fit_is_named_and_the_verdict_comes_last(tmp_path):
    proc = gpu_check("--smoke", "--only", "preflight,model", "--deadline-s", "15", out=tmp_path)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    assert any("not reached" in line and line.endswith("| SKIP |") for line in lines), lines
    assert lines[-1].startswith("GPU CHECK (--smoke, CPU): FAIL (")
    assert "rerun: bash bench/gpu_check.sh --only model" in lines[-1]


def test_a_signal_still_prints_the_rows_and_the_verdict(tmp_path):
    proc = subprocess.Popen(
        ["bash", "bench/gpu_check.sh", "--smoke", "--only", "preflight,server"],
        cwd=ROOT,
        env={**ENV, "OUT": str(tmp_path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    rows = tmp_path / "gpu_check.md"
    deadline = time.monotonic() + 120
    while "| preflight" not in (rows.read_text() if rows.exists() else ""):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # the server step is starting
    out, _ = proc.communicate(timeout=60)
    lines = out.strip().splitlines()
    assert proc.returncode == 1
    assert lines[-1].startswith("GPU CHECK (--smoke, CPU): FAIL (") and "a signal" in lines[-1]
    assert any(line.startswith("| preflight") for line in lines)
    assert rows.read_text().strip().splitlines()[-1] == lines[-1]


def test_dry_run_fits_the_device_call_and_help_gives_the_command(tmp_path):
    proc = gpu_check("--dry-run", out=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    steps = "wheels preflight tests server model kernels awq profile tokens".split()
    for step in steps:
        assert f"| {step} |" in proc.stdout
    total = next(line for line in proc.stdout.splitlines() if line.startswith("total"))
    assert int(total.split(":")[1].split()[0]) <= 360, total
    assert not (tmp_path / "gpu_check.md").exists()  # ran nothing
    help_text = gpu_check("--help", out=tmp_path, timeout=60).stdout
    for needed in ('carry:     [".whl"]', "timeout_s: 450", "bash bench/gpu_wheels.sh", "--only"):
        assert needed in help_text


def test_every_gpu_module_and_test_imports_with_the_missing_packages_blocked():
    """What the GPU image lacks (pyzmq, protobuf and grpc for the stubs, xgrammar, pydantic)
    is blocked; every module the check imports and every GPU-only test file must load."""
    proc = subprocess.run(
        [sys.executable, "bench/gpu_imports.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "17 of 17 import" in proc.stdout


def test_the_blocker_catches_an_import_of_a_missing_package():
    """The worker's protobuf reference (services/worker/offline.py) needs the stubs: the
    blocker must make it fail, as it would on the GPU image."""
    code = (
        "from bench import gpu_imports as g; g.block(); "
        "bad = g.failures(modules=('services.worker.offline',), files=()); "
        "print(bad[0][1].splitlines()[0] if bad else 'imported')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "blocked: not on the GPU image" in proc.stdout, proc.stdout + proc.stderr[-2000:]
