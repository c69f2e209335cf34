#!/usr/bin/env bash
# Downloads, here where PyPI answers, the cp312 wheels that bench/gpu_check.sh needs and the
# GPU machine's image lacks (it has torch, triton, transformers, safetensors, numpy, pytest;
# not xgrammar and what it needs), into .whl/ (git-ignored). Versions are the ones this
# checkout's .venv holds, so the GPU runs what the tests here ran. Carry .whl with the device
# call; gpu_check.sh installs them with --no-index into a private folder.
#
#   bash bench/gpu_wheels.sh        # then: the device call with carry [".whl"]
set -eu
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PKGS="xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection"
rm -rf .whl && mkdir -p .whl
for pkg in $PKGS; do
    version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$pkg")
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
        "$pkg==$version"
done
du -sh .whl
ls .whl
