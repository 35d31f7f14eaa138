"""The control plane: policy versions, bounded staleness, and the rl.control topic.

Versions: ``v`` counts the weight updates the trainer has published (``v = 0`` is the initial
model). With ``k = max_staleness`` and ``G = groups_per_step``:

* **Hard bound (trainer).** At version ``v`` (computing ``v + 1``), a sample is usable only if
  ``v - version_min <= k``. Others are masked out and counted (``is_stale``).
* **Admission (producers).** The feed numbers groups ``group_seq = 0, 1, 2, ...``. A worker
  holding version ``v`` starts group ``g`` only if ``g < (v + k + 1) * G``
  (``may_admit``; AReaL's rule, counted in groups). With ``k = 0`` that is synchronous RL: the
  groups of step ``s`` start only once version ``s`` is loaded.

The trainer counts every group it closes (complete, or incomplete past its timeout) towards its
step's ``G``, so admission and training stay aligned and nothing can deadlock.

Control messages are WeightUpdate and Command records on a one-partition topic; a late joiner
reads it from the start (it is small: one record per version) and keeps the newest notice.
"""

from __future__ import annotations

import logging
import time

from pipeline import codec
from pipeline.errors import DecodeError
from pipeline.kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition, client_conf
from pipeline.log import kv

log = logging.getLogger(__name__)
WEIGHTS_KEY = b"weights"
COMMAND_KEY = b"command"


def is_stale(current_version: int, version_min: int, k: int) -> bool:
    """True if a sample generated from ``version_min`` may not train version ``current_version``."""
    return current_version - version_min > k


def admission_limit(loaded_version: int, k: int, groups_per_step: int) -> int:
    """Groups with ``group_seq`` below this may start at ``loaded_version``."""
    return (loaded_version + k + 1) * groups_per_step


def may_admit(group_seq: int, loaded_version: int, k: int, groups_per_step: int) -> bool:
    return group_seq < admission_limit(loaded_version, k, groups_per_step)


def required_version(group_seq: int, k: int, groups_per_step: int) -> int:
    """The lowest loaded version at which group ``group_seq`` may start."""
    return max(0, group_seq // groups_per_step - k)


def now_ms() -> int:
    return int(time.time() * 1000)


def publish_weight_update(producer: Producer, topic: str, update: dict, timeout: float = 30.0) -> None:
    """Publish a WeightUpdate and wait (up to ``timeout``, riding out a broker outage) until the
    broker has it. Call only after the checkpoint at ``update["uri"]`` is completely written."""
    producer.produce_record(topic, "WeightUpdate", update, key=WEIGHTS_KEY)
    producer.flush_patiently(timeout, f"weight update v{update['version']}")
    log.info("published weight update %s", kv(topic=topic, version=update["version"], uri=update["uri"]))


def publish_command(producer: Producer, topic: str, name: str, args: dict | None = None, by: str = "") -> None:
    rec = {"name": name, "args": args or {}, "issued_by": by, "created_at_ms": now_ms()}
    producer.produce_record(topic, "Command", rec, key=COMMAND_KEY)
    producer.flush(30)


class ControlFollower:
    """Follows the control topic. ``poll`` returns new ``(name, record)`` pairs in order;
    ``latest_update`` is the newest WeightUpdate seen (by version). Undecodable records are
    logged and skipped (the control topic is written only by rlstream)."""

    def __init__(self, cfg, role: str, worker_id: str | None = None):
        self.topic = cfg.topics.name("control")
        self.consumer = Consumer(client_conf(cfg, f"{role}-control", worker_id, kind="consumer"))
        self.consumer.assign([TopicPartition(self.topic, 0, OFFSET_BEGINNING)])
        self.latest_update: dict | None = None
        self.commands: list[dict] = []

    def poll(self, timeout: float = 0.0, max_records: int = 100) -> list[tuple[str, dict]]:
        out = []
        for msg in self.consumer.consume(max_records, timeout):
            try:
                name, rec = codec.decode(msg.value())
            except DecodeError as exc:
                log.error("skipping undecodable control record %s", kv(offset=msg.offset(), error=exc))
                continue
            if name == "WeightUpdate":
                if self.latest_update is None or rec["version"] > self.latest_update["version"]:
                    self.latest_update = rec
            elif name == "Command":
                self.commands.append(rec)
            out.append((name, rec))
        return out

    def catch_up(self, timeout: float = 10.0) -> dict | None:
        """Read everything already on the topic; return the newest WeightUpdate (or None)."""
        deadline = time.monotonic() + timeout
        # a just-created topic may have no leader yet: transient, so retried
        lo, hi = self.consumer.watermarks(self.topic, 0, timeout)
        while time.monotonic() < deadline:
            pos = self.consumer.position([(self.topic, 0)])[(self.topic, 0)]
            if hi <= lo or pos >= hi:
                break
            self.poll(0.2, 1000)
        else:
            raise TimeoutError(f"could not read {self.topic} to offset {hi} within {timeout} s")
        return self.latest_update

    def wait_for_version(self, version: int, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.latest_update and self.latest_update["version"] >= version:
                return self.latest_update
            self.poll(0.2)
        return self.latest_update if self.latest_update and self.latest_update["version"] >= version else None

    def close(self) -> None:
        self.consumer.close()
