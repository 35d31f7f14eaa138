#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs `rlstream demo` on the embedded default:
# the local Kafka broker, a tiny model built in code, a toy verifiable task. Arguments go to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/rlstream demo "$@"
