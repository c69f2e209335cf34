"""Can this Python run the GPU check? Imports everything bench/gpu_check.sh reaches, with
the packages the GPU image lacks blocked (bench/gpu_imports.py), and names what is missing.

    python3 bench/gpu_preflight.py [--smoke]     # exit 0 ready, 2 something missing

The GPU machine runs its image's own python3 (PyTorch with CUDA, Triton, transformers; no
pyzmq, pydantic or xgrammar, an older protobuf): every row but the whole-server one drives
ModelRunner directly, so none of those may be needed; the server row installs the wheels
carried in .whl/ (bench/gpu_wheels.sh) for its own processes.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gpu_imports  # noqa: E402

# (module, why the check needs it): what the image must have itself.
NEEDED = [
    ("torch", "everything"),
    ("triton", "the attention kernels"),
    ("numpy", "batch inputs"),
    ("transformers", "model configs and the reference logits"),
    ("safetensors", "the model loader"),
    ("tqdm", "the model loader's progress"),
    ("pytest", "the GPU tests"),
]


def missing_modules() -> list[tuple[str, str, str]]:
    missing = []
    for module, why in NEEDED:
        try:
            importlib.import_module(module)
        except Exception as e:  # ImportError, or a broken install raising anything
            missing.append((module, why, f"{type(e).__name__}: {e}"))
    return missing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="no GPU needed (CPU smoke run)")
    args = parser.parse_args()
    gpu_imports.block()
    problems = missing_modules()
    for module, why, error in problems:
        print(f"gpu_check: the image lacks {module} ({why}): {error}", file=sys.stderr)
    if problems:
        return 2
    broken = gpu_imports.failures()
    for what, error in broken:
        print(f"gpu_check: {what} does not import on the GPU image: {error}", file=sys.stderr)
    if broken:
        return 2
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print(f"gpu_check: torch {torch.__version__} sees no CUDA device", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
