"""Imports everything bench/gpu_check.sh runs with the packages the GPU machine lacks
blocked, as they are there: no import may stop the check before its rows.

    python3 bench/gpu_imports.py          # exit 0: all import; 1: the failures are listed

Blocked: pyzmq, protobuf and grpc (what the generated stubs need), the stubs themselves,
xgrammar and pydantic. Only the whole-server row (bench/gpu_server.py) needs them, in its
own server processes, from the wheels carried in .whl/.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BLOCKED = (
    "zmq",
    "google.protobuf",
    "grpc",
    "grpc_health",
    "grpc_reflection",
    "radixserve.v1",
    "radixserve.internal",
    "xgrammar",
    "pydantic",
)
# The modules the check's steps import (preflight, the GPU tests, every bench section).
MODULES = (
    "kernels.triton.decode_attention",
    "kernels.triton.extend_attention",
    "kernels.triton.kv_store",
    "kernels.triton.awq_gemm",
    "services.worker.model_runner",
    "services.worker.cuda_graph",
    "services.worker.model_loader",
    "services.worker.layers",
    "services.worker.attention.triton_backend",
    "bench.gpu_preflight",
    "bench.gpu_bench",
    "bench.gpu_model_check",
    "bench.gpu_awq",
    "bench.gpu_server",
)
# The test files gpu_check.sh runs on the GPU (pytest imports them with tests/ on the path).
TEST_FILES = (
    "tests/conftest.py",
    "tests/unit/test_kernels.py",
    "tests/unit/test_awq_kernel.py",
)


class Blocker(importlib.abc.MetaPathFinder):
    """Refuses the blocked packages as a missing install would."""

    def find_spec(self, name, path, target=None):  # noqa: ANN001 (importlib's signature)
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: not on the GPU image)")
        return None


def block() -> None:
    """Installs the blocker; an already imported blocked module is an error of the caller."""
    loaded = [m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in BLOCKED)]
    if loaded:
        raise RuntimeError(f"already imported, cannot be blocked: {sorted(loaded)[:5]}")
    sys.meta_path.insert(0, Blocker())


def import_file(rel: str) -> None:
    path = ROOT / rel
    name = "gpu_imports_" + path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def failures(modules=MODULES, files=TEST_FILES) -> list[tuple[str, str]]:
    """(what, the error's last frames) for each module or file that does not import."""
    for p in (str(ROOT), str(ROOT / "tests")):  # as pytest's rootdir conftest puts them
        if p not in sys.path:
            sys.path.insert(0, p)
    out = []
    for what, load in [(m, importlib.import_module) for m in modules] + [
        (f, import_file) for f in files
    ]:
        try:
            load(what)
        except Exception as e:  # ImportError, or anything a broken import raises
            out.append((what, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"))
    return out


def main() -> int:
    block()
    bad = failures()
    for what, error in bad:
        print(f"gpu_imports: {what} does not import without the blocked packages: {error}")
    total = len(MODULES) + len(TEST_FILES)
    print(f"gpu_imports: {total - len(bad)} of {total} import with {', '.join(BLOCKED)} blocked")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
