#!/usr/bin/env bash
# Regenerates the reference pages under docs/reference/ (cli.md, config.md, metrics.md) from the
# code; `scripts/gen-docs.sh --check` only says which are stale (exit 1).
set -euo pipefail
cd "$(dirname "$0")/.."
py=python
[ -x .venv/bin/python ] && py=.venv/bin/python
exec "$py" -m rlstream.dev.docgen "$@"
