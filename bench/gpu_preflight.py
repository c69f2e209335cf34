"""Can this Python run the GPU check? Imports everything bench/gpu_check.sh reaches and
names what is missing, with the way to bring it (bench/gpu_wheels.sh).

    python3 bench/gpu_preflight.py [--smoke]     # exit 0 ready, 2 something missing

The GPU machine runs its image's own python3 (PyTorch with CUDA, Triton, transformers; no
pyzmq, pydantic or xgrammar): the check drives ModelRunner directly (no protobuf, no ZeroMQ),
but the worker imports xgrammar for constrained decoding, so its wheels travel in .whl/.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (module, why the check needs it)
NEEDED = [
    ("torch", "everything"),
    ("triton", "the attention kernels"),
    ("numpy", "batch inputs"),
    ("transformers", "model configs and the reference logits"),
    ("safetensors", "the model loader"),
    ("tqdm", "the model loader's progress"),
    ("xgrammar", "services/worker/grammar (constrained decoding, imported by ModelRunner)"),
    ("pytest", "tests/unit/test_kernels.py"),
    ("kernels.decode_attention", "this repository's kernels"),
    ("services.worker.model_runner", "the worker's compute path"),
    ("bench.gpu_model_check", "the model rows"),
]
WHEELS_HINT = (
    "bring the missing wheels: here (where PyPI answers) run `bash bench/gpu_wheels.sh`, then "
    "carry .whl with the device call; gpu_check.sh installs them with --no-index"
)


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
    problems = missing_modules()
    for module, why, error in problems:
        print(f"gpu_check: cannot import {module} ({why}): {error}", file=sys.stderr)
    if problems:
        print(f"gpu_check: {WHEELS_HINT}", file=sys.stderr)
        return 2
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print(f"gpu_check: torch {torch.__version__} sees no CUDA device", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
