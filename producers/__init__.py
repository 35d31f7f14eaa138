"""Rollout side of rlstream: prompt feeding, rollout workers, their commits, weight sync and environments (the generation engines are ``libs.engines``)."""
