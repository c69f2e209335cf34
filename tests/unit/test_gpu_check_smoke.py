"""bench/gpu_check.sh --smoke: the GPU check's own script, run on CPU (tiny shapes, Triton
interpreted, graph rows skipped), so that it cannot rot between the rare GPU runs."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_smoke_runs_every_section_and_passes():
    env_python = {"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--smoke"],
        cwd=ROOT,
        env=env_python,
        capture_output=True,
        text=True,
        timeout=540,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert out.strip().splitlines()[-1] == "GPU CHECK (--smoke, CPU): PASS"
    rows = {line.split(" | ")[0].lstrip("| "): line for line in out.splitlines() if " | " in line}
    # The model path reached ModelRunner and compared against transformers, both backends.
    for check in (
        "model logits vs transformers, triton backend",
        "model logits vs transformers, torch backend",
        "prefix-cached extend",
        "seeded top-k/top-p sampling",
    ):
        row = next((r for k, r in rows.items() if k.startswith(check)), None)
        assert row is not None and row.rstrip(" |").endswith("PASS"), (check, out)
    graph_row = next(r for k, r in rows.items() if k.startswith("CUDA-graph replay vs eager"))
    assert "skipped: needs a GPU" in graph_row
    assert any(k.startswith("decode step 4 x 64") for k in rows)
    assert "ERROR" not in out


def test_worker_compute_path_imports_no_zeromq_and_no_generated_stubs():
    """The GPU image has no pyzmq and an older protobuf: ModelRunner (and the check's model
    rows) must import neither; only services/worker/wire.py and main.py speak protobuf."""
    code = (
        "import sys; import services.worker.model_runner, services.worker.cuda_graph, "
        "bench.gpu_model_check; "
        "bad = sorted(m for m in sys.modules if m == 'zmq' or m.startswith('zmq.') "
        "or m.startswith('radixserve') or m.startswith('google.protobuf') or m == 'grpc'); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
