#!/usr/bin/env bash
# The GPU check: runs the `gpu` test tier (tests/test_gpu.py) on a CUDA machine that has torch and
# transformers but no internet, and prints its figures (tokens/s, steps/s):
#   HF engine generation on CUDA, a torch-engine bf16 step (float32 masters), DeepSpeed ZeRO-2 on
#   one GPU, the LoRA path (train adapters, apply them in the hf engine), a small end-to-end run.
#
#   scripts/gpu-check.sh                  run it (here: the repository root on the GPU machine)
#   scripts/gpu-check.sh --prepare DIR    on a machine WITH internet: download the wheels the GPU
#                                         machine may lack (rlstream's light dependencies, peft,
#                                         pytest) into DIR; carry DIR along
#   scripts/gpu-check.sh --wheelhouse DIR install what is missing from DIR (pip --no-index), then run
#
# Python: $PYTHON, else .venv/bin/python if it exists, else python3. The project is used from this
# directory (PYTHONPATH), nothing is installed into it. Kafka: the end-to-end test needs a broker:
# KAFKA_BOOTSTRAP if set, else the local broker when Java and its cached jars (~/.m2, see
# infra/kafka) are there; otherwise that one test is left out, and the script says so.
# DeepSpeed and peft tests skip (with the reason) when those packages are absent.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '\033[1m[gpu-check]\033[0m %s\n' "$*"; }

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
WHEELS=""
PREPARE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --prepare) PREPARE=$2; shift 2 ;;
    --wheelhouse) WHEELS=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
LIGHT=(confluent-kafka==2.16.1 "fastavro>=1.9,<2" "typer>=0.12" "pydantic>=2.7,<3" "rich>=13" "prometheus-client>=0.20"
       "fsspec>=2024.1" peft==0.21.2 "pytest>=8")

if [ -n "$PREPARE" ]; then
  mkdir -p "$PREPARE"
  say "downloading wheels into $PREPARE (for $($PY -c 'import sys; print(sys.version.split()[0])'))"
  # peft's own dependencies (accelerate, ...) come along; torch and transformers are expected on the GPU machine
  $PY -m pip download -q --dest "$PREPARE" --only-binary=:all: "${LIGHT[@]}" accelerate
  ls "$PREPARE"
  exit 0
fi

if [ -n "$WHEELS" ]; then
  say "installing missing packages from $WHEELS (no index)"
  $PY -m pip install -q --no-index --find-links "$WHEELS" "${LIGHT[@]}"
fi

$PY - <<'EOF'
import sys
try:
    import torch, transformers
except ImportError as exc:
    sys.exit(f"[gpu-check] torch and transformers are required: {exc}")
if not torch.cuda.is_available():
    sys.exit("[gpu-check] torch sees no CUDA device: nothing to check here (the gpu tests would all skip)")
print(f"[gpu-check] torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
      f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
missing = []
for mod in ("confluent_kafka", "fastavro", "typer", "pydantic", "rich", "prometheus_client", "fsspec", "pytest"):
    try:
        __import__(mod)
    except ImportError:
        missing.append(mod)
if missing:
    sys.exit(f"[gpu-check] missing {missing}: run scripts/gpu-check.sh --prepare DIR where there is internet, "
             "then scripts/gpu-check.sh --wheelhouse DIR here")
for mod in ("peft", "deepspeed"):
    try:
        __import__(mod)
    except ImportError:
        print(f"[gpu-check] {mod} not installed: its tests will skip")
EOF

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SELECT=(-m gpu)
if [ -z "${KAFKA_BOOTSTRAP:-}" ]; then
  if ! command -v java >/dev/null 2>&1; then
    say "no Java and no KAFKA_BOOTSTRAP: leaving out the end-to-end run (it needs a Kafka broker)"
    SELECT=(-m "gpu and not kafka")
  elif ! $PY -c 'from rlstream.broker import classpath; classpath()' >/dev/null 2>&1; then
    say "the local broker's jars are not cached here (no internet for Maven): leaving out the end-to-end run;"
    say "set KAFKA_BOOTSTRAP=host:port of a reachable broker to include it"
    SELECT=(-m "gpu and not kafka")
  fi
fi

say "running: pytest ${SELECT[*]} tests/test_gpu.py"
out=$(mktemp)
set +e
$PY -m pytest "${SELECT[@]}" -s -q -rs -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$out"
rc=${PIPESTATUS[0]}
set -e
echo
say "figures:"
grep '^\[gpu\]' "$out" || say "(none: every test skipped or failed before measuring)"
rm -f "$out"
exit "$rc"
