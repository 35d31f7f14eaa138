"""The concurrent ``read_committed`` auditor of ``rlstream chaos`` (Kafka's own model:
``tests/kafkatest/tests/core/transactions_test.py`` runs a consumer in read_committed beside the
copiers it bounces).

A separate process (``python -m rlstream.dev.chaos_live``), started just before the feed and
stopped after the drain, that shares nothing with the roles: no group (it assigns every partition
of rl.rollouts and rl.scored from the log start), no restarts, never a fault target. It writes each
record as it sees it, in the order it sees it, to ``<run dir>/live-audit.jsonl`` (partition,
offset, a digest of the value, trajectory id, the rl.rollouts source of a scored record, the wall
time it was seen and the record's timestamp). Told to stop (SIGTERM), it reads on to the end
offsets of that moment and writes ``live-audit.done.json``.

``check`` (pure) then compares what it saw live with the final read of the same topics
(``chaos_audit.read_topics``, after the run):

* **phantom**: a record seen live that is not in the final read at the same (partition, offset)
  with the same bytes (an aborted record served to a read_committed reader, or a record that
  vanished or changed);
* **out of order**: per partition, the live sequence of offsets is not a prefix of the final one
  (a record seen twice or after a later one, or skipped: a later one seen while it was not);
* **scored twice**: two records seen live on rl.scored with one rl.rollouts (partition, offset);
* **lost**: a record of the final read the live reader never saw (it reads on to the end first).

Figures: records seen per topic, and the lag from a record's timestamp to the moment it was seen.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from pipeline import codec
from pipeline.errors import DecodeError

log = logging.getLogger(__name__)

ROLES = ("rollouts", "scored")
"""The topics read live (by role)."""
SCHEMA = {"rollouts": "Trajectory", "scored": "ScoredTrajectory"}
ROWS_FILE, DONE_FILE = "live-audit.jsonl", "live-audit.done.json"
READY_FILE = "live-audit.ready"
"""Written once the auditor reads (its SIGTERM handler set): a stop before that would kill it."""
CATCH_UP_S = 300.0
"""How long the stopped auditor may take to read on to the end offsets."""
EXAMPLES = 20
KAFKA_FIELDS = ("bootstrap_servers", "client_id_prefix", "common", "consumer")
"""What ``pipeline.kafka.client_conf`` reads of the ``kafka`` settings."""
COUNTERS = ("live_phantom", "live_out_of_order", "live_scored_twice", "live_lost")
"""The verdict's counters of this audit (each fails the run when not 0)."""


def digest(value: bytes | None) -> str:
    """A record's value, as compared between the live and the final read (``rlstream.audit``'s)."""
    from rlstream.audit import digest as final_digest

    return final_digest(value)


def ids_of(role: str, value: bytes | None) -> tuple[str | None, list[int] | None]:
    """(trajectory id, rl.rollouts [partition, offset] of a scored record); Nones where it does not
    decode (a bad record injected by the fault run)."""
    try:
        rec = codec.decode_as(value, SCHEMA[role])
    except (DecodeError, TypeError):
        return None, None
    if role == "rollouts":
        return rec["trajectory_id"], None
    return rec["trajectory"]["trajectory_id"], [rec["source_partition"], rec["source_offset"]]


# ---- the process -----------------------------------------------------------------------------
def read_live(kafka: dict, topics: dict[str, str], out: Path, catch_up_s: float = CATCH_UP_S) -> dict:
    """Read ``topics`` (role -> name) from the log start until SIGTERM, then on to the end offsets
    of that moment; every record to ``out/ROWS_FILE`` as ``[role, p, o, digest, tid, src, seen, ts]``.
    ``kafka``: the run's ``kafka`` settings (``KAFKA_FIELDS``), for the wrapper's ``client_conf``."""
    from types import SimpleNamespace

    from pipeline.errors import ConsumeError
    from pipeline.kafka import OFFSET_BEGINNING, Consumer, TopicPartition, client_conf

    stop: list[float] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(time.time()))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    parent = os.getppid()
    role_of = {name: role for role, name in topics.items()}
    seen, errors, ends = Counter(), [], None
    conf = client_conf(SimpleNamespace(kafka=SimpleNamespace(**kafka)), "chaos-live-audit", "auditor", "consumer")
    with Consumer(conf) as c, open(out / ROWS_FILE, "w") as f:
        parts = {role: c.partitions(name, timeout=120) for role, name in topics.items()}
        c.assign([TopicPartition(topics[r], p, OFFSET_BEGINNING) for r, ps in parts.items() for p in ps])
        (out / READY_FILE).write_text(str(os.getpid()))
        t_flush = time.monotonic()
        while True:
            try:
                msgs = c.consume(1000, 0.5)
            except ConsumeError as exc:  # counted; the final comparison finds what it cost
                errors.append(f"{time.time():.1f} {exc}"[:300])
                time.sleep(1)
                msgs = []
            now = time.time()
            for m in msgs:
                role = role_of[m.topic()]
                tid, src = ids_of(role, m.value())
                ts = m.timestamp()[1] / 1000
                f.write(json.dumps([role, m.partition(), m.offset(), digest(m.value()), tid, src, now, ts]) + "\n")
                seen[role] += 1
            if time.monotonic() - t_flush > 1:
                f.flush()
                t_flush = time.monotonic()
            if os.getppid() != parent:  # the driver is gone: nobody will read the result
                return {"orphaned": True}
            if stop and ends is None:
                ends = {(topics[r], p): c.watermarks(topics[r], p)[1] for r, ps in parts.items() for p in ps}
                ends = {tp: hi for tp, hi in ends.items() if hi > 0}
            if ends is not None:
                pos = c.position(list(ends))
                ends = {tp: hi for tp, hi in ends.items() if pos.get(tp, -1) < hi}
                if not ends or time.time() - stop[0] > catch_up_s:
                    break
    left = {f"{t}[{p}]": hi for (t, p), hi in (ends or {}).items()}
    return {"caught_up": not left, "behind": left, "seen": dict(seen), "errors": errors[:EXAMPLES],
            "error_count": len(errors), "stop_s": round(time.time() - stop[0], 1)}  # fmt: skip


def main() -> None:
    """The process: its spec (``kafka``, ``topics``, ``out``) as JSON on stdin (the client settings
    may hold credentials: never in a file or on the command line)."""
    from pipeline.log import setup_logging
    from pipeline.worker import die_with_parent

    setup_logging("INFO")
    die_with_parent()
    spec = json.loads(sys.stdin.read())
    out = Path(spec["out"])
    done = read_live(spec["kafka"], spec["topics"], out, spec.get("catch_up_s", CATCH_UP_S))
    (out / DONE_FILE).write_text(json.dumps(done))


# ---- the driver's handle ---------------------------------------------------------------------
class LiveAuditor:
    """Starts, stops and reads back the auditor process for the chaos driver. ``kafka``: the run's
    ``cfg.kafka``; ``out``: the run directory (with its ``logs/``)."""

    def __init__(self, kafka, topics: dict[str, str], out: Path):
        self.out, self.proc = out, None
        self.spec = {"kafka": {k: getattr(kafka, k) for k in KAFKA_FIELDS}, "topics": topics, "out": str(out)}

    def start(self) -> None:
        for name in (ROWS_FILE, DONE_FILE, READY_FILE):
            (self.out / name).unlink(missing_ok=True)
        with open(self.out / "logs" / "live-audit.log", "ab") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rlstream.dev.chaos_live"],
                stdin=subprocess.PIPE,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env={**os.environ, "RLSTREAM_PARENT_PID": str(os.getpid())},
                start_new_session=True,  # Ctrl-C reaches the driver, which stops it
            )
        self.proc.stdin.write(json.dumps(self.spec).encode())
        self.proc.stdin.close()

    def stop(self, timeout: float = CATCH_UP_S + 60) -> dict:
        """SIGTERM, wait for the catch-up; what the process reported (``exit``: its code)."""
        if self.proc is None:
            return {"exit": None, "why": "never started"}
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and not (self.out / READY_FILE).is_file() and time.monotonic() < deadline:
            time.sleep(0.2)  # still starting (imports on a loaded machine): SIGTERM would kill it unread
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        done_path = self.out / DONE_FILE
        done = json.loads(done_path.read_text()) if done_path.is_file() else {}
        return {**done, "exit": code}

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def rows(self) -> dict[str, list[dict]]:
        return load_rows(self.out / ROWS_FILE)


def load_rows(path: Path) -> dict[str, list[dict]]:
    """The rows file as role -> rows in the order seen (a torn last line, from a kill, is dropped)."""
    out: dict[str, list[dict]] = {r: [] for r in ROLES}
    if not path.is_file():
        return out
    with open(path) as f:
        for line in f:
            try:
                role, p, o, h, tid, src, seen, ts = json.loads(line)
            except ValueError:
                continue
            out[role].append({"p": p, "o": o, "h": h, "tid": tid, "src": src and tuple(src), "seen": seen, "ts": ts})
    return out


# ---- the checks ------------------------------------------------------------------------------
def _quantiles(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    xs = sorted(xs)
    at = lambda q: round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)  # noqa: E731
    return {"n": len(xs), "p50_s": at(0.5), "p99_s": at(0.99), "max_s": round(xs[-1], 3)}


def check(live: dict, final: dict, skip: set | frozenset = frozenset(), done: dict | None = None) -> dict:
    """Compare the live view (role -> rows in the order seen) with the final read (role -> rows of
    ``chaos_audit.read_topics``, each with its ``h`` digest). ``skip``: (partition, offset) of
    rl.scored records the fault run injected (no source to be scored twice from). ``done``: what the
    process reported at its end (``LiveAuditor.stop``); a process that did not exit 0 having read
    on to the end fails the run as well."""
    phantom, order, lost, lag = [], [], [], {}
    r: dict = {"seen": {}, "final": {}}
    for role in ROLES:
        rows, fin = live.get(role, []), {(x["p"], x["o"]): x for x in final.get(role, [])}
        r["seen"][role], r["final"][role] = len(rows), len(fin)
        seq: dict[int, list[int]] = defaultdict(list)
        seen: set[tuple[int, int]] = set()
        for x in rows:
            key, f = (x["p"], x["o"]), fin.get((x["p"], x["o"]))
            if f is None or f.get("h") != x["h"]:
                why = "not in the final read (aborted or gone)" if f is None else "other bytes in the final read"
                phantom.append({"topic": role, "p": x["p"], "o": x["o"], "tid": x.get("tid"), "why": why})
            if key in seen:
                order.append({"topic": role, "p": x["p"], "o": x["o"], "why": "seen twice"})
            elif seq[x["p"]] and x["o"] < seq[x["p"]][-1]:
                order.append({"topic": role, "p": x["p"], "o": x["o"], "why": f"seen after offset {seq[x['p']][-1]}"})
            seq[x["p"]].append(x["o"])
            seen.add(key)
        for p, o in sorted(fin):
            if (p, o) in seen:
                continue
            lost.append({"topic": role, "p": p, "o": o, "tid": fin[(p, o)].get("tid")})
            if seq[p] and o < max(seq[p]):  # a later record of its partition was seen: not a prefix
                order.append({"topic": role, "p": p, "o": o, "why": f"skipped (offset {max(seq[p])} seen)"})
        lag[role] = _quantiles([x["seen"] - x["ts"] for x in rows if x.get("ts", 0) > 0 and x.get("seen")])
    by_source = defaultdict(list)
    for x in {(x["p"], x["o"]): x for x in live.get("scored", [])}.values():
        if x.get("src") and x["src"][0] >= 0 and (x["p"], x["o"]) not in skip:
            by_source[tuple(x["src"])].append((x["p"], x["o"]))
    twice = [{"rollouts": list(s), "scored": at} for s, at in by_source.items() if len(at) > 1]
    r.update(
        phantom=len(phantom), phantom_examples=phantom[:EXAMPLES], out_of_order=len(order),
        order_examples=order[:EXAMPLES], scored_twice=len(twice), scored_twice_examples=twice[:EXAMPLES],
        lost=len(lost), lost_examples=lost[:EXAMPLES], lag=lag, process=done,
    )  # fmt: skip
    r["counts"] = dict(zip(COUNTERS, (r["phantom"], r["out_of_order"], r["scored_twice"], r["lost"]), strict=True))
    r["failed"] = []
    if done is not None and (done.get("exit") != 0 or not done.get("caught_up")):
        r["failed"].append(
            f"live auditor did not read to the end (exit {done.get('exit')}, behind {done.get('behind')})"
        )
    return r


def not_run(why: str) -> dict:
    """The live audit of a run that ended before it could be done: fails the verdict."""
    return {"counts": dict.fromkeys(COUNTERS, -1), "failed": [f"no live audit: {why}"], "seen": {}, "lag": {}}


def figures(r: dict) -> str:
    """``live_seen=... live_lag_p99=...`` for the verdict line."""
    seen = sum(r.get("seen", {}).values())
    p99 = max((v.get("p99_s", 0) for v in r.get("lag", {}).values()), default=0)
    return f"live_seen={seen} live_lag_p99={p99:.1f}s"


if __name__ == "__main__":
    main()
