"""Consumer side of rlstream: reward workers (``consumers.reward``), trainers (``consumers.trainer``), the evaluator (``consumers.eval``) and experiment tracking (``consumers.tracking``)."""
