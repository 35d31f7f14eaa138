"""rlstream's core: the Kafka wrapper (``kafka``, ``admin``), the Avro codec, the control plane
(versions, staleness, admission), the checkpoint store, worker metrics, the worker lifecycle,
the plug-in registry, typed errors, logging and the config sections every role shares.

What this is not: a role or an application. Nothing here imports ``producers``, ``consumers`` or
``rlstream`` (checked by tests/test_layers.py).
"""

__version__ = "0.1.0"
