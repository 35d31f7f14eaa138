"""A whole RL pipeline in one test process: the feed, rollout workers (hf engine), a reward worker
and the trainer as threads on a real broker, on the demo's next-digit task (its settings copied
from ``rlstream demo``: a random-init character model learns ``7>`` -> ``8`` by RL alone).

Consumer groups get the test's topic prefix, so runs sharing the session's broker never meet.
``run`` returns when the trainer reached its step count (or raises what killed a role) and stops
every role it started.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from pipeline.topology import RunIdentity
from rlstream.demo import TASK, model_settings, write_task  # noqa: F401  (write_task: the tests' task file)


def settings(task_file: Path, prefix: str, steps: int, G: int = 8, n: int = 8, k: int = 1) -> list[str]:
    """The demo's task and model settings, sized for a test."""
    return [
        "topics.prompts.partitions=2",
        "topics.rollouts.partitions=2",
        "topics.scored.partitions=2",
        f"rl.group_size={n}",
        f"rl.groups_per_step={G}",
        f"rl.max_staleness={k}",
        f"feed.source={json.dumps(str(task_file))}",
        "feed.epochs=100000",
        "feed.shuffle_seed=0",
        f"feed.limit={steps * G * 4 + 64}",
        "rollout.max_inflight=64",
        "rollout.max_new_tokens=2",
        "rollout.temperature=1.0",
        "reward.executor=thread",
        "reward.pool_size=1",
        "reward.max_batch_ms=50",
        f'reward.tasks={{{TASK} = [{{name = "exact_match", kwargs = {{extract_regex = "^(.)"}}}}]}}',
        "trainer.micro_batch_size=64",
        "trainer.group_timeout_s=120",
        "trainer.poll_timeout_s=0.2",
        "trainer.keep_weight_versions=3",
        "model.type=tiny",
        *(f"{k}={json.dumps(v)}" for k, v in model_settings().items()),  # keys come with "model."
        # the run's consumer groups and transactional ids under the test's prefix
        *(f"{k}={json.dumps(v)}" for k, v in RunIdentity.of_prefix(prefix).settings().items() if k != "topics.prefix"),
    ]


class RoleThread:
    def __init__(self, name: str, target):
        self.name, self.error, self.result = name, None, None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(target,), name=name, daemon=True)
        self.thread.start()

    def _run(self, target):
        try:
            self.result = target(self.stop)
        except BaseException as exc:  # reported by check()
            self.error = exc

    def check(self):
        if self.error is not None:
            raise AssertionError(f"{self.name} died: {self.error!r}") from self.error

    def join(self, timeout: float = 120.0):
        self.stop.set()
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise AssertionError(f"{self.name} did not stop within {timeout} s")


class Pipeline:
    """Fed, then a reward worker, a rollout worker and the trainer as threads on ``cfg``'s topics (for
    the control-plane tests, which write beside it): ``wait`` polls a condition, re-raising what
    killed a role; ``join`` stops them all."""

    def __init__(self, cfg):
        from consumers.reward.worker import RewardWorker
        from consumers.trainer.worker import Trainer
        from producers import feed
        from producers.rollout import RolloutWorker

        feed.run(cfg)
        self.trainer = Trainer(cfg, max_steps=100_000)
        self.rollout = RolloutWorker(cfg)
        self.roles = [RoleThread("reward", RewardWorker(cfg).run), RoleThread("rollout", self.rollout.run)]
        self.roles.append(RoleThread("trainer", self.trainer.run))

    def wait(self, cond, what: str, timeout: float = 120.0):
        deadline = time.monotonic() + timeout
        while not (got := cond()):
            self.check()  # e.g. a rollout worker that died on a bad notice
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.5)
        return got

    def check(self) -> None:
        for r in self.roles:
            r.check()

    def join(self) -> None:
        for r in self.roles:
            r.join()


def forged_dead_letters(cfg, role: str | None = None) -> dict[str, tuple[str, str]]:
    """``metadata["forged"]`` tag -> (error_type, reason) of the WeightUpdates on rl.dlq (dead-lettered
    by ``role``, or by any)."""
    from pipeline import codec
    from tests.rollout_helpers import read_topic

    out = {}
    for _, dl in read_topic(cfg, "dlq", "DeadLetter"):
        name, rec = codec.decode(dl["value"])
        if name == "WeightUpdate" and "forged" in rec["metadata"] and role in (None, dl["role"]):
            out.setdefault(rec["metadata"]["forged"], (dl["error_type"], dl["reason"]))
    return out


def run(cfg, steps: int, rollout_workers: int = 1, timeout: float = 900.0) -> dict:
    """Feed, then rollout + reward + trainer threads until the trainer has done ``steps`` steps.
    Returns ``{"trainer": Trainer, "rollout": [stats], "seconds": wall time}``."""
    # transformers resolves its names lazily and not thread-safely: import them before the threads do
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    from consumers.reward.worker import RewardWorker
    from consumers.trainer.worker import Trainer
    from producers import feed
    from producers.rollout import RolloutWorker

    feed.run(cfg)
    t0 = time.monotonic()
    trainer = Trainer(cfg, max_steps=steps)
    roles = [RoleThread("reward", RewardWorker(cfg).run)]
    for i in range(rollout_workers):
        w = RolloutWorker(
            cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"worker_id": f"rollout-{i}"})})
        )
        roles.append(RoleThread(f"rollout-{i}", w.run))
    main = RoleThread("trainer", trainer.run)
    try:
        deadline = time.monotonic() + timeout
        while main.thread.is_alive():
            for r in [main, *roles]:
                r.check()
            if time.monotonic() > deadline:
                raise AssertionError(f"trainer stuck at step {trainer.step} of {steps} after {timeout} s")
            time.sleep(0.2)
        main.check()
    finally:
        for r in [main, *roles]:
            r.join()
    for r in roles:
        r.check()
    return {"trainer": trainer, "rollout": [r.result for r in roles[1:]], "seconds": time.monotonic() - t0}
