"""Reward workers and reward functions."""
