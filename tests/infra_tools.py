"""Where the deployment tests find their tools: the ones scripts/setup-infra-tools.sh installs
(helm, compose-config, the Kafbat serde build, kubernetes-validate) and the real ``rlstream`` CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOLS_BIN = Path(os.environ.get("RLSTREAM_CACHE", Path.home() / ".cache" / "rlstream")) / "bin"
SETUP = "scripts/setup-infra-tools.sh"


def tool(name: str) -> str | None:
    """A tool built by scripts/setup-infra-tools.sh, else one on PATH, else None."""
    built = TOOLS_BIN / name
    return str(built) if built.is_file() and os.access(built, os.X_OK) else shutil.which(name)


def rlstream(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the real ``rlstream`` console script of this environment."""
    exe = Path(sys.executable).with_name("rlstream")
    cmd = [str(exe) if exe.exists() else "rlstream", *args]
    base = {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM_")}
    return subprocess.run(cmd, env={**base, **(env or {})}, capture_output=True, text=True, timeout=timeout)
