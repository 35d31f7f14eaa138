"""Libraries any role may import: the generation engines (``libs.engines``) with chat templates
(``libs.chat``) and prompt datasets (``libs.datasets``), and the reward functions with their
scoring pool and sandbox (``libs.rewards``). They stand on the core (``pipeline``) and never import
a role: the rollout workers, the reward workers and the evaluator all use them."""
