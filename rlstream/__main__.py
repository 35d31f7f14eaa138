"""``python -m rlstream``: the same as the ``rlstream`` command."""

from rlstream.cli import run_cli

run_cli()
