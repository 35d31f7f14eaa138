"""Consumer side of rlstream: reward workers (``consumers.reward``) and trainers (``consumers.trainer``)."""
