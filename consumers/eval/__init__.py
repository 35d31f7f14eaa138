"""The eval role (``rlstream eval``): follows rl.control and scores every Nth published version on a
held-out set with the same generation engines and reward functions as the pipeline (``libs``)."""
