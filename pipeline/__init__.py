"""rlstream's shared core: config, Kafka client wrappers, topic specs, codecs, control plane,
metrics and the CLI. Role-specific code lives in ``producers`` and ``consumers``."""

__version__ = "0.1.0"
