"""``rlstream audit JOB``: what a job's topics and its trainer's durable steps log say happened,
never what its workers counted or printed; also the audit of a fault run (``rlstream chaos``
imports it from here).

``read_topics`` reads rl.prompts, rl.rollouts, rl.scored and rl.dlq to their end (read_committed,
so aborted transactions do not count) and keeps the few fields the checks need. ``audit`` checks,
as pure functions of that data, the steps log (``consumers.trainer.state.read_steps_log``:
committed steps only) and the bad records to find in rl.dlq:

* fed groups: distinct ``group_seq`` of the feed's Prompt records; every one of ``0..N-1`` must be
  there;
* lost: a fed group whose trajectory ids (``<group_id>/<i>``, i < group_size, or the larger
  ``group_size`` its rollouts were published with: a trained tail) are not all in
  what some step disposed of (``used``, ``stale``, ``incomplete_dropped``, ``update_skipped``,
  ``filtered``, ``overlong``); in flight (with ``in_flight_from``): one whose missing trajectories
  all wait where their stage has not yet read; stalled: a fed group that reached rl.scored but no
  finished step, and is not in flight;
* scored twice: two committed ScoredTrajectory records of one rl.rollouts (partition, offset);
* trained twice: a trajectory id in ``used`` more than once;
* order: in each rl.scored partition, the records scored from one rl.rollouts partition follow
  its offsets;
* staleness: a used sample whose step version minus the version of its oldest trained token
  exceeds k. That version is the ``version_min`` of the copy on rl.scored the trainer reads first
  (the lowest offset of its partition); under ``rl.staleness_rule = "token"``, for a sample
  the step lists in ``token_masked`` (its oldest tokens masked), it is the version of the first
  trained token (``from``), computed from that record's own ``metadata["versions"]`` marks, not
  taken from the trainer's ``oldest`` (a claim that disagrees with the record is a violation too);
* non-finite steps: a step whose loss or grad norm is NaN/inf;
* the DLQ: every bad record must be there (matched by source topic/partition/offset; a bad
  rollout that was scored and then refused by the trainer is matched through its scored copy),
  with an error type and a reason; repeats (at-least-once hops) are counted apart.

``audit_job`` runs them on one job (the bad records: those of its topics that do not decode;
groups still in flight are reported as such, so a running job can be audited), ``summary`` turns
the findings into a verdict and one line, and ``main`` is the command. What this is not: a
monitor of a live run (it reads once), nor a check of records that decode but carry wrong values
(a role dead-letters those itself; the report counts every dead letter it found).
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from pathlib import Path

from pipeline import codec
from pipeline.errors import ConfigError, DecodeError
from pipeline.records import DEMO_KEY, VERSIONS_KEY, InvalidRecord, split_version_marks

TOPICS = ("prompts", "rollouts", "scored")
"""The stages' topics the audit follows a group through (rl.dlq is read too)."""


def digest(value: bytes | None) -> str:
    """A record's value, as compared between a live read and the final one."""
    import hashlib

    return "null" if value is None else hashlib.blake2b(value, digest_size=8).hexdigest()


EXAMPLES = 20
"""Longest list of examples kept per finding in the report."""


# ---- reading ---------------------------------------------------------------------------------
def _reduce(role: str, rec: dict) -> dict:
    if role == "prompts":
        return {
            "group_seq": rec["group_seq"],
            "group_id": rec["group_id"],
            "group_size": rec["group_size"],
            "feed": rec["metadata"].get("feed"),
        }
    if role == "rollouts":
        return {"tid": rec["trajectory_id"], "gid": rec["group_id"], "size": rec["group_size"]}
    if role == "scored":
        t = rec["trajectory"]
        return {
            "tid": t["trajectory_id"],
            "gid": t["group_id"],
            "version_min": t["version_min"],
            "versions": (t.get("metadata") or {}).get(VERSIONS_KEY),
            "demo": (t.get("metadata") or {}).get(DEMO_KEY) == "1",
            "src": (rec["source_partition"], rec["source_offset"]),
        }
    return {
        "source": (rec["source_topic"], rec["source_partition"], rec["source_offset"]),
        "error_type": rec["error_type"],
        "reason": rec["reason"],
        "role": rec["role"],
    }


def read_topics(cfg, timeout: float = 300.0) -> dict[str, list[dict]]:
    """Each topic as a list of ``{"p", "o", "h" (digest of the value), ...fields}`` (``"bad": True``
    where it does not decode)."""
    from pipeline.kafka import Consumer, client_conf

    schema = {"prompts": "Prompt", "rollouts": "Trajectory", "scored": "ScoredTrajectory", "dlq": "DeadLetter"}
    out: dict[str, list[dict]] = {}
    with Consumer(client_conf(cfg, "audit", kind="consumer")) as c:
        for role, name in schema.items():
            rows = []
            for m in c.read_to_end(cfg.topics.name(role), timeout=timeout):
                row = {"p": m.partition(), "o": m.offset(), "h": digest(m.value())}
                try:
                    row.update(_reduce(role, codec.decode_as(m.value(), name)))
                except DecodeError:
                    row["bad"] = True
                rows.append(row)
            out[role] = rows
    return out


def read_positions(cfg, timeout: float = 60.0) -> dict[tuple[str, int], int]:
    """Where the group that reads each of rl.prompts, rl.rollouts and rl.scored has committed, per
    (topic, partition), at the end of the run: a bad record at or past it was never read (the job
    ended first), so no dead letter is owed for it yet."""
    from pipeline.admin import Admin
    from pipeline.kafka import client_conf

    groups = {"prompts": cfg.rollout.group_id, "rollouts": cfg.reward.group_id, "scored": cfg.trainer.group_id}
    admin = Admin(client_conf(cfg, "audit"), timeout)
    try:
        out = {}
        for role, group in groups.items():
            name = cfg.topics.name(role)
            for p, off in admin.committed(group, name, len(admin.watermarks(name))).items():
                out[(name, p)] = off
        return out
    finally:
        admin.close()


# ---- checks ----------------------------------------------------------------------------------
def _finite(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def version_at(marks: str | None, version_min: int, index: int) -> int:
    """The version that generated response token ``index``, by a record's ``"i@v,..."`` marks
    (producers/sample.py: version v from index i to the next mark); ``version_min`` before the
    first mark, and for the whole response when the marks are missing or unreadable."""
    try:
        before = [(i, v) for i, v in split_version_marks(marks) if i <= index]
    except InvalidRecord:  # unreadable (or "i@v@w"): the conservative reading
        return version_min
    return max(before)[1] if before else version_min


def audit(
    data: dict,
    steps: list[dict],
    fuzz: list[dict],
    *,
    topics: dict[str, str],
    feed: str,
    expected_groups: int,
    k: int,
    read_upto: dict[tuple[str, int], int] | None = None,
    in_flight_from: dict[tuple[str, int], int] | None = None,
) -> dict:
    """All checks; ``topics`` maps prompts/rollouts/scored to their full names, ``fuzz`` lists the
    injected records (``topic`` role, ``kind``, ``partition``, ``offset``); ``read_upto``
    (``read_positions``): a bad record at or past its group's committed offset was never read, and
    counts as unread, not as a missing dead letter (``None``: every bad record counts).
    ``in_flight_from`` (``read_positions``, read before the topics and the steps log): a group not
    yet disposed of whose every missing trajectory still waits at or past its stage's committed
    offset (its scored copy for the trainer, else its rollout for the reward workers, else its
    prompt for the rollout workers) is in flight, not lost nor stalled (``None``: a drained run,
    where every group not disposed of is lost)."""
    fuzz_at = {(topics[f["topic"]], f["partition"], f["offset"]): f for f in fuzz if f.get("offset") is not None}
    r: dict = {}

    # fed groups
    fed: dict[int, dict] = {}
    prompt_copies = Counter()
    for row in data["prompts"]:
        if not row.get("bad") and row["feed"] == feed:
            fed.setdefault(row["group_seq"], row)
            prompt_copies[(row["group_seq"], row["group_id"])] += 1
    r["fed_groups"], r["expected_groups"] = len(fed), expected_groups
    r["never_fed"] = sorted(set(range(expected_groups)) - set(fed))[:EXAMPLES]
    r["never_fed_count"] = len(set(range(expected_groups)) - set(fed))
    r["extra_fed"] = sorted(g for g in fed if not 0 <= g < expected_groups)[:EXAMPLES]
    r["prompt_records_repeated"] = sum(n - 1 for n in prompt_copies.values())

    # the steps log
    used = Counter(t for s in steps for t in s["used"])
    # disposed by a step: trained, refused as stale or incomplete, in an update that was skipped
    # (non-finite gradients), filtered by dynamic sampling, or masked as overlong
    disposed = ("used", "stale", "incomplete_dropped", "update_skipped", "filtered", "overlong")
    accounted = {t for s in steps for key in disposed for t in s.get(key, ())}
    stepped_groups = Counter(g for s in steps for key in ("groups", "filtered_groups") for g in s.get(key, ()))
    r["steps"] = len(steps)
    r["samples_used"] = sum(used.values())
    r["samples_stale"] = sum(len(s["stale"]) for s in steps)
    r["samples_incomplete_dropped"] = sum(len(s["incomplete_dropped"]) for s in steps)
    twice = [t for t, n in used.items() if n > 1]
    r["trained_twice"], r["trained_twice_examples"] = len(twice), twice[:EXAMPLES]
    r["groups_in_two_steps"] = sorted(g for g, n in stepped_groups.items() if n > 1)[:EXAMPLES]
    bad_steps = [
        {"step": s["step"], "loss": s.get("loss"), "grad_norm": s.get("grad_norm")}
        for s in steps
        if not (_finite(s.get("loss")) and _finite(s.get("grad_norm", 0.0)))
    ]
    r["nonfinite_steps"], r["nonfinite_examples"] = len(bad_steps), bad_steps[:EXAMPLES]
    r["fuzz_groups_in_steps"] = sorted(g for g in stepped_groups if g.startswith("fuzz-"))[:EXAMPLES]
    r["fuzz_groups_in_steps_count"] = sum(1 for g in stepped_groups if g.startswith("fuzz-"))

    # what reached each topic, per group
    scored_tids, rollout_tids = defaultdict(set), defaultdict(set)
    first_copy: dict[str, tuple] = {}  # tid -> (partition, offset, version_min, versions marks)
    rollout_at: dict[str, tuple[int, int]] = {}  # tid -> its first rl.rollouts (partition, offset)
    by_source: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    scored_src: dict[tuple[int, int], tuple[int, int]] = {}
    for row in data["scored"]:
        if row.get("bad") or (topics["scored"], row["p"], row["o"]) in fuzz_at:
            continue
        scored_tids[row["gid"]].add(row["tid"])
        scored_src[(row["p"], row["o"])] = row["src"]
        if row["src"][0] >= 0:
            by_source[row["src"]].append((row["p"], row["o"]))
        prev = first_copy.get(row["tid"])
        if prev is None or (row["p"], row["o"]) < prev[:2]:
            first_copy[row["tid"]] = (row["p"], row["o"], row["version_min"], row.get("versions"))
    published_size: dict[str, int] = {}  # over-provisioned groups with a trained tail publish more
    for row in data["rollouts"]:
        if not row.get("bad"):
            rollout_tids[row["gid"]].add(row["tid"])
            rollout_at[row["tid"]] = min(rollout_at.get(row["tid"], (row["p"], row["o"])), (row["p"], row["o"]))
            published_size[row["gid"]] = max(published_size.get(row["gid"], 0), row.get("size", 0))
    # per-partition order: in each rl.scored partition, the records of one rollouts partition follow
    # its offsets (a reward worker scores a partition in order and commits transactions in order)
    last_src: dict[tuple[int, int], tuple[int, int]] = {}  # (scored p, source p) -> (source o, scored o)
    disorder = []
    for row in sorted(data["scored"], key=lambda x: (x["p"], x["o"])):
        if row.get("bad") or (topics["scored"], row["p"], row["o"]) in fuzz_at or row["src"][0] < 0:
            continue
        key = (row["p"], row["src"][0])
        prev = last_src.get(key)
        if prev is not None and row["src"][1] <= prev[0]:
            disorder.append({"scored": (row["p"], row["o"]), "source": row["src"], "after_source_offset": prev[0]})
        last_src[key] = (row["src"][1], row["o"])
    r["order_violations"], r["order_examples"] = len(disorder), disorder[:EXAMPLES]
    dup = {src: at for src, at in by_source.items() if len(at) > 1}
    r["scored_twice"] = len(dup)
    r["scored_twice_examples"] = [{"rollouts": list(s), "scored": at} for s, at in list(dup.items())[:EXAMPLES]]
    r["rollout_records_repeated"] = sum(1 for row in data["rollouts"] if not row.get("bad")) - sum(
        len(v) for v in rollout_tids.values()
    )

    # lost, in-flight and stalled groups
    def waiting(tid: str, prompt: dict) -> bool:
        """Not yet read past by the stage that holds it (``in_flight_from``)."""
        role, (p, o) = (
            ("scored", first_copy[tid][:2]) if tid in first_copy
            else ("rollouts", rollout_at[tid]) if tid in rollout_at
            else ("prompts", (prompt["p"], prompt["o"]))
        )  # fmt: skip
        return o >= max(0, in_flight_from.get((topics[role], p), 0))

    lost, stalled, in_flight = [], [], []
    for g, row in sorted(fed.items()):
        if not 0 <= g < expected_groups:
            continue
        gid = row["group_id"]
        n = max(row["group_size"], published_size.get(gid, 0))
        missing = [i for i in range(n) if f"{gid}/{i}" not in accounted]
        flying = bool(missing) and in_flight_from is not None and all(waiting(f"{gid}/{i}", row) for i in missing)
        if flying:
            in_flight.append({"group_seq": g, "group_id": gid, "missing": missing})
        elif missing:
            lost.append(
                {
                    "group_seq": g,
                    "group_id": gid,
                    "missing": missing,
                    "in_a_step": gid in stepped_groups,
                    "scored": len(scored_tids[gid]),
                    "generated": len(rollout_tids[gid]),
                }
            )
        if scored_tids[gid] and gid not in stepped_groups and not flying:
            stalled.append({"group_seq": g, "group_id": gid, "scored": len(scored_tids[gid])})
    lost += [{"group_seq": g, "group_id": None, "missing": "never fed"} for g in r["never_fed"]]
    r["lost_groups"] = len(lost) + max(0, r["never_fed_count"] - len(r["never_fed"]))
    r["lost_examples"] = lost[:EXAMPLES]
    r["stalled_groups"], r["stalled_examples"] = len(stalled), stalled[:EXAMPLES]
    r["in_flight_groups"], r["in_flight_examples"] = len(in_flight), in_flight[:EXAMPLES]

    # staleness bound (a demonstration of a supervised stage has no policy version: exempt)
    demos = {row["tid"] for row in data["scored"] if row.get("demo")}
    viol = []
    for s in steps:
        cuts = s.get("token_masked") or {}
        for t in s["used"]:
            copy = first_copy.get(t)
            if copy is None or t in demos:
                continue
            oldest, cut = copy[2], cuts.get(t)
            if cut is not None:  # token rule: trained from index cut["from"]; its version from the record
                oldest = version_at(copy[3], copy[2], cut["from"])
            if s["version"] - oldest > k or (cut is not None and cut.get("oldest") != oldest):
                v = {"step": s["step"], "version": s["version"], "trajectory": t, "version_min": copy[2]}
                viol.append(v if cut is None else {**v, "trained_from": cut["from"], "oldest_trained": oldest,
                                                   "claimed_oldest": cut.get("oldest")})  # fmt: skip
    r["staleness_violations"], r["staleness_examples"] = len(viol), viol[:EXAMPLES]
    r["dropped_as_stale_but_fresh"] = sum(  # a loss disguised as staleness
        1 for s in steps for t in s["stale"] if t in first_copy and s["version"] - first_copy[t][2] <= k
    )
    lags = [int(d) for s in steps for d, n in s.get("staleness", {}).items() if n]
    r["max_lag_in_steps_log"] = max(lags, default=0)

    r.update(_dlq(data["dlq"], fuzz, fuzz_at, topics, scored_src, read_upto))
    return r


def _dlq(dlq: list[dict], fuzz: list[dict], fuzz_at: dict, topics: dict, scored_src: dict, read_upto=None) -> dict:
    """Match dead letters to the injected records; count them by error type, role and kind."""
    letters = [d for d in dlq if not d.get("bad")]
    copies = Counter(d["source"] for d in letters)
    found: dict[tuple, list[dict]] = defaultdict(list)
    real = []
    for d in letters:
        src = d["source"]
        if src not in fuzz_at and src[0] == topics["scored"] and (src[1], src[2]) in scored_src:
            sp, so = scored_src[(src[1], src[2])]  # a bad rollout, scored, then refused by the trainer
            src = (topics["rollouts"], sp, so)
        if src in fuzz_at:
            found[src].append(d)
        else:
            real.append(d)
    by_kind: dict[str, dict] = {}
    missing, unread = [], []
    for f in fuzz:
        kind = by_kind.setdefault(
            f"{f['topic']}/{f['kind']}",
            {"injected": 0, "in_dlq": 0, "unread": 0, "error_types": Counter(), "roles": Counter()},
        )
        if f.get("offset") is None:
            continue
        kind["injected"] += 1
        hits = found.get((topics[f["topic"]], f["partition"], f["offset"]), [])
        if hits:
            kind["in_dlq"] += 1
            kind["error_types"][hits[0]["error_type"]] += 1
            kind["roles"][hits[0]["role"]] += 1
        elif read_upto is not None and f["offset"] >= read_upto.get((topics[f["topic"]], f["partition"]), -1):
            kind["unread"] += 1
            unread.append({k: f[k] for k in ("topic", "kind", "partition", "offset")})
        else:
            missing.append({k: f[k] for k in ("topic", "kind", "partition", "offset")})
    return {
        "fuzz_injected": sum(1 for f in fuzz if f.get("offset") is not None),
        "fuzz_undelivered": sum(1 for f in fuzz if f.get("offset") is None),
        "fuzz_unread": len(unread),
        "fuzz_unread_examples": unread[:EXAMPLES],
        "dlq_missing": len(missing),
        "dlq_missing_examples": missing[:EXAMPLES],
        "dlq_records": len(dlq),
        "dlq_undecodable": len(dlq) - len(letters),
        "dlq_repeats": sum(n - 1 for n in copies.values()),
        "dlq_without_reason": sum(1 for d in letters if not d["error_type"] or not d["reason"]),
        "dlq_by_error_type": dict(Counter(d["error_type"] for d in letters)),
        "dlq_by_role": dict(Counter(d["role"] for d in letters)),
        "dlq_real_records": len(real),
        "dlq_real_examples": [{**d, "source": list(d["source"])} for d in real[:EXAMPLES]],
        "fuzz_by_kind": {
            k: {**v, "error_types": dict(v["error_types"]), "roles": dict(v["roles"])}
            for k, v in sorted(by_kind.items())
        },
    }


# ---- one job ---------------------------------------------------------------------------------
COUNTERS = {
    "lost": "fed groups lost",
    "trained_twice": "samples trained twice",
    "scored_twice": "rollouts scored twice",
    "staleness_violations": "samples trained past the staleness bound",
    "out_of_order": "rollouts scored out of order",
    "stalled": "scored groups that no step disposed of",
    "dlq_missing": "bad records not in the dead-letter topic",
    "dlq_without_reason": "dead letters without an error type or reason",
    "nonfinite_steps": "steps with a non-finite loss or grad norm",
    "fresh_dropped_as_stale": "fresh samples dropped as stale",
}
"""The verdict's counters (a violation each), in the line's order, with what each one says."""


def audit_job(cfg, timeout: float = 300.0) -> dict:
    """Audit the job of ``cfg`` (its topics, committed positions and steps log); the report."""
    from consumers.trainer.state import read_steps_log
    from pipeline.admin import has_topic
    from rlstream.lease import live_holder

    if not has_topic(cfg, cfg.topics.name("scored")):
        raise ConfigError(f"job {cfg.job.name}: no topic {cfg.topics.name('scored')} on this broker (has it run?)")
    running = live_holder(cfg) is not None
    positions = read_positions(cfg)  # before the topics and the steps log: see ``audit``'s in_flight_from
    data = read_topics(cfg, timeout)
    steps = read_steps_log(Path(cfg.trainer.checkpoint_dir or Path(cfg.run_dir) / "trainer"))
    topics = {r: cfg.topics.name(r) for r in TOPICS}
    fed = {r["group_seq"] for r in data["prompts"] if not r.get("bad") and r["feed"] == cfg.feed.name}
    bad = [{"topic": role, "kind": "undecodable", "partition": r["p"], "offset": r["o"]}
           for role in TOPICS for r in data[role] if r.get("bad")]  # fmt: skip
    a = audit(data, steps, bad, topics=topics, feed=cfg.feed.name, expected_groups=max(fed) + 1 if fed else 0,
              k=cfg.rl.max_staleness, read_upto=positions, in_flight_from=positions)  # fmt: skip
    return summary(cfg.job.name, a, running)


def summary(job: str, a: dict, running: bool = False) -> dict:
    """The verdict (PASS when every counter is 0), its counters and the one-line summary."""
    counts = {
        "lost": a["lost_groups"],
        "trained_twice": a["trained_twice"],
        "scored_twice": a["scored_twice"],
        "staleness_violations": a["staleness_violations"],
        "out_of_order": a["order_violations"],
        "stalled": a["stalled_groups"],
        "dlq_missing": a["dlq_missing"],
        "dlq_without_reason": a["dlq_without_reason"],
        "nonfinite_steps": a["nonfinite_steps"],
        "fresh_dropped_as_stale": a["dropped_as_stale_but_fresh"],
    }
    failed = [f"{COUNTERS[k]}: {n}" for k, n in counts.items() if n]
    verdict = "FAIL" if failed else "PASS"
    disposed = a["fed_groups"] - (a["lost_groups"] - a["never_fed_count"]) - a["in_flight_groups"]
    line = (
        f"audit {job}: {verdict} ({'running' if running else 'stopped'}) fed={a['fed_groups']} "
        f"disposed={max(0, disposed)} in_flight={a['in_flight_groups']} steps={a['steps']} "
        f"trained={a['samples_used']} dead_letters={a['dlq_records']} "
        + " ".join(f"{k}={n}" for k, n in counts.items())
        + (f" failed: {'; '.join(failed)}" if failed else "")
    )
    return {"job": job, "verdict": verdict, "running": running, "failed": failed, "counts": counts, "line": line,
            "audit": a}  # fmt: skip


def resolve(job: str, config: Path | None, sets: list[str], bootstrap: str | None):
    """The config of ``job``: a job file (resolved as ``rlstream run`` resolves it), else a job name
    on the broker (as ``rlstream jobs`` finds it); on the given or configured broker, else the
    running local one (none is started)."""
    from pipeline.log import setup_logging
    from rlstream.cli_common import load, quiet_clients, sources
    from rlstream.config import require_broker, resolve_bootstrap

    path = Path(job)
    if path.suffix == ".toml" or path.is_file():
        from rlstream.job import plan

        if not path.is_file():
            raise ConfigError(f"no job file {path}")
        cfg = plan(*sources(path, sets), bootstrap=bootstrap)[0]
        setup_logging(cfg.log_level)
        quiet_clients()
        resolve_bootstrap(cfg)
        require_broker(cfg)
        return cfg
    from rlstream.jobs import job_config

    extra = [f"kafka.bootstrap_servers={bootstrap}"] if bootstrap else []
    return job_config(load(config, [*sets, *extra]), job)[0]


def main(job: str, config: Path | None, sets: list[str], bootstrap: str | None, as_json: bool) -> int:
    """``rlstream audit``: print the line (``as_json``: the whole report); 1 on a violation, else 0."""
    report = audit_job(resolve(job, config, sets, bootstrap))
    print(json.dumps(report, default=list) if as_json else report["line"], flush=True)
    return 1 if report["failed"] else 0
