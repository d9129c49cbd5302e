#!/usr/bin/env bash
# Sets up everything the test suite needs on a fresh Debian/Ubuntu machine, then runs it.
# Idempotent: a second run reuses .venv and installed packages. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

sudo_() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null || ! command -v openssl >/dev/null \
   || ! command -v systemd-analyze >/dev/null; then
  sudo_ apt-get update -qq
  sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools openssl systemd >/dev/null
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned, the CPU build: where pip finds no local CPU wheel (PyPI's Linux wheels are
# CUDA builds, several GB), point it at one: TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
# shellcheck disable=SC2086  # (TORCH_PIP_ARGS is a list of pip options)
.venv/bin/python -m pip install -q ${TORCH_PIP_ARGS:-} torch==2.13.0
.venv/bin/python -m pip install -q -e '.[test]'

# Two workers (pytest-xdist): the tests mostly wait on the servers they start, so two halve the
# run on two cores. KVSTORE_TEST_WORKERS=0 (or a later -n 0) runs them in this one process.
exec .venv/bin/python -m pytest -n "${KVSTORE_TEST_WORKERS:-2}" "$@"
