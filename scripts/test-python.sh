#!/usr/bin/env bash
# The default suite on another Python than the one scripts/test.sh uses (the project supports 3.10+):
#   scripts/test-python.sh 3.13 [pytest args]
# It makes a virtualenv .venv-py<version> with the test extras but without torch (the CPU wheel at
# hand is for one Python; PyPI's Linux wheels are multi-GB CUDA builds), so the torch tests are
# left out (KVSTORE_TEST_WITHOUT_TORCH=1). Run scripts/test.sh first: it installs redis-server and
# the other system tools the tests start. The interpreter is pyenv's newest <version> (3.13, or 3.13.0),
# else python<version> on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."

which=false
if [ "${1:-}" = --which ]; then which=true; shift; fi  # only say which interpreter (exit 3: none)
version=${1:?usage: scripts/test-python.sh [--which] VERSION [pytest args], e.g. 3.13}
shift
# pyenv's own interpreters first (its shim on PATH fails for a version pyenv has not selected)
py=""
for candidate in $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$version"*/bin/python 2>/dev/null | sort -rV) \
                 $(command -v "python$version" || true); do
  if "$candidate" -c "import sys; v = tuple(map(int, '$version'.split('.'))); sys.exit(sys.version_info[:len(v)] != v)" \
      2>/dev/null; then
    py=$candidate
    break
  fi
done
if [ -z "$py" ]; then
  echo "scripts/test-python.sh: no Python $version here (python$version on PATH, or pyenv's)" >&2
  exit 3
fi
if $which; then echo "$py"; exit 0; fi

venv=.venv-py$version
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -e '.[test]'
echo "== $("$venv/bin/python" --version), without torch"
KVSTORE_TEST_WITHOUT_TORCH=1 exec "$venv/bin/python" -m pytest -n "${KVSTORE_TEST_WORKERS:-2}" "$@"
