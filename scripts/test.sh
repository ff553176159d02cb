#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what the tests need (the package
# with its dev extra; Debian's chromium, Node 24, code-server and the built .vsix for the
# VS Code tests), then runs the extension's unit tests, builds docs/ and runs the Python suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh --dev
bash scripts/setup_vscode_e2e.sh
(cd vscode-extension && npm test)
# the reference in docs/: --strict fails on a broken link or anchor (the site is thrown away)
"$PY" -m mkdocs build --strict --site-dir "$(mktemp -d)"
exec "$PY" -m pytest -q "$@"
