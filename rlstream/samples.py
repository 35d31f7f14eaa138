"""What the model writes, in plain sight: the samples of a job's scored topic (rl.scored) with their
prompt and completion text, reward, GRPO advantage, policy versions and staleness.

``read_samples(cfg, n, version, order)`` returns them as dicts (``rlstream samples``,
``rlstream.Job.samples``); ``follow_samples(cfg, ...)`` yields each new one within about a second of
its scoring (``rlstream samples --follow``); ``TableSource(cfg)`` is the newest few, read again on
each call, for the tracking role's sample table (``consumers.tracking``), which cannot read the
trainer's advantage estimator itself (roles never import each other), so the application hands it
this object.

How it reads: one consumer with ``isolation.level=read_committed`` (only committed scoring
transactions), ``assign``-ed to every partition, in no consumer group, never committing: reading
never moves, pauses or joins anything of the job's. Without a filter it reads the last few records
of each partition; with ``version`` or a reward order it reads the whole topic. A read stops at the
topic's end of the moment, or when nothing new came for ``STALL_S`` (an open scoring transaction
holds back the committed end), said in the log.

Each row: ``version_min``/``version_max`` (the policy versions that generated it),
``staleness`` (the newest published version, from rl.control, minus ``version_min``: how far
behind the trainer's current policy the sample is, the trainer's bounded-staleness measure),
``reward``, ``advantage`` (the trainer's estimator, ``[trainer.advantage]``, over the rewards of
the sample's group; None while the group's scored samples are fewer than its ``group_size``:
the trainer has not got them all either), ``prompt``, ``completion``, and where it came from.
The texts are the ones the trajectory carries; a trajectory without them (no prompt text) is
decoded with the job's tokenizer.

What this is not: the trainer's view of a sample (which samples a step used is the trainer's
steps log), nor a replay (``rlstream replay``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Literal

from pipeline import codec
from pipeline.errors import ConfigError, DecodeError, RlstreamError
from pipeline.kafka import OFFSET_BEGINNING, Consumer, TopicPartition, client_conf
from pipeline.log import kv

log = logging.getLogger(__name__)

Order = Literal["newest", "worst", "best"]
STALL_S = 3.0
"""A read ends when no record came for this long (an open transaction holds the committed end back)."""
HOLD_S = 1.0
"""``follow_samples`` holds a sample at most this long for the rest of its group (its advantage)."""


class SampleReader:
    """The job's scored topic and its newest published version, read-only (see the module)."""

    def __init__(self, cfg):
        from consumers.trainer.advantages import build_advantage

        self.cfg = cfg
        self.topic = cfg.topics.name("scored")
        self.advantage = build_advantage(cfg.trainer.advantage)
        self._consumer: Consumer | None = None
        self._control: Consumer | None = None
        self._verifier = None
        self._tokenizer = None
        self.newest_version = 0

    @property
    def consumer(self) -> Consumer:
        if self._consumer is None:
            self._consumer = Consumer(client_conf(self.cfg, "samples", kind="consumer"))
        return self._consumer

    def partitions(self) -> list[int]:
        """The scored topic's partitions; ConfigError (one line) when it is not there."""
        try:
            return self.consumer.partitions(self.topic, timeout=min(10.0, self.cfg.kafka.request_timeout_s))
        except RlstreamError:
            name = self.cfg.job.name
            who = f"job {name} has not run on this broker" if name else "give the job file (rlstream samples JOB.toml)"
            raise ConfigError(
                f"no topic {self.topic} on {self.cfg.kafka.bootstrap_servers}: {who} (rlstream jobs lists the jobs)"
            ) from None

    def refresh_version(self) -> int:
        """The newest version the job's trainer published (0: none yet)."""
        from pipeline.versions import published

        versions = published(self.cfg)
        self.newest_version = max(versions, default=0)
        return self.newest_version

    def follow_control(self) -> int:
        """``newest_version`` moved by the notices that reached the control topic since the last
        call, checked as ``published`` checks them (without waiting: the first call starts the read)."""
        from pipeline.notice_auth import NoticeVerifier

        if self._control is None:
            self._control = Consumer(client_conf(self.cfg, "samples-control", kind="consumer"))
            self._control.assign([TopicPartition(self.cfg.topics.name("control"), 0, OFFSET_BEGINNING)])
            self._verifier = NoticeVerifier(self.cfg.store, tries=1, warn=False)
        for m in self._control.consume(500, 0):
            try:
                name, rec = codec.decode(m.value())
            except DecodeError:
                continue
            if name == "WeightUpdate" and self._verifier.problem(rec) is None:
                self._verifier.note(rec)
                self.newest_version = max(self.newest_version, rec["version"])
        return self.newest_version

    def read(self, tail: int | None) -> tuple[list, dict[int, int]]:
        """The committed records of the last ``tail`` offsets of each partition (None: all), and the
        offset to go on from per partition."""
        c, topic = self.consumer, self.topic
        left, todo = {}, []
        for p in self.partitions():
            lo, hi = c.watermarks(topic, p, timeout=self.cfg.kafka.request_timeout_s)
            first = lo if tail is None else max(lo, hi - tail)
            todo.append(TopicPartition(topic, p, first))
            if hi > first:
                left[p] = hi
        ends = {tp.partition: left.get(tp.partition, tp.offset) for tp in todo}
        out: list = []
        c.assign(todo)
        last_new = time.monotonic()
        while left:
            msgs = c.consume(1000, 0.2)
            out.extend(m for m in msgs if m.offset() < ends[m.partition()])
            if msgs:
                last_new = time.monotonic()
            for (_, p), pos in c.position([(topic, p) for p in left]).items():
                if pos >= left[p]:
                    del left[p]
            if left and time.monotonic() - last_new > STALL_S:
                log.warning(
                    "stopped before the end of %s %s", topic, kv(partitions=sorted(left), reason="open transaction")
                )
                for (_, p), pos in c.position([(topic, p) for p in left]).items():
                    ends[p] = max(pos, next(tp.offset for tp in todo if tp.partition == p))
                break
        c.unassign()
        return out, ends

    def rows(self, msgs) -> list[dict]:
        """The decodable ScoredTrajectories of ``msgs`` as rows, with their group's advantages."""
        rows = []
        for m in msgs:
            try:
                rec = codec.decode_as(m.value(), "ScoredTrajectory")
            except DecodeError:
                continue  # garbage on rl.scored is the trainer's to dead-letter, not ours to show
            if isinstance(rec.get("trajectory"), dict):
                rows.append(self._row(rec, m.partition(), m.offset()))
        self.fill_advantages(rows)
        return rows

    def _row(self, rec: dict, partition: int, offset: int) -> dict:
        t = rec["trajectory"]
        text = bool(t["prompt_text"])  # an engine that writes text writes the prompt's (an answer may be empty)
        return {
            "version_min": t["version_min"],
            "version_max": t["version_max"],
            "staleness": max(0, self.newest_version - t["version_min"]),
            "reward": rec["reward"],
            "advantage": None,
            "prompt": t["prompt_text"] if text else self._decode(t["prompt_tokens"]),
            "completion": t["response_text"] if text else self._decode(t["response_tokens"]),
            "task": t["task"],
            "group_id": t["group_id"],
            "sample_index": t["sample_index"],
            "group_size": t["group_size"],
            "finish_reason": t["finish_reason"],
            "reference": t["reference"],
            "trajectory_id": t["trajectory_id"],
            "scored_at_ms": rec["scored_at_ms"],
            "partition": partition,
            "offset": offset,
        }

    def fill_advantages(self, rows: list[dict]) -> None:
        """Each row's advantage among the rows of its group, when the group is complete."""
        groups: dict[str, list[dict]] = {}
        for r in rows:
            groups.setdefault(r["group_id"], []).append(r)
        for members in groups.values():
            if len(members) >= members[0]["group_size"]:
                for r, a in zip(members, self.advantage([r["reward"] for r in members]), strict=True):
                    r["advantage"] = float(a)

    def _decode(self, packed: bytes) -> str:
        if not packed:
            return ""
        if self._tokenizer is None:
            from pipeline.models import load_tokenizer, materialize

            self._tokenizer = load_tokenizer(materialize(self.cfg.model))
        return self._tokenizer.decode(list(codec.unpack_i32(packed)), skip_special_tokens=True)

    def close(self) -> None:
        for c in (self._consumer, self._control):
            if c is not None:
                c.close()
        self._consumer = self._control = None


def select(rows: list[dict], n: int, version: int | None = None, order: Order = "newest") -> list[dict]:
    """``n`` rows of ``rows`` (of ``version``, where given): the newest (oldest first), or by reward."""
    if version is not None:
        rows = [r for r in rows if r["version_min"] <= version <= r["version_max"]]
    if order == "newest":
        return sorted(rows, key=lambda r: (r["scored_at_ms"], r["partition"], r["offset"]))[-n:] if n else []
    return sorted(rows, key=lambda r: r["reward"], reverse=order == "best")[:n]


def tail_window(cfg, n: int) -> int:
    """Offsets per partition read for the newest ``n``: enough for them and their whole groups."""
    return 4 * (n + cfg.rl.group_size) + 16


def read_samples(cfg, n: int = 10, version: int | None = None, order: Order = "newest") -> list[dict]:
    """The job's samples (module docstring): the newest ``n`` (oldest first), or the ``n`` worst or
    best by reward, of policy version ``version`` where given (a sample generated across versions
    counts for each). ConfigError when the job's topics are not on the broker."""
    reader = SampleReader(cfg)
    try:
        reader.partitions()
        reader.refresh_version()
        whole = version is not None or order != "newest"
        msgs, _ = reader.read(None if whole else tail_window(cfg, n))
        return select(reader.rows(msgs), n, version, order)
    finally:
        reader.close()


def follow_samples(cfg, n: int = 10, version: int | None = None, order: Order = "newest",
                   stop: Callable[[], bool] | None = None) -> Iterator[dict]:  # fmt: skip
    """``read_samples``'s rows, then every sample scored after them as it comes (of ``version``
    where given), until ``stop()`` is true or the caller stops iterating. A sample waits at most
    ``HOLD_S`` for the rest of its group (then its advantage is None)."""
    reader = SampleReader(cfg)
    try:
        reader.partitions()
        reader.refresh_version()
        whole = version is not None or order != "newest"
        msgs, ends = reader.read(None if whole else tail_window(cfg, n))
        yield from select(reader.rows(msgs), n, version, order)
        c = reader.consumer
        c.assign([TopicPartition(reader.topic, p, off) for p, off in ends.items()])
        pending: dict[str, tuple[float, list[dict]]] = {}  # group id -> (first arrival, rows)
        while not (stop and stop()):
            for r in reader.rows(c.consume(500, 0.2)):
                pending.setdefault(r["group_id"], (time.monotonic(), []))[1].append(r)
            reader.follow_control()
            now = time.monotonic()
            for gid, (since, members) in list(pending.items()):
                complete = len(members) >= members[0]["group_size"]
                if complete or now - since > HOLD_S:
                    del pending[gid]
                    if complete:
                        reader.fill_advantages(members)
                    for r in members:
                        r["staleness"] = max(0, reader.newest_version - r["version_min"])
                        if version is None or r["version_min"] <= version <= r["version_max"]:
                            yield r
    finally:
        reader.close()


class TableSource:
    """The newest samples for the tracking role's table: ``source(k)`` reads them again (a bounded
    read of the topic's tail, ``read_samples``); ``close()`` ends its consumer."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.reader: SampleReader | None = None  # made on the first call: a failure is the table's, not the run's
        self.n_calls = 0

    def __call__(self, k: int) -> list[dict]:
        if self.reader is None:
            self.reader = SampleReader(self.cfg)
        self.n_calls += 1
        if self.n_calls == 1:
            self.reader.refresh_version()
        self.reader.follow_control()
        msgs, _ = self.reader.read(tail_window(self.reader.cfg, k))
        return select(self.reader.rows(msgs), k)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()


def format_sample(r: dict) -> str:
    """One sample as text lines: its figures, then its prompt and completion, indented."""
    versions = f"v{r['version_min']}" + (f"-{r['version_max']}" if r["version_max"] != r["version_min"] else "")
    adv = "-" if r["advantage"] is None else f"{r['advantage']:+.3f}"
    head = (
        f"{versions}  staleness {r['staleness']}  reward {r['reward']:.3f}  advantage {adv}  "
        f"[{r['task']} {r['group_id']} #{r['sample_index']}, {r['finish_reason']}]"
    )

    def block(label: str, text: str) -> str:
        lines = (text or "").splitlines() or [""]
        return "\n".join([f"  {label:<11} {lines[0]}", *(f"  {'':<11} {x}" for x in lines[1:])])

    return "\n".join([head, block("prompt:", r["prompt"]), block("completion:", r["completion"])])


def show(cfg, n: int = 10, version: int | None = None, order: Order = "newest", follow: bool = False,
         as_json: bool = False) -> None:  # fmt: skip
    """Print the samples (``--json``: one JSON object a line); ``follow``: then each new one, until
    Ctrl-C or SIGTERM (a clean stop, exit 0)."""
    import json
    import sys

    if follow:
        print(f"following {cfg.topics.name('scored')} (Ctrl-C to stop)", file=sys.stderr, flush=True)
    rows = follow_samples(cfg, n, version, order) if follow else read_samples(cfg, n, version, order)
    shown = 0
    try:
        for r in rows:
            print(json.dumps(r) if as_json else format_sample(r), flush=True)
            shown += 1
    except KeyboardInterrupt:
        return
    if not shown and not as_json:
        what = f" of version {version}" if version is not None else ""
        print(f"no scored samples{what} on {cfg.topics.name('scored')} yet", file=sys.stderr)
