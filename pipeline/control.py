"""The control plane: policy versions, bounded staleness, admission, and the rl.control topic.

Versions: ``v`` counts the weight updates the trainer has published (``v = 0`` is the initial
model). With ``k = max_staleness`` and ``G = groups_per_step``:

* **Hard bound (trainer).** At version ``v`` (computing ``v + 1``), a sample is usable only if
  ``v - version_min <= k``. Others are masked out and counted (``is_stale``).
* **Admission (producers).** The feed numbers groups ``group_seq = 0, 1, 2, ...``. A worker
  holding version ``v`` starts group ``g`` only if ``g < C(v) + (k + 1) * G`` (``may_admit``;
  AReaL's rule, counted in groups), where ``C(v)`` is the number of closed groups the trainer has
  *consumed* while producing versions up to ``v`` plus those it has filtered since while still at
  ``v``. Without dynamic sampling every step consumes exactly ``G`` groups, ``C(v) = v * G``,
  and the rule is the classic ``g < (v + k + 1) * G``. With ``k = 0`` that is synchronous RL:
  the groups of step ``s`` start only once version ``s`` is loaded.

Why ``C(v)``: with dynamic sampling (``trainer.dynamic_sampling``) the trainer drops groups whose
rewards have zero variance and waits for more, so a step consumes ``G + f`` groups. Counting
slots as ``v * G`` would stop the producers while the trainer waits for groups: a deadlock. So the
trainer states its count: ``WeightUpdate.consumed_groups`` is ``C`` at the version it announces,
and while it waits at version ``v`` it publishes a ``groups_consumed`` Command with the count
grown by every filtered group (``publish_progress``). The bound still holds: a step consumes at
least ``G`` groups, so group ``g < C(v) + (k + 1) G`` is consumed by the step that starts at
version ``v + k`` at the latest (when groups arrive in ``group_seq`` order; the trainer's hard
bound guards the rest). ``ControlFollower.consumed_groups(v)`` is the newest count known for
``v``; a notice without one (``-1``, v1 notices) means ``v * G``.

The trainer counts every group it closes (complete, or incomplete past its timeout, or filtered)
in ``C``, so admission and training stay aligned and nothing can deadlock.

Control messages are WeightUpdate and Command records on a one-partition topic; a late joiner
reads it from the start (it is small: one record per version, plus one progress record per idle
poll of a trainer that filtered groups) and keeps the newest notice.
"""

from __future__ import annotations

import logging
import time

from pipeline import codec
from pipeline.errors import DecodeError
from pipeline.kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition, client_conf
from pipeline.log import kv
from pipeline.notice_auth import NoticeVerifier
from pipeline.records import dead_letter

log = logging.getLogger(__name__)
WEIGHTS_KEY = b"weights"
COMMAND_KEY = b"command"
PROGRESS_KEY = b"progress"
PROGRESS_COMMAND = "groups_consumed"
"""Command name of the trainer's consumed-group count while it waits at one version (args:
``version``, ``consumed_groups``, ``trainer_id``; values are strings, as Command args are)."""
_KEEP_VERSIONS = 1024  # consumed counts remembered by a follower (admission needs the loaded one)
_KEEP_NOTICES = 64  # accepted notices remembered by a follower (a rejected one falls back to these)


def is_stale(current_version: int, version_min: int, k: int) -> bool:
    """True if a sample generated from ``version_min`` may not train version ``current_version``."""
    return current_version - version_min > k


def admission_limit(loaded_version: int, k: int, groups_per_step: int, consumed: int | None = None) -> int:
    """Groups with ``group_seq`` below this may start at ``loaded_version``.

    ``consumed``: the trainer's consumed-group count ``C`` known for ``loaded_version``
    (``ControlFollower.consumed_groups``); None (no count published, e.g. a v1 notice) means
    ``loaded_version * groups_per_step``, the count when no group is ever filtered."""
    base = loaded_version * groups_per_step if consumed is None or consumed < 0 else consumed
    return base + (k + 1) * groups_per_step


def may_admit(group_seq: int, loaded_version: int, k: int, groups_per_step: int, consumed: int | None = None) -> bool:
    return group_seq < admission_limit(loaded_version, k, groups_per_step, consumed)


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


def publish_progress(
    producer: Producer,
    topic: str,
    version: int,
    consumed: int,
    trainer_id: str = "",
    timeout: float = 30.0,
    sign=None,
) -> None:
    """Publish the trainer's consumed-group count while it is at ``version`` (dynamic sampling:
    filtered groups raise it without a new version, and producers admit further from it).
    ``sign``: the trainer's ``NoticeSigner.sign`` (``pipeline.notice_auth``), None in an unsigned job."""
    args = {"version": str(int(version)), "consumed_groups": str(int(consumed)), "trainer_id": trainer_id}
    rec = {"name": PROGRESS_COMMAND, "args": args, "issued_by": trainer_id, "created_at_ms": now_ms()}
    if sign is not None:
        rec = sign(rec)
    producer.produce_record(topic, "Command", rec, key=PROGRESS_KEY)
    producer.flush_patiently(timeout, f"progress v{version}")
    log.debug("published progress %s", kv(version=version, consumed_groups=consumed))


def publish_command(producer: Producer, topic: str, name: str, args: dict | None = None, by: str = "") -> None:
    rec = {"name": name, "args": args or {}, "issued_by": by, "created_at_ms": now_ms()}
    producer.produce_record(topic, "Command", rec, key=COMMAND_KEY)
    producer.flush(30)


class ControlFollower:
    """Follows the control topic. ``poll`` returns new ``(name, record)`` pairs in order;
    ``latest_update`` is the newest WeightUpdate accepted (by version); ``consumed_groups(v)`` the
    newest consumed-group count known for version ``v`` (admission). Undecodable records are
    logged and skipped (the control topic is written only by rlstream). A Command (the trainer's
    progress, the feed's resume state, any other) is kept in ``commands`` and acted on only if it
    passes the same authentication as a notice; one that fails is skipped, dead-lettered, and
    warned about once per command name (``refused_commands`` counts them).

    A notice is checked before it is accepted (``notice_problem``): it must be signed by the job's
    notice key and not by a replaced trainer (``pipeline.notice_auth``: ``unsigned_notice``,
    ``bad_signature``, ``stale_writer_epoch``; unsigned ones pass only while the store has no key,
    a job of an older rlstream), it must name a checkpoint and its sha256 (``missing_uri``,
    ``missing_sha256``), and its version must follow the
    newest accepted by at most ``trainer.publish_every`` (the trainer publishes its versions in
    order on a one-partition topic, every ``publish_every`` steps), or re-publish one; ``writer``
    (a trainer following its own notices) accepts only notices that carry that ``trainer_id``.
    A bad notice is dead-lettered on rl.dlq with its reason (``reject``) and skipped: it moves
    neither ``latest_update`` nor admission. A caller that fetches the checkpoint (the rollout
    worker) ``reject``s a notice whose checkpoint it could not fetch or verify the same way."""

    def __init__(self, cfg, role: str, worker_id: str | None = None, writer: str | None = None):
        self.cfg, self.role, self.worker_id, self.writer = cfg, role, worker_id or role, writer
        self.max_jump = cfg.trainer.publish_every
        """How far past the newest version a notice may be (the trainer's publishing interval)."""
        self.topic = cfg.topics.name("control")
        self.auth = NoticeVerifier(cfg.store)
        """Who wrote a notice: the job's key and the newest writer epoch accepted."""
        self.auth.check()  # a key that is there but unreadable: refused at start, in one line
        self.consumer = Consumer(client_conf(cfg, f"{role}-control", worker_id, kind="consumer"))
        self.consumer.assign([TopicPartition(self.topic, 0, OFFSET_BEGINNING)])
        self.latest_update: dict | None = None
        self.accepted: list[tuple[dict, object]] = []
        """Accepted notices not rejected since, in arrival order, with their messages (newest few)."""
        self.newest = 0
        """Newest plausible version seen: the next notice must follow it (a rejected fetch keeps it)."""
        self.trust_first = False
        """The topic's start was deleted by retention: the first notice seen sets ``newest``."""
        self.commands: list[dict] = []
        self.consumed: dict[int, int] = {}
        """version -> the largest consumed-group count its trainer's progress records stated."""
        self.progress_seen = 0
        """Counts changes of ``consumed`` (a caller re-checks admission when it moves)."""
        self.dead_lettered = 0
        self.refused_commands = 0
        """Commands skipped because they failed authentication (also in ``dead_lettered``)."""
        self._warned: set[tuple[str, str]] = set()
        self._producer = None

    def poll(self, timeout: float = 0.0, max_records: int = 100) -> list[tuple[str, dict]]:
        out = []
        for msg in self.consumer.consume(max_records, timeout):
            try:
                name, rec = codec.decode(msg.value())
            except DecodeError as exc:
                log.error("skipping undecodable control record %s", kv(offset=msg.offset(), error=exc))
                continue
            if name == "WeightUpdate":
                problem = self.notice_problem(rec)
                if problem == "republished":
                    continue
                if problem is not None:
                    self._dead_letter(msg, rec, *problem)
                    continue
                self._accept(rec, msg)
            elif name == "Command":
                progress = rec["name"] == PROGRESS_COMMAND
                if (problem := self.auth.problem(rec, writer_epoch=progress)) is not None:
                    self._refuse_command(msg, rec, *problem)
                    continue
                self.commands.append(rec)
                if progress:
                    self.auth.note(rec)
                    try:
                        self._note_consumed(int(rec["args"]["version"]), int(rec["args"]["consumed_groups"]))
                    except (KeyError, ValueError) as exc:
                        log.error("skipping malformed progress record %s", kv(offset=msg.offset(), error=exc))
            out.append((name, rec))
        return out

    def notice_problem(self, rec: dict):
        """None if the notice may be accepted; ``"republished"`` for a copy of an accepted one (a
        trainer re-publishing after a restart: skipped quietly); else ``(error_type, reason)``."""
        v, who = rec["version"], rec.get("trainer_id", "")
        forged = self.auth.problem(rec)
        if forged is not None:
            return forged
        if self.writer is not None and who != self.writer:
            return "foreign_writer", f"notice v{v} written by {who!r}, not by this trainer ({self.writer!r})"
        if not rec["uri"]:
            return "missing_uri", f"notice v{v} names no checkpoint"
        if not rec.get("sha256"):  # the trainer always states it: without it nothing would be verified
            return "missing_sha256", f"notice v{v} states no sha256, so its checkpoint cannot be verified"
        first = not self.accepted and self.newest == 0
        if first and self.trust_first and v > 0:
            return None
        if any(_same(rec, u) for u, _ in self.accepted):
            self.auth.note(rec)  # a restarted trainer's copy, of its new epoch
            return "republished"
        if v > self.newest + self.max_jump:
            return (
                "implausible_version",
                f"notice v{v} is ahead of the newest version v{self.newest} by more than trainer.publish_every={self.max_jump}",
            )
        if v <= 0:
            return "version_behind", f"notice v{v}: version 0 is the initial model, never announced"
        if v < self.newest:
            return "version_behind", f"notice v{v} is behind the newest version v{self.newest}"
        return None

    def _accept(self, rec: dict, msg) -> None:
        self.auth.note(rec)
        self.newest = max(self.newest, rec["version"])
        self.accepted.append((rec, msg))
        del self.accepted[:-_KEEP_NOTICES]
        self._settle()

    def _settle(self) -> None:
        """``latest_update``: the newest version accepted and not rejected (the last to arrive of it)."""
        best = None
        for u, _ in self.accepted:
            if best is None or u["version"] >= best["version"]:
                best = u
        self.latest_update = best
        self.progress_seen += 1

    def reject(self, rec: dict, error_type: str, reason: str) -> None:
        """Dead-letter accepted notice ``rec`` (its checkpoint could not be fetched or verified) and
        forget it: ``latest_update`` falls back to the newest other notice."""
        msg = next((m for u, m in self.accepted if u is rec), None)
        self.accepted = [(u, m) for u, m in self.accepted if u is not rec]
        self._settle()
        self._dead_letter(msg, rec, error_type, reason)

    def _refuse_command(self, msg, rec: dict, error_type: str, reason: str) -> None:
        """Skip a Command that fails authentication (forged, altered, or unsigned in a signed job):
        nothing acts on it; dead-lettered, and warned about once per command name and error."""
        self.refused_commands += 1
        what = (rec["name"], error_type)
        if what not in self._warned:
            self._warned.add(what)
            log.warning(
                "ignoring control commands that fail authentication (further ones counted, not logged) %s",
                kv(command=rec["name"], issued_by=rec.get("issued_by", ""), error=error_type, reason=reason),
            )
        self._dead_letter(msg, {"version": rec["args"].get("version", "?")}, error_type, reason, quiet=True)

    def _dead_letter(self, msg, rec: dict, error_type: str, reason: str, quiet: bool = False) -> None:
        self.dead_lettered += 1
        if not quiet:
            log.error("dead-lettered weight notice %s", kv(version=rec["version"], error=error_type, reason=reason))
        if msg is None:
            return
        try:
            if self._producer is None:
                conf = client_conf(self.cfg, f"{self.role}-control", self.worker_id, kind="producer")
                self._producer = Producer(conf)
            dl = dead_letter(msg, error_type, reason, self.role, self.worker_id)
            self._producer.produce_record(self.cfg.topics.name("dlq"), "DeadLetter", dl, key=msg.key())
            self._producer.flush(10)
        except Exception as exc:  # the skip is what matters; the dead letter is the record of it
            log.error("could not dead-letter weight notice %s", kv(version=rec["version"], error=exc))

    def _note_consumed(self, version: int, consumed: int) -> None:
        if consumed < 0 or consumed <= self.consumed.get(version, -1):
            return
        self.consumed[version] = consumed
        self.progress_seen += 1
        while len(self.consumed) > _KEEP_VERSIONS:
            del self.consumed[min(self.consumed)]

    def consumed_groups(self, version: int) -> int | None:
        """The trainer's consumed-group count ``C(version)`` (None: never published, use ``version * G``):
        the largest of its accepted notices' and progress records' counts."""
        counts = [u.get("consumed_groups", -1) for u, _ in self.accepted if u["version"] == version]
        best = max([self.consumed.get(version, -1), *counts])
        return best if best >= 0 else None

    def admission_limit(self, version: int, k: int, groups_per_step: int) -> int:
        """``admission_limit`` at ``version`` with the newest consumed count known for it."""
        return admission_limit(version, k, groups_per_step, self.consumed_groups(version))

    def catch_up(self, timeout: float = 10.0) -> dict | None:
        """Read everything already on the topic; return the newest WeightUpdate (or None)."""
        deadline = time.monotonic() + timeout
        # a just-created topic may have no leader yet: transient, so retried
        lo, hi = self.consumer.watermarks(self.topic, 0, timeout)
        self.trust_first = self.trust_first or lo > 0
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
        try:
            self.consumer.close()
        finally:
            if self._producer is not None:
                self._producer.close()


def _same(a: dict, b: dict) -> bool:
    return a["version"] == b["version"] and a["uri"] == b["uri"] and a["sha256"] == b["sha256"]
