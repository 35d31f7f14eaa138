"""rlstream's application layer: the ``rlstream`` command line, the Python API (``rlstream.Job``),
the root config that composes the roles' sections, the job launcher and demo, the process
supervisor, ``rlstream status``, run reports, the local dev broker and the benchmarks.

Everything below it (``pipeline`` the core, ``producers`` and ``consumers`` the roles, ``schemas``)
never imports it. It is the only layer that knows every role.

``import rlstream`` stays light (no torch, no Kafka client): ``Job`` is imported on first use.
"""

__version__ = "0.1.0"
__all__ = ["Job", "__version__"]


def __getattr__(name: str):
    if name == "Job":
        from rlstream.api import Job

        return Job
    raise AttributeError(f"module 'rlstream' has no attribute {name!r}")
