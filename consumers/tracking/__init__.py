"""The tracking role (``rlstream track``): follows rl.metrics and writes TensorBoard / W&B."""
