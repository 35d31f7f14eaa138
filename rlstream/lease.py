"""One run per job: a lease held in Kafka by the launcher (``rlstream run``, ``rlstream demo``,
``rlstream chaos``: anything built on ``rlstream.launcher.Launcher``).

A second launch of a running job, from this machine or another one against the same broker, is
refused with ``JobAlreadyRunning`` (one line naming the running launcher: pid, host, start time,
run id) before it starts a role or writes into the run dir, so it cannot fence the first run's
workers, feed its prompts twice or overwrite its report.

The protocol, on the job's lease topic (``topics.lease``: ``<prefix>lease``, one partition,
broker timestamps), with ``JobLease`` records keyed by run id (a fresh id per launch):

1. **claim**: append a ``claim``, then read the topic up to it. Another run whose newest record
   before the claim is a ``claim`` or ``held`` and is *live* refuses the claim (the loser appends
   ``refused``): the earliest live claim wins, so of two launches at the same moment exactly one
   goes on, since each decides on what precedes its own claim. Live means: on this host (same host
   name, boot id and pid namespace), while its launcher process runs (a dead pid frees the job at
   once; a reused pid does not hold it: the process start time is compared too); on another host,
   while its newest record is younger than its ``ttl_ms`` by the broker's clock (the claim's own
   timestamp is "now"), so no two machines' clocks are compared. The winner appends ``held``.
2. **hold**: a thread appends ``held`` every ``ttl/6`` with the run's role pids, riding out broker
   outages, and reads what others append: a ``held`` of a run that claimed later means that run
   found this one dead (no record for a whole ttl, e.g. cut off from the broker) and took the job;
   then ``lost`` is set and ``guard`` ends the launcher's run with a ``failed: ...`` status.
3. **release**: a ``released`` record when the run ends, so a re-run needs no wait.

A launcher killed with ``kill -9`` leaves its roles stopping (they get SIGTERM when it dies): a
re-run on the same host waits for those pids (up to ``liveness.shutdown_timeout_s`` + 30 s)
before it starts its own roles. On another host it waits out the ttl instead.

A local fast path comes first: an exclusive ``flock`` on ``<run_dir>/.lease`` (the kernel drops it
when the process dies), which also refuses two launches of one run dir under different topics.

What this is not: a lock for roles started by hand (those fence each other through Kafka: static
membership, transactional ids), nor a cluster scheduler.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from pydantic import Field

from pipeline import codec
from pipeline.admin import Admin, has_topic
from pipeline.config import StrictModel
from pipeline.control import now_ms
from pipeline.errors import DecodeError, JobAlreadyRunning, KafkaClientError
from pipeline.kafka import TIMESTAMP_LOG_APPEND_TIME, Consumer, Producer, TopicPartition, client_conf
from pipeline.log import kv
from pipeline.ports import pid_alive

log = logging.getLogger(__name__)
SCHEMA = "JobLease"
HOLDING = ("claim", "held")
"""States of a record whose run still wants (claim) or has (held) the job."""


class LeaseConfig(StrictModel):
    """The launcher's job lease (``rlstream.lease``): one run per job."""

    ttl_s: float = Field(30.0, ge=1, le=86_400)
    """A launcher on another host holds its job until this long after its newest heartbeat (sent
    every ttl/6): after a ``kill -9`` there, a re-run waits this long. On the same host a dead
    launcher pid frees the job at once."""


# ---- this process and its host ------------------------------------------------------------------
def process_started(pid: int) -> str:
    """The start time of process ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field
    22), to tell a process from a later one with the same pid; '' where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def host_id() -> str:
    """Boot id and pid namespace of this host: two launchers compare pids only when these are
    equal (another machine, a reboot or another container has other pids)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def running(token: str) -> bool:
    """``pid:started`` (or a bare pid) still names a live process."""
    pid, _, started = token.partition(":")
    if not pid.isdigit() or not pid_alive(int(pid)):
        return False
    now = process_started(int(pid))
    return not started or not now or now == started


def utc(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ms / 1000))


# ---- the decision (pure) --------------------------------------------------------------------------
def newest_records(records: list[dict]) -> dict[str, dict]:
    """Run id -> its newest record (records in offset order, each with ``_offset`` and ``_ts``),
    with ``_first`` the offset of its first one."""
    out: dict[str, dict] = {}
    for r in records:
        first = out[r["run_id"]]["_first"] if r["run_id"] in out else r["_offset"]
        out[r["run_id"]] = {**r, "_first": first}
    return out


def holders(records: list[dict], me: str, now_ts: int, host: str, hid: str) -> tuple[list[dict], list[dict]]:
    """The other runs that hold the job as of ``now_ts`` (broker time of this run's claim), given
    the records before the claim: ``(live, stopping)``, earliest claim first. ``stopping``: runs
    of this host whose launcher died while some of their roles still run."""
    live, stopping = [], []
    for run_id, r in sorted(newest_records(records).items(), key=lambda kv_: kv_[1]["_first"]):
        if run_id == me or r["state"] not in HOLDING:
            continue
        if hid and r["host"] == host and r["host_id"] == hid:  # this host: its processes tell
            if running(f"{r['pid']}:{r['pid_started']}"):
                live.append(r)
            elif any(running(t) for t in r["role_pids"]):
                stopping.append(r)
        elif now_ts - r["_ts"] < r["ttl_ms"]:
            live.append(r)
    return live, stopping


def describe(r: dict) -> str:
    return (
        f"pid {r['pid']} on host {r['host']} since {utc(r['started_at_ms'])} (run id {r['run_id'][:12]}"
        + (f", run dir {r['run_dir']}" if r.get("run_dir") else "")
        + ")"
    )


def job_label(job: str, prefix: str) -> str:
    return f"job '{job}'" if job else f"the run on topics {prefix}*"


def refusal(job: str, r: dict, same_host: bool, now_ts: int | None = None) -> str:
    """The one line that refuses a second launch (``now_ts``: the broker's time, for a lease of
    another host; None: the local lock, which its holder keeps until it exits)."""
    if same_host:
        hint = f"stop it first (Ctrl-C there, or kill {r['pid']})"
    elif now_ts is None:
        hint = "stop it first"
    else:
        wait = max(1, math.ceil((r["ttl_ms"] - (now_ts - r["_ts"])) / 1000))
        hint = f"stop it first, or wait {wait} s if it crashed"
    return f"{job} is already running: {describe(r)}; {hint}"


def live_holder(cfg) -> dict | None:
    """Read-only: the newest record of a run that holds the job now (by this machine's clock for
    another host's lease), None when none does or the job has no lease topic. For listings and
    for refusing a launch before anything is claimed; the claim (``JobLease``) decides."""
    topic = cfg.topics.name("lease")
    if not has_topic(cfg, topic):
        return None
    records = []
    with Consumer(client_conf(cfg, "lease", kind="consumer")) as c:
        for m in c.read_to_end(topic, timeout=cfg.kafka.request_timeout_s, strict=False):
            try:
                r = codec.decode_as(m.value(), SCHEMA)
            except DecodeError:
                continue
            records.append({**r, "_offset": m.offset(), "_ts": m.timestamp()[1]})
    live, _ = holders(records, "", now_ms(), socket.gethostname(), host_id())
    return live[0] if live else None


def refuse_if_running(cfg) -> None:
    """JobAlreadyRunning (the lease's own line) when a run holds the job now."""
    r = live_holder(cfg)
    if r is not None:
        same = bool(host_id()) and r["host"] == socket.gethostname() and r["host_id"] == host_id()
        raise JobAlreadyRunning(refusal(job_label(cfg.job.name, cfg.topics.prefix), r, same, now_ms()))


def ensure_lease_topic(cfg) -> str:
    """Create the job's lease topic (``topics.lease``) if it is missing; returns its name."""
    admin = Admin(client_conf(cfg, "admin"), cfg.kafka.request_timeout_s)
    try:
        admin.create_topics(
            {cfg.topics.name("lease"): cfg.topics.lease}, cfg.topics.replication_factor, cfg.topics.min_insync_replicas
        )
    finally:
        admin.close()
    return cfg.topics.name("lease")


# ---- the lease --------------------------------------------------------------------------------------
class JobLease:
    """``with JobLease(cfg, run_dir) as lease:`` holds the job for the block (``acquire`` /
    ``release``); ``JobAlreadyRunning`` on entry while another run holds it."""

    def __init__(self, cfg, run_dir: str | Path, *, role_pids: Callable[[], list[int]] | None = None, say=None):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.topic = cfg.topics.name("lease")
        self.ttl_ms = int(cfg.lease.ttl_s * 1000)
        self.run_id = uuid.uuid4().hex
        self.job = job_label(cfg.job.name, cfg.topics.prefix)
        self.role_pids = role_pids or (lambda: [])
        self.say = say or (lambda msg: log.info("%s", msg))
        self.host, self.host_id = socket.gethostname(), host_id()
        self.started_at_ms = now_ms()
        self.claim_offset: int | None = None
        self.lost: str | None = None
        """Set (with the reason) when another run took the job over (see the module docstring)."""
        self._producer: Producer | None = None
        self._watch: Consumer | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._local: int | None = None

    # -- acquire --------------------------------------------------------------------------------------
    def __enter__(self) -> JobLease:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> JobLease:
        """Take the job, or raise JobAlreadyRunning (nothing started, nothing left held)."""
        try:
            self._lock_run_dir()
            self.claim()
            self.decide()
        except BaseException:
            self.release(quiet=True)
            raise
        return self

    def claim(self) -> int:
        """Append this run's claim; returns its offset."""
        ensure_lease_topic(self.cfg)
        self._producer = Producer(client_conf(self.cfg, "lease", kind="producer"))
        self.claim_offset = self._append("claim", wait=True)
        return self.claim_offset

    def decide(self) -> None:
        """Read the topic up to this run's claim: refuse (JobAlreadyRunning) if another run holds the
        job, else hold it (``held`` records from a thread). Waits for the roles of a launcher of
        this host that died (``kill -9``) to exit first."""
        records, now_ts = self._read_to_claim()
        live, stopping = holders(records, self.run_id, now_ts, self.host, self.host_id)
        if live:
            r = live[0]
            same = bool(self.host_id) and r["host"] == self.host and r["host_id"] == self.host_id
            self._append("refused", wait=True)
            log.info("job lease refused %s", kv(topic=self.topic, holder=r["run_id"], pid=r["pid"], host=r["host"]))
            raise JobAlreadyRunning(refusal(self.job, r, same, now_ts))
        self._append("held", wait=True)
        self._watch = Consumer(client_conf(self.cfg, "lease", kind="consumer"))
        self._watch.assign([TopicPartition(self.topic, 0, self.claim_offset + 1)])
        self._thread = threading.Thread(target=self._heartbeat, name="job-lease", daemon=True)
        self._thread.start()
        log.info("job lease held %s", kv(topic=self.topic, run_id=self.run_id, offset=self.claim_offset))
        for r in stopping:
            self._wait_for_roles(r)

    def _wait_for_roles(self, r: dict) -> None:
        limit = self.cfg.liveness.shutdown_timeout_s + 30
        deadline = time.monotonic() + limit
        left = [t for t in r["role_pids"] if running(t)]
        if left:
            self.say(f"the previous run's launcher (pid {r['pid']}) died; waiting for its roles to stop: "
                     f"pids {', '.join(t.split(':')[0] for t in left)}")  # fmt: skip
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            left = [t for t in left if running(t)]
        if left:
            pids = " ".join(t.split(":")[0] for t in left)
            raise JobAlreadyRunning(
                f"{self.job} is still stopping: its launcher (pid {r['pid']}) died, but its roles (pids {pids}) "
                f"still run after {limit:.0f} s; stop them (kill {pids}) and run again"
            )

    def _lock_run_dir(self) -> None:
        """The local fast path: an exclusive flock on ``<run_dir>/.lease`` for the run's life."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / ".lease"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                r = json.loads(os.read(fd, 65536) or b"{}")
                text = refusal(job_label(r["job"], r["prefix"]), r, r["host"] == self.host)
            except (ValueError, KeyError, TypeError):  # its holder has not written it yet
                text = f"run dir {self.run_dir} is in use by another launcher; stop it first"
            os.close(fd)
            raise JobAlreadyRunning(text) from None
        except OSError as exc:  # a file system without flock: the Kafka lease still holds
            os.close(fd)
            log.debug("no local lock on the run dir %s", kv(path=path, error=exc))
            return
        me = {"run_id": self.run_id, "job": self.cfg.job.name, "prefix": self.cfg.topics.prefix, "pid": os.getpid(),
              "host": self.host, "started_at_ms": self.started_at_ms, "run_dir": str(self.run_dir)}  # fmt: skip
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._local = fd

    # -- records ----------------------------------------------------------------------------------------
    def _record(self, state: str) -> dict:
        try:
            pids = list(self.role_pids())
        except Exception:  # the launcher's child table changed under us: the next heartbeat has them
            pids = []
        return {
            "run_id": self.run_id,
            "state": state,
            "job": self.cfg.job.name,
            "pid": os.getpid(),
            "pid_started": process_started(os.getpid()),
            "host": self.host,
            "host_id": self.host_id,
            "role_pids": [f"{p}:{process_started(p)}" for p in pids],
            "run_dir": str(self.run_dir),
            "started_at_ms": self.started_at_ms,
            "written_at_ms": now_ms(),
            "ttl_ms": self.ttl_ms,
        }

    def _append(self, state: str, wait: bool = False, timeout: float | None = None) -> int:
        """Append a record; with ``wait``, its offset once the broker has it (DeliveryError if not
        within ``timeout``, default ``kafka.request_timeout_s``)."""
        done: list[int] = []

        def delivered(err, msg):
            if err is None:
                done.append(msg.offset())

        self._producer.produce_record(self.topic, SCHEMA, self._record(state), key=self.run_id.encode(), partition=0,
                                      on_delivery=delivered)  # fmt: skip
        if not wait:
            return -1
        self._producer.flush(timeout or self.cfg.kafka.request_timeout_s)
        return done[0] if done else -1

    def _decode(self, m) -> dict | None:
        try:
            r = codec.decode_as(m.value(), SCHEMA)
        except DecodeError as exc:  # a foreign record must not make the job unstartable
            log.warning("skipped a record on the lease topic %s", kv(offset=m.offset(), error=exc))
            return None
        ts_type, ts = m.timestamp()
        if ts_type != TIMESTAMP_LOG_APPEND_TIME:  # a topic made by hand: the writer's clock
            ts = ts if ts > 0 else r["written_at_ms"]
        return {**r, "_offset": m.offset(), "_ts": ts}

    def _read_to_claim(self) -> tuple[list[dict], int]:
        """The decoded records before this run's claim, and the claim's broker timestamp."""
        with Consumer(client_conf(self.cfg, "lease", kind="consumer")) as c:
            msgs = c.read_to_end(self.topic, timeout=self.cfg.kafka.request_timeout_s)
        records, now_ts = [], now_ms()
        for m in msgs:
            if m.offset() > self.claim_offset or (r := self._decode(m)) is None:
                continue
            if m.offset() == self.claim_offset:
                now_ts = r["_ts"]
            else:
                records.append(r)
        return records, now_ts

    # -- hold -------------------------------------------------------------------------------------------
    def _heartbeat(self) -> None:
        """Thread: a ``held`` record every ttl/6, and watch for a run that took the job over."""
        period = max(0.2, self.ttl_ms / 6000)
        failures = 0
        while not self._stop.wait(period):
            try:
                self._append("held")
                self._producer.poll(0)
                self._check_taken()
                failures = 0
            except KafkaClientError as exc:  # a broker outage: the roles ride it out, and so does the lease
                failures += 1
                if failures % 10 == 1:
                    log.warning("job lease heartbeat failed, retrying %s", kv(error=exc, failures=failures))
            except Exception as exc:  # anything else: the run stops loudly rather than hold the job unseen
                log.exception("job lease heartbeat failed")
                self.lost = f"the job lease's heartbeat failed: {type(exc).__name__}: {exc}"
                return

    def _check_taken(self) -> None:
        for m in self._watch.consume(500, 0):
            r = self._decode(m)
            if r is not None and r["run_id"] != self.run_id and r["state"] == "held" and self.lost is None:
                self.lost = (f"lost the job lease to {describe(r)}: this launcher's heartbeats did not reach the "
                             f"broker for {self.ttl_ms / 1000:.0f} s")  # fmt: skip
                log.error("job lease lost %s", kv(topic=self.topic, to=r["run_id"], pid=r["pid"], host=r["host"]))

    def guard(self, tick=None):
        """A launcher ``tick`` that ends the run (``failed: lost the job lease ...``) once another run
        has taken the job over, else calls ``tick``."""

        def guarded():
            if self.lost:
                return f"failed: {self.lost}"
            return tick() if tick is not None else None

        return guarded

    # -- release ----------------------------------------------------------------------------------------
    def release(self, quiet: bool = False) -> None:
        """Stop the heartbeats, append ``released`` (if this run held the job), close everything.
        Bounded: with the broker away the release is skipped (the pid or the ttl frees the job)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.cfg.kafka.request_timeout_s)
        try:
            if self._producer is not None and self._thread is not None:
                self._append("released", wait=True, timeout=min(10.0, self.cfg.kafka.request_timeout_s))
        except KafkaClientError as exc:
            log.warning("job lease not released (the pid or the ttl frees it) %s", kv(error=exc))
        finally:
            self._thread = None
            if self._watch is not None:
                self._watch.close()
                self._watch = None
            if self._producer is not None:
                self._producer.abandon()  # flushed above, or the broker is away
                self._producer = None
            if self._local is not None:
                os.close(self._local)  # drops the flock
                self._local = None
        if not quiet:
            log.info("job lease released %s", kv(topic=self.topic, run_id=self.run_id))
