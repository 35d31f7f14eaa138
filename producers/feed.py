"""The prompt feed: publishes a dataset's prompts to rl.prompts, group by group, for some epochs.

Group numbering: the g-th group of the run (counting across epochs) gets ``group_seq = g`` and
``group_id = f"{prompt_id}@e{epoch}"``; epoch e covers ``g`` in ``[e*N, (e+1)*N)`` for a dataset
of N records (shuffled per epoch if ``shuffle_seed`` is set). Admission control in the rollout
workers is driven by group_seq, so there is one feed per topic prefix.

Prompt replication (``replicate = m``): a group's n samples are split into m messages
(``sample_start``/``sample_count``) placed on m distinct partitions, so several workers generate
one group; trajectories are still keyed by group_id. Without replication a group is one message,
keyed (and partitioned) by group_id.

Resume, exactly: every ``checkpoint_every`` groups and at the end, the feed flushes (all sent
messages acknowledged), then writes a feed-state record to rl.control (a ``Command`` named
``feed_state`` keyed ``feed/<name>``) holding the next group_seq, the dataset hash and the
prompts topic's end offsets. A restarted feed reads the newest state, then reads rl.prompts from
those offsets to the end and skips every (group_seq, sample_start) already there, so messages
sent after the last state record are not sent twice and none is lost. A changed dataset is an
error (group numbering would no longer mean the same prompts).

What this is not: a scheduler; workers pull from rl.prompts at their own pace.
"""

from __future__ import annotations

import json
import logging
import random
import time
import zlib

from confluent_kafka import TopicPartition

from pipeline.control import ControlFollower, now_ms
from pipeline.errors import ConfigError, DecodeError
from pipeline.kafka import Consumer, Producer, client_conf, decode_message, retry_transient
from pipeline.log import kv
from producers.datasets import dataset_hash, load_dataset

log = logging.getLogger(__name__)
STATE_COMMAND = "feed_state"


def split_group(n: int, parts: int) -> list[tuple[int, int]]:
    """(sample_start, sample_count) of each message of a group of ``n`` split ``parts`` ways."""
    parts = max(1, min(parts, n))
    base, extra = divmod(n, parts)
    out, start = [], 0
    for j in range(parts):
        count = base + (1 if j < extra else 0)
        out.append((start, count))
        start += count
    return out


def watermarks(consumer: Consumer, topic: str, partition: int, timeout: float = 30.0) -> tuple[int, int]:
    """(low, high) offsets, retrying while a fresh topic's leader is not yet known."""
    tp = TopicPartition(topic, partition)
    return retry_transient(lambda: consumer.client.get_watermark_offsets(tp, timeout=10), timeout)


def read_state(cfg, name: str) -> dict | None:
    """The newest feed-state record of feed ``name`` on rl.control, or None."""
    follower = ControlFollower(cfg, "feed")
    try:
        follower.catch_up(cfg.kafka.request_timeout_s)
        states = [c for c in follower.commands if c["name"] == STATE_COMMAND and c["args"].get("feed") == name]
    finally:
        follower.close()
    if not states:
        return None
    a = states[-1]["args"]
    return {
        "next_group_seq": int(a["next_group_seq"]),
        "dataset_sha256": a["dataset_sha256"],
        "offsets": {int(p): int(o) for p, o in json.loads(a["offsets"]).items()},
    }


def scan_sent(cfg, name: str, offsets: dict[int, int]) -> set[tuple[int, int]]:
    """(group_seq, sample_start) of feed ``name``'s prompts at or after ``offsets`` on rl.prompts."""
    topic = cfg.topics.name("prompts")
    c = Consumer(client_conf(cfg, "feed-scan", kind="consumer"))
    try:
        meta = c.client.list_topics(topic, timeout=cfg.kafka.request_timeout_s).topics[topic]
        ends, todo = {}, []
        for p in meta.partitions:
            lo, hi = watermarks(c, topic, p, cfg.kafka.request_timeout_s)
            start = max(lo, offsets.get(p, lo))
            if hi > start:
                ends[p] = hi
                todo.append(TopicPartition(topic, p, start))
        sent: set[tuple[int, int]] = set()
        if not todo:
            return sent
        c.assign(todo)
        deadline = time.monotonic() + 10 * cfg.kafka.request_timeout_s
        while ends and time.monotonic() < deadline:
            for m in c.consume(1000, 0.5):
                if m.offset() + 1 >= ends.get(m.partition(), 0):
                    ends.pop(m.partition(), None)
                try:
                    rec = decode_message(m, "Prompt")
                except DecodeError:
                    continue
                if rec["metadata"].get("feed") == name:
                    sent.add((rec["group_seq"], rec["sample_start"]))
        if ends:
            raise TimeoutError(f"could not read {topic} to its end for resume ({ends})")
        return sent
    finally:
        c.close()


class Feed:
    def __init__(self, cfg):
        self.cfg, self.fc = cfg, cfg.feed
        self.topic = cfg.topics.name("prompts")
        self.records = load_dataset(self.fc)
        if not self.records:
            raise ConfigError(f"feed.source {self.fc.source} has no records")
        self.sha = dataset_hash(self.records)
        self.producer = Producer(client_conf(cfg, "feed", self.fc.name, kind="producer"))
        meta = self.producer.client.list_topics(self.topic, timeout=cfg.kafka.request_timeout_s).topics[self.topic]
        if meta.error is not None:
            raise ConfigError(f"topic {self.topic}: {meta.error} (run `rlstream topics create`)")
        self.partitions = len(meta.partitions)
        self._orders: dict[int, list[int]] = {}

    def order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            idx = list(range(len(self.records)))
            if self.fc.shuffle_seed is not None:
                random.Random(self.fc.shuffle_seed + epoch).shuffle(idx)
            self._orders = {epoch: idx}
        return self._orders[epoch]

    def messages(self, g: int) -> list[tuple[dict, int | None]]:
        """The Prompt records of group ``g``, each with its partition (None: by key)."""
        n_rec = len(self.records)
        epoch, i = divmod(g, n_rec)
        r = self.records[self.order(epoch)[i]]
        n = r["n"] or self.cfg.rl.group_size
        group_id = f"{r['prompt_id']}@e{epoch}"
        parts = split_group(n, self.fc.replicate)
        base = zlib.crc32(group_id.encode()) % self.partitions
        out = []
        for j, (start, count) in enumerate(parts):
            rec = {
                "prompt_id": r["prompt_id"],
                "group_id": group_id,
                "group_seq": g,
                "task": r["task"],
                "text": r["text"],
                "group_size": n,
                "sample_start": start,
                "sample_count": count,
                "reference": r["reference"],
                "epoch": epoch,
                "max_new_tokens": r["max_new_tokens"],
                "created_at_ms": now_ms(),
                "metadata": {**r["metadata"], "feed": self.fc.name, "part": f"{j}/{len(parts)}"},
            }
            out.append((rec, (base + j) % self.partitions if len(parts) > 1 else None))
        return out

    def checkpoint(self, next_g: int) -> None:
        self.producer.flush(self.cfg.kafka.request_timeout_s)
        c, timeout = self._wm_consumer(), self.cfg.kafka.request_timeout_s
        offsets = {p: watermarks(c, self.topic, p, timeout)[1] for p in range(self.partitions)}
        args = {
            "feed": self.fc.name,
            "next_group_seq": str(next_g),
            "dataset_sha256": self.sha,
            "records": str(len(self.records)),
            "offsets": json.dumps(offsets),
        }
        rec = {"name": STATE_COMMAND, "args": args, "issued_by": f"feed/{self.fc.name}", "created_at_ms": now_ms()}
        self.producer.produce_record(self.cfg.topics.name("control"), "Command", rec, key=f"feed/{self.fc.name}")
        self.producer.flush(self.cfg.kafka.request_timeout_s)
        log.info("feed state %s", kv(feed=self.fc.name, next_group_seq=next_g))

    def _wm_consumer(self) -> Consumer:
        if not hasattr(self, "_wm"):
            self._wm = Consumer(client_conf(self.cfg, "feed-wm", kind="consumer"))
        return self._wm

    def run(self) -> dict:
        total = len(self.records) * self.fc.epochs
        state = read_state(self.cfg, self.fc.name)
        if state and state["dataset_sha256"] != self.sha:
            raise ConfigError(
                f"feed {self.fc.name!r}: the dataset changed since it was fed ({state['dataset_sha256'][:12]} -> "
                f"{self.sha[:12]}); use a new topic prefix or feed.name"
            )
        start = state["next_group_seq"] if state else 0
        sent = scan_sent(self.cfg, self.fc.name, state["offsets"] if state else {})
        end = total if not self.fc.limit else min(total, start + self.fc.limit)
        stats = {"start_group_seq": start, "groups": 0, "messages": 0, "skipped_messages": 0}
        log.info("feeding %s", kv(feed=self.fc.name, start=start, end=end, total=total, already_sent=len(sent)))
        t0 = time.monotonic()
        for g in range(start, end):
            if self.fc.rate > 0:
                delay = t0 + (g - start) / self.fc.rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            for rec, part in self.messages(g):
                if (g, rec["sample_start"]) in sent:
                    stats["skipped_messages"] += 1
                    continue
                kw = {"partition": part} if part is not None else {}
                self.producer.produce_record(self.topic, "Prompt", rec, key=rec["group_id"].encode(), **kw)
                stats["messages"] += 1
            stats["groups"] += 1
            if (g + 1 - start) % self.fc.checkpoint_every == 0 and g + 1 < end:
                self.checkpoint(g + 1)
        if end > start or state is None:
            self.checkpoint(end)
        stats["next_group_seq"] = end
        stats["total_groups"] = total
        return stats

    def close(self) -> None:
        self.producer.close(self.cfg.kafka.request_timeout_s)
        if hasattr(self, "_wm"):
            self._wm.close()


def run(cfg) -> dict:
    feed = Feed(cfg)
    try:
        stats = feed.run()
    finally:
        feed.close()
    log.info("feed done %s", kv(**stats))
    print(json.dumps(stats), flush=True)
    return stats
