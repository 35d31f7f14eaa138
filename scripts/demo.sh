#!/usr/bin/env bash
# Sets up what the demo needs (scripts/setup.sh --demo: no DeepSpeed, no deployment tools) and runs `rlstream demo` on the embedded default:
# the local Kafka broker, a tiny model built in code, a toy verifiable task. Arguments go to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --demo
exec .venv/bin/rlstream demo "$@"
