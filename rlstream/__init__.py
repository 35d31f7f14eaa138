"""rlstream's application layer: the ``rlstream`` command line, the root config that composes the
roles' sections, the job launcher and demo, the process supervisor, ``rlstream status``, run
reports, the local dev broker and the benchmarks.

Everything below it (``pipeline`` the core, ``producers`` and ``consumers`` the roles, ``schemas``)
never imports it. It is the only layer that knows every role.
"""

__version__ = "0.1.0"
