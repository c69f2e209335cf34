#!/usr/bin/env bash
# Downloads, here where PyPI answers, the cp312 x86-64 wheels of everything the whole server
# needs that the GPU machine's image lacks (or holds at a version the generated stubs refuse),
# into .whl/ (git-ignored), and says their size against the device call's 64 MiB limit.
#
#   bash bench/gpu_wheels.sh      # then the device call with carry [".whl"] (docs/gpu.md)
#
# The set: radixserve's runtime requirements and all that they require (read from this
# .venv's installed metadata, markers evaluated for CPython 3.12 on Linux), at the versions
# this .venv holds, so the GPU runs what the tests here ran; minus the image's own compute
# stack (torch, triton, transformers, ...) and the packages the image already has, except
# protobuf and grpcio: the stubs in radixserve/ check that the runtime is at least the
# version they were generated with, and the image's protobuf is older. gpu_check.sh installs
# them with --no-index into a private folder that only the server's processes see, so every
# other step proves it runs without them.
set -eu
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
LIMIT_MIB=64
# The image's packages (/work/.library/device/KINDS.md, read 2026-11-17), normalised names.
IMAGE_HAS="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio
attrs certifi charset-normalizer click cloudpickle filelock frozenlist fsspec grpcio h11
hf-xet httpcore httpx huggingface-hub idna jinja2 markupsafe mpmath msgpack multidict
networkx ninja numpy packaging pillow pip prometheus-client propcache protobuf psutil
pyyaml regex requests rich safetensors sentencepiece setuptools six sympy tiktoken tokenizers
torch tqdm transformers triton typing-extensions urllib3 uvloop wheel yarl zipp"
ALWAYS="protobuf grpcio typing-extensions" # carried even where the image has one (pydantic: recent)

PKGS=$(IMAGE_HAS="$IMAGE_HAS" ALWAYS="$ALWAYS" "$PY" - <<'EOF'
import importlib.metadata as md
import os
import re

from packaging.requirements import Requirement

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

ENV = dict(extra="", python_version="3.12", python_full_version="3.12.3", os_name="posix",
           sys_platform="linux", platform_system="Linux", platform_machine="x86_64",
           implementation_name="cpython", platform_python_implementation="CPython")
image = set(os.environ["IMAGE_HAS"].split())
always = set(os.environ["ALWAYS"].split())
own = {"torch", "triton", "transformers", "tokenizers", "safetensors", "numpy", "tqdm"}
versions, todo = {}, [Requirement(r) for r in md.requires("radixserve")]
while todo:
    req = todo.pop()
    name = norm(req.name)
    if name in versions or name in own or (req.marker and not req.marker.evaluate(ENV)):
        continue
    dist = md.distribution(req.name)
    versions[name] = dist.version
    todo += [Requirement(r) for r in dist.requires or []]
print(" ".join(f"{n}=={v}" for n, v in sorted(versions.items()) if n not in image or n in always))
EOF
)
rm -rf .whl && mkdir -p .whl
platforms=()
for tag in manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 \
    manylinux_2_34 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
for pkg in $PKGS; do
    "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp "${platforms[@]}" -d .whl "$pkg"
done
ls .whl
bytes=$(du -cb .whl/*.whl | tail -n 1 | cut -f1)
tree=$(git ls-files -z | du -cb --files0-from=- 2> /dev/null | tail -n 1 | cut -f1)
echo "gpu_wheels: $(ls .whl/*.whl | wc -l) wheels, $((bytes / 1024)) KiB; with the working tree" \
    "($((tree / 1024)) KiB tracked) $(((bytes + tree) / 1048576)) of the call's $LIMIT_MIB MiB"
if [ $((bytes + tree)) -ge $((LIMIT_MIB * 1048576)) ]; then
    echo "gpu_wheels: over the $LIMIT_MIB MiB the device call carries" >&2
    exit 1
fi
