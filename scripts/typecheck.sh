#!/usr/bin/env bash
# mypy over the package as it installs: kvstore/, with client/ and server/ as kvstore.client and
# kvstore.server (pyproject's package-dir), linked into a temporary folder so that every import
# between them resolves. Settings in pyproject.toml ([tool.mypy]). Needs .venv (scripts/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

.venv/bin/python -m pip install -q mypy==2.4.1  # pinned: a newer mypy may find new errors
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/kvstore"
for entry in kvstore/*; do ln -s "$root/$entry" "$tree/kvstore/"; done
ln -s "$root/client" "$tree/kvstore/client"
ln -s "$root/server" "$tree/kvstore/server"
cd "$tree"
exec "$root/.venv/bin/python" -m mypy --config-file "$root/pyproject.toml" -p kvstore "$@"
