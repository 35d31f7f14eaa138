"""The pipeline's topology and a run's identity on the cluster, written once.

* ``STAGES``: every stage (feed, rollout, reward, trainer, eval, tracking) with the topic it
  consumes in its consumer group, the topics it only follows (assign()-only readers, no group),
  and the topics it writes. ``PIPELINE`` names the stages with a consumer group, in pipeline order
  (prompts -> rollout -> rollouts -> reward -> scored -> trainer): the stages whose lag ``rlstream
  status``, the launcher's view, the stall check and the tracker report.
* ``RunIdentity``: the names a run takes on a shared cluster, from its topic prefix: the consumer
  group of each stage and the reward workers' transactional id prefix. ``DEFAULT`` is the identity
  of the default config; ``RunIdentity.of_job`` the one ``rlstream run``/``demo`` give a named job;
  ``RunIdentity.of_prefix`` the one ``rlstream chaos`` and ``rlstream bench`` give a run.
  ``transactional_id`` is the one rule from that prefix and a worker id to a ``transactional.id``.
* ``Topology``: the same facts resolved against a root config (topic names, the configured groups).

Names are part of a run's state: a restarted or resumed run must find the same consumer groups
(committed offsets) and transactional ids (zombie fencing), so these rules never change
(tests/test_topology.py pins them). Topic names themselves are ``TopicsConfig.name``'s.

This module is core: it reads a root config by its section names and never imports a role.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    name: str
    """The stage, also the config section that holds its ``group_id`` (when it has a group)."""
    input: str | None
    """Topic role it consumes as a member of its consumer group (None: no group)."""
    outputs: tuple[str, ...]
    """Topic roles it writes."""
    follows: tuple[str, ...] = ()
    """Topic roles it reads without a group (assign()-only: rl.control followers, resume scans)."""


STAGES: dict[str, Stage] = {
    s.name: s
    for s in (
        Stage("feed", None, ("prompts", "control"), follows=("prompts", "control")),
        Stage("rollout", "prompts", ("rollouts", "metrics", "dlq"), follows=("control",)),
        Stage("reward", "rollouts", ("scored", "metrics", "dlq")),
        Stage("trainer", "scored", ("control", "metrics", "dlq"), follows=("control",)),
        Stage("eval", None, ("metrics",), follows=("control",)),
        Stage("tracking", None, (), follows=("metrics",)),
    )
}
"""Every stage of the pipeline by name."""
PIPELINE: tuple[str, ...] = tuple(s.name for s in STAGES.values() if s.input is not None)
"""The stages with a consumer group, in pipeline order: ``("rollout", "reward", "trainer")``."""
TRANSACTIONAL_STAGE = "reward"
"""The stage whose workers write in transactions (rollouts -> rl.scored, exactly once)."""


def transactional_id(prefix: str, worker_id: str) -> str:
    """A reward worker's ``transactional.id``: ``<reward.transactional_id_prefix>-<worker id>``
    (``worker_id=""`` gives the prefix every such id starts with, as ACLs grant it)."""
    return f"{prefix}-{worker_id}"


@dataclass(frozen=True)
class RunIdentity:
    """A run's names on the cluster: its topic prefix and the base of its consumer groups."""

    topic_prefix: str
    group_prefix: str
    """A stage's consumer group is ``<group_prefix><stage>``."""

    @classmethod
    def of_job(cls, name: str) -> RunIdentity:
        """A named job (``rlstream run``/``demo``): topics ``<name>.*``, groups ``<name>-<stage>``."""
        return cls(f"{name}.", f"{name}-")

    @classmethod
    def of_prefix(cls, prefix: str) -> RunIdentity:
        """A run named by its topic prefix alone (chaos, bench): groups ``<prefix><stage>``."""
        return cls(prefix, prefix)

    def group(self, stage: str) -> str:
        if STAGES[stage].input is None:
            raise ValueError(f"stage {stage!r} has no consumer group")
        return f"{self.group_prefix}{stage}"

    @property
    def transactional_id_prefix(self) -> str:
        return self.group_prefix + TRANSACTIONAL_STAGE

    def settings(self) -> dict[str, str]:
        """The identity as config settings, dotted key -> value (``topics.prefix``, each stage's
        ``group_id``, ``reward.transactional_id_prefix``)."""
        return {
            "topics.prefix": self.topic_prefix,
            **{f"{s}.group_id": self.group(s) for s in PIPELINE},
            f"{TRANSACTIONAL_STAGE}.transactional_id_prefix": self.transactional_id_prefix,
        }


DEFAULT = RunIdentity("rl.", "rlstream-")
"""The identity of the default config: topics ``rl.*``, groups ``rlstream-<stage>``."""


class Topology:
    """The stages resolved against a root config (``cfg.topics`` and each stage's section)."""

    def __init__(self, cfg):
        self.cfg = cfg

    def topic(self, role: str) -> str:
        return self.cfg.topics.name(role)

    def group(self, stage: str) -> str:
        """The configured consumer group of a stage in ``PIPELINE``."""
        if STAGES[stage].input is None:
            raise ValueError(f"stage {stage!r} has no consumer group")
        return getattr(self.cfg, stage).group_id

    def input_topic(self, stage: str) -> str | None:
        role = STAGES[stage].input
        return None if role is None else self.topic(role)

    def inputs(self) -> list[tuple[str, str, str]]:
        """``(stage, input topic, consumer group)`` for each stage of ``PIPELINE``, in order."""
        return [(s, self.input_topic(s), self.group(s)) for s in PIPELINE]

    def transactional_id(self, worker_id: str) -> str:
        section = getattr(self.cfg, TRANSACTIONAL_STAGE)
        return transactional_id(section.transactional_id_prefix, worker_id)

    def names(self) -> dict[str, str]:
        """Every name the run uses on the cluster: ``topic.<role>`` (the lease too),
        ``group.<stage>`` and ``transactional_id_prefix``."""
        roles = [*self.cfg.topics.specs(), "lease", "job"]
        return {
            **{f"topic.{r}": self.topic(r) for r in roles},
            **{f"group.{s}": self.group(s) for s in PIPELINE},
            "transactional_id_prefix": getattr(self.cfg, TRANSACTIONAL_STAGE).transactional_id_prefix,
        }


def stage_lags(admin, cfg) -> dict[str, int]:
    """Lag in records of each stage of ``PIPELINE``: its group's committed offsets against the end
    of its input topic, summed over partitions (``admin``: a ``pipeline.admin.Admin``)."""
    return {s: sum(admin.lag(group, topic).values()) for s, topic, group in Topology(cfg).inputs()}
