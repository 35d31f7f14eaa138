"""The prompt feed: publishes a dataset's prompts to rl.prompts, group by group, for some epochs.

Group numbering: the g-th group of the run (counting across epochs) gets ``group_seq = g`` and
``group_id = f"{prompt_id}@e{epoch}"``; epoch e covers ``g`` in ``[e*N, (e+1)*N)`` for a dataset
of N records (shuffled per epoch if ``shuffle_seed`` is set). Admission control in the rollout
workers is driven by group_seq, so there is one feed per topic prefix.

Prompt replication (``rl.replicate = m``): a group's n samples are split into m messages
(``sample_start``/``sample_count``) placed on m distinct partitions, so several workers generate
one group; trajectories are still keyed by group_id. Without replication a group is one message,
keyed (and partitioned) by group_id.

Resume, exactly: every ``checkpoint_every`` groups and at the end, the feed flushes (all sent
messages acknowledged), then writes a feed-state record to rl.control (a ``Command`` named
``feed_state`` keyed ``feed/<name>``) holding the next group_seq, the dataset hash and the
prompts topic's end offsets, signed with the job's notice key (``pipeline.notice_auth``: once the
job has a key, a forged or unsigned state is ignored, and the feed then scans the whole topic). A restarted feed reads the newest state, then reads rl.prompts from
those offsets to the end and skips every (group_seq, sample_start) already there, so messages
sent after the last state record are not sent twice and none is lost. A changed dataset is an
error (group numbering would no longer mean the same prompts). ``feed.limit`` counts from group 0
across all runs, like ``epochs``: restarting never feeds more than one uninterrupted run.

The process lifecycle (signals, watchdog, start-up retries) is ``pipeline.worker``'s; a stop
publishes the feed state first, so the next run resumes exactly.

Supervised mode (``feed.mode = "sft"``): each record is a chat conversation, written to rl.scored
as a demonstration (``producers.sft``: a group of one, keyed by its group id) instead of a prompt;
group numbering, ``limit``, ``epochs`` and exact resume are the same, read from rl.scored.

What this is not: a scheduler; workers pull from rl.prompts at their own pace.
"""

from __future__ import annotations

import json
import logging
import random
import time
import zlib

from libs.datasets import dataset_hash, load_dataset
from pipeline.control import ControlFollower, now_ms
from pipeline.errors import ConfigError, DecodeError
from pipeline.kafka import Consumer, Producer, client_conf, decode_message
from pipeline.log import kv
from pipeline.notice_auth import NoticeVerifier, load_key, sign
from pipeline.worker import Worker
from producers.pacing import Pacer
from producers.sft import load_sft, scored_record

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


def read_state(cfg, name: str, timeout: float | None = None) -> dict | None:
    """The newest feed-state record of feed ``name`` on rl.control, or None."""
    follower = ControlFollower(cfg, "feed")
    try:
        follower.catch_up(timeout or cfg.kafka.request_timeout_s)
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


def scan_sent(cfg, name: str, offsets: dict[int, int], sft: bool = False) -> set[tuple[int, int]]:
    """(group_seq, sample_start) of feed ``name``'s prompts at or after ``offsets`` on rl.prompts
    (``sft``: of its demonstrations on rl.scored, sample_start 0)."""
    sent: set[tuple[int, int]] = set()
    topic, schema = (cfg.topics.name("scored"), "ScoredTrajectory") if sft else (cfg.topics.name("prompts"), "Prompt")
    with Consumer(client_conf(cfg, "feed-scan", kind="consumer")) as c:
        for m in c.read_to_end(topic, offsets, 10 * cfg.kafka.request_timeout_s):
            try:
                rec = decode_message(m, schema)
            except DecodeError:
                continue
            if sft:
                t = rec.get("trajectory") or {}
                if (t.get("metadata") or {}).get("feed") == name:
                    sent.add((t["group_seq"], 0))
            elif rec["metadata"].get("feed") == name:
                sent.add((rec["group_seq"], rec["sample_start"]))
    return sent


class Feed(Worker):
    role = "feed"
    unit = "group"

    def __init__(self, cfg):
        super().__init__(cfg, cfg.feed.name)
        self.fc = cfg.feed
        self.sft = cfg.feed.mode == "sft"
        self.topic = cfg.topics.name("scored" if self.sft else "prompts")
        self.producer: Producer | None = None
        self._wm: Consumer | None = None
        self.pacer: Pacer | None = None
        self._orders: dict[int, list[int]] = {}
        self.stats: dict = {}

    def setup(self) -> None:
        cfg = self.cfg
        self.records = load_sft(cfg) if self.sft else load_dataset(self.fc)
        if not self.records:
            raise ConfigError(f"feed.source {self.fc.source} has no records")
        self.sha = dataset_hash([{k: v for k, v in r.items() if k != "_rendered"} for r in self.records])
        if self.sft and self.fc.dispatch == "paced":
            raise ConfigError("feed.mode = 'sft' writes to rl.scored: feed.dispatch must be 'all'")
        # the job's notice key (``rlstream run`` creates it before any role starts, a fresh trainer
        # at its start): the feed signs its resume state with it, so a record forged on rl.control
        # cannot move where the feed resumes. A job without one (of an older rlstream) stays unsigned.
        verifier = NoticeVerifier(cfg.store)
        verifier.check()  # a key that is there but unreadable: one line, at start
        self.key = verifier.key
        self.producer = Producer(client_conf(cfg, "feed", self.fc.name, kind="producer"))
        timeout = cfg.kafka.request_timeout_s
        self.partitions = len(self.startup_call(lambda: self.producer.partitions(self.topic, timeout), self.topic))
        total = len(self.records) * self.fc.epochs
        state = read_state(cfg, self.fc.name, self.liveness.startup_timeout_s)
        if state and state["dataset_sha256"] != self.sha:
            raise ConfigError(
                f"feed {self.fc.name!r}: the dataset changed since it was fed ({state['dataset_sha256'][:12]} -> "
                f"{self.sha[:12]}); use a new topic prefix or feed.name"
            )
        self.start_g = self.next_g = state["next_group_seq"] if state else 0
        self.sent = scan_sent(cfg, self.fc.name, state["offsets"] if state else {}, self.sft)
        # limit is a total over every run of this feed (group_seq < limit), so a feed restarted by a
        # supervisor, or a re-run job, never publishes more than an uninterrupted run would
        self.end = total if not self.fc.limit else min(total, self.fc.limit)
        self.fresh = state is None
        self.stats = {"start_group_seq": self.start_g, "groups": 0, "messages": 0, "skipped_messages": 0}
        self.stats["total_groups"] = total
        self._t0 = time.monotonic()
        if self.fc.dispatch == "paced":
            self.pacer = Pacer(cfg, self.topic, self.partitions)
            self.pacer.catch_up(self.liveness.startup_timeout_s)
        log.info(
            "feeding %s",
            kv(feed=self.fc.name, start=self.start_g, end=self.end, total=total, already_sent=len(self.sent)),
        )

    def run_once(self) -> bool:
        """Publish the next group (after the rate limit allows it); False once all are out."""
        g = self.next_g
        if g >= self.end:
            return False
        if self.fc.rate > 0:
            delay = self._t0 + (g - self.start_g) / self.fc.rate - time.monotonic()
            if delay > 0:
                time.sleep(min(delay, 1.0))  # short naps: the watchdog sees the loop alive
                return True
        todo = []
        for rec, part in self.messages(g):
            if (g, 0 if self.sft else rec["sample_start"]) in self.sent:
                self.stats["skipped_messages"] += 1
            else:
                todo.append((rec, part))
        if todo and self.pacer is not None and not self._place(g, todo):
            time.sleep(0.02)  # not admissible yet, or every queue is full: look again soon
            return True
        for rec, part in todo:
            kw = {"partition": part} if part is not None else {}
            if self.pacer is not None:
                kw["on_delivery"] = self.pacer.on_delivery
                self.pacer.sent(part)
            if self.sft:
                key = rec["trajectory"]["group_id"].encode()
                self.producer.produce_record(self.topic, "ScoredTrajectory", rec, key=key, **kw)
            else:
                self.producer.produce_record(self.topic, "Prompt", rec, key=rec["group_id"].encode(), **kw)
            self.stats["messages"] += 1
        self.stats["groups"] += 1
        self.next_g = g + 1
        if (self.next_g - self.start_g) % self.fc.checkpoint_every == 0 and self.next_g < self.end:
            self.checkpoint(self.next_g)
        return True

    def _place(self, g: int, todo: list) -> bool:
        """Paced dispatch: True (and ``todo``'s partitions chosen) if group ``g`` may go out now."""
        parts = self.pacer.place(g, len(todo))
        if parts is None:
            self.producer.poll(0)  # serve delivery reports while waiting
            return False
        todo[:] = [(rec, p) for (rec, _), p in zip(todo, parts, strict=True)]
        return True

    def finish(self) -> None:
        """Done or stopped: publish the state, so the next run resumes exactly here."""
        if self.next_g > self.start_g or self.fresh:
            self.checkpoint(self.next_g)
        self.stats["next_group_seq"] = self.next_g

    def result(self) -> dict:
        return self.stats

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
        if self.sft:
            return [(scored_record(r, g, epoch, r["_rendered"], self.fc.name), None)]
        n = r["n"] or self.cfg.rl.group_size
        group_id = f"{r['prompt_id']}@e{epoch}"
        parts = split_group(n, self.cfg.rl.replicate)
        base = zlib.crc32(group_id.encode()) % self.partitions
        out = []
        for j, (start, count) in enumerate(parts):
            rec = {
                "prompt_id": r["prompt_id"],
                "group_id": group_id,
                "group_seq": g,
                "task": r["task"],
                "text": r["text"],
                "messages": r.get("messages", ""),
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
        """Wait until everything sent is acknowledged, then record ``next_g`` and the end offsets."""
        with self.section("feed checkpoint", self.liveness.outage_s + 60):
            self.producer.flush_patiently(self.liveness.outage_s, "prompts")
            if self._wm is None:
                self._wm = Consumer(client_conf(self.cfg, "feed-wm", kind="consumer"))
            # as patient as the flush above: a partition leader that is moving (a node shutting
            # down on a cluster) or a broker that is away is waited for, not a crash
            timeout = self.liveness.outage_s
            offsets = {p: self._wm.watermarks(self.topic, p, timeout)[1] for p in range(self.partitions)}
            args = {
                "feed": self.fc.name,
                "next_group_seq": str(next_g),
                "dataset_sha256": self.sha,
                "records": str(len(self.records)),
                "offsets": json.dumps(offsets),
            }
            rec = {"name": STATE_COMMAND, "args": args, "issued_by": f"feed/{self.fc.name}", "created_at_ms": now_ms()}
            if self.key is None:  # the job has no key yet: look again (a trainer may have made it)
                self.key = load_key(self.cfg.store)
            if self.key is not None:  # readers then act only on a state signed with the job's key
                rec = sign(rec, self.key, 0)
            self.producer.produce_record(self.cfg.topics.name("control"), "Command", rec, key=f"feed/{self.fc.name}")
            self.producer.flush_patiently(self.liveness.outage_s, "feed state")
        log.info("feed state %s", kv(feed=self.fc.name, next_group_seq=next_g))

    def close(self) -> None:
        try:
            if self.producer is not None:
                self.producer.close(self.cfg.kafka.request_timeout_s)
        finally:
            if self._wm is not None:
                self._wm.close()
            if self.pacer is not None:
                self.pacer.close()


def run(cfg, stop=None) -> dict:
    stats = Feed(cfg).run(stop)
    log.info("feed done %s", kv(**stats))
    print(json.dumps(stats), flush=True)
    return stats
