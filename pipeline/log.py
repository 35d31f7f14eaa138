"""Standard-library logging for rlstream, with ``key="value"`` fields.

``log.info("loaded weights %s", kv(version=3, latency_ms=41.2))`` prints
``loaded weights version="3" latency_ms="41.2"``.
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def kv(**fields) -> str:
    return " ".join(f'{k}="{v}"' for k, v in fields.items())


def setup_logging(level: str = "INFO") -> None:
    root = logging.getLogger()
    if not any(getattr(h, "_rlstream", False) for h in root.handlers):
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter(FORMAT))
        h._rlstream = True  # type: ignore[attr-defined]
        root.addHandler(h)
    root.setLevel(level)
