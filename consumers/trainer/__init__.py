"""Trainer workers, advantages, losses and train engines."""
