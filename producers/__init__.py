"""Rollout side of rlstream: prompt feeding, rollout workers, generation engines, environments."""
