"""What every ``rlstream`` command shares: the ``--config``/``--set`` options, the root options'
sources, resolving the config (``load``), the console, and SIGTERM unwinding. Used by the command
line (``rlstream.cli``) and by the dev tools' commands (``rlstream.dev.commands``)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

console = Console(stderr=True)
ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file.", show_default=False)]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", "-s", help="Override: section.key=value (repeatable).", show_default=False)
]
root: dict = {}
"""The root options (``config``, ``set``) and whether this process is a supervised role."""


def sources(config: Path | None = None, set_: list[str] | None = None) -> tuple[Path | None, list[str]]:
    """The config file and ``--set`` items of the root options and of the command's own."""
    return config or root.get("config"), [*root.get("set", []), *(set_ or [])]


def load(config: Path | None = None, set_: list[str] | None = None, resolve: bool = True, settings=None):
    """Resolve the config (``settings``: the command's own flags, dotted key -> value, over
    ``--set``), set up logging and (``resolve``) fix the Kafka bootstrap address; run by hand, also
    check that a broker answers there (BrokerUnreachable, in one line, if none does)."""
    from pipeline.log import setup_logging
    from rlstream.config import load_config, require_broker, resolve_bootstrap

    cfg = load_config(*sources(config, set_), settings=settings)
    setup_logging(cfg.log_level)
    quiet_clients()
    if resolve:
        resolve_bootstrap(cfg)
        if not root.get("supervised"):  # a supervised role retries for liveness.startup_timeout_s
            require_broker(cfg)
    return cfg


def quiet_clients() -> None:
    """Run by hand (a terminal's command, not a supervised role, which logs to its own file), keep
    librdkafka's lines off the terminal: into ``<RLSTREAM_HOME>/logs/kafka-clients.log`` (a job's
    launcher moves them into its run dir)."""
    if root.get("supervised"):
        return
    import os

    from pipeline.kafka import client_log_to

    home = Path(os.environ.get("RLSTREAM_HOME") or Path.home() / ".rlstream")
    client_log_to(home / "logs" / "kafka-clients.log")


def sigterm_unwinds() -> None:
    """SIGTERM raises KeyboardInterrupt, so the command's ``finally`` blocks stop what it started
    (its roles, its temporary broker) instead of dying and orphaning them."""

    def on_term(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
