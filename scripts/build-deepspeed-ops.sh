#!/usr/bin/env bash
# Pre-builds DeepSpeed's JIT ops that a CPU run needs, so no test or training run pays for the
# one-off compile (~60 s on 2 cores). Today that is the shm_comm op that DeepSpeed's torch comm
# backend loads on its first `deepspeed.initialize`/`init_distributed` with DS_ACCELERATOR=cpu.
# The build goes to torch's extensions cache: $TORCH_EXTENSIONS_DIR if set, else torch's default
# ~/.cache/torch_extensions/<py>_<cuda>/ -- the place every later process looks, so a second run
# (and every training run) only loads the cached .so. Keep TORCH_EXTENSIONS_DIR the same (or
# unset) at build and run time.
# The ninja that builds must be the one later runs use: ninja 1.12 changed the command hash in
# .ninja_log, so a system ninja (1.11) and the venv's pip ninja (1.13) each see the other's build as
# stale and rebuild. This script puts the venv's bin dir first on PATH (as an activated venv does),
# and the DeepSpeed engine does the same before it loads the op.
#   scripts/build-deepspeed-ops.sh [python]
set -euo pipefail
PYBIN=${1:-python}
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
BIN_DIR=$(cd "$(dirname "$PYBIN")" && pwd)
[ "$PYBIN" = python ] || export PATH="$BIN_DIR:$PATH"
env -u CUDA_HOME "$PYBIN" - <<'PY'
import logging
import time

logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
t0 = time.monotonic()
from deepspeed.comm.torch import build_shm_op  # noqa: E402
from torch.utils.cpp_extension import _get_build_directory  # noqa: E402

op = build_shm_op()
state = "ready" if op is not None else "not compatible here (skipped)"
where = _get_build_directory("deepspeed_shm_comm", False)
print(f"[deepspeed-ops] shm_comm {state} in {time.monotonic() - t0:.1f}s ({where})")
PY
