#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the whole test suite against a real Kafka broker:
# KAFKA_BOOTSTRAP if set, else testcontainers if a Docker engine answers, else the local broker,
# which the test session starts and stops itself. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --real-model
. .venv/bin/activate
echo "[test] ruff"
ruff check .
ruff format --check .
echo "[test] pytest"
exec python -m pytest "$@"
