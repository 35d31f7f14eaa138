"""The audit of a fault run (``rlstream chaos``): what the topics and the trainer's durable steps log
say happened, never what the workers counted or printed.

``read_topics`` reads rl.prompts, rl.rollouts, rl.scored and rl.dlq to their end (read_committed,
so aborted transactions do not count) and keeps the few fields the checks need. ``audit`` checks,
as pure functions of that data, the steps log (``consumers.trainer.state.read_steps_log``:
committed steps only) and the injected bad records:

* fed groups: distinct ``group_seq`` of the feed's Prompt records; every one of ``0..N-1`` must be
  there;
* lost: a fed group whose trajectory ids (``<group_id>/<i>``, i < group_size, or the larger
  ``group_size`` its rollouts were published with: a trained tail) are not all in
  what some step disposed of (``used``, ``stale``, ``incomplete_dropped``, ``update_skipped``,
  ``filtered``, ``overlong``); stalled: a fed group that reached rl.scored but no finished step;
* scored twice: two committed ScoredTrajectory records of one rl.rollouts (partition, offset);
* trained twice: a trajectory id in ``used`` more than once;
* staleness: a used sample whose step version minus the version of its oldest trained token
  exceeds k. That version is the ``version_min`` of the copy on rl.scored the trainer reads first
  (the lowest offset of its partition); under ``rl.staleness_rule = "token"``, for a sample
  the step lists in ``token_masked`` (its oldest tokens masked), it is the version of the first
  trained token (``from``), computed from that record's own ``metadata["versions"]`` marks, not
  taken from the trainer's ``oldest`` (a claim that disagrees with the record is a violation too);
* non-finite steps: a step whose loss or grad norm is NaN/inf;
* the DLQ: every injected record must be there (matched by source topic/partition/offset; a bad
  rollout that was scored and then refused by the trainer is matched through its scored copy),
  with an error type and a reason; repeats (at-least-once hops) are counted apart.

``supervision`` reads the supervisor's event log (hangs, crashes, our kills) and ``verdict`` turns
everything into PASS/FAIL and the one-line summary. Not a monitor of a live run.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict

from pipeline import codec
from pipeline.errors import DecodeError
from pipeline.records import VERSIONS_KEY, InvalidRecord, split_version_marks
from rlstream.dev import chaos_live

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
    with Consumer(client_conf(cfg, "chaos-audit", kind="consumer")) as c:
        for role, name in schema.items():
            rows = []
            for m in c.read_to_end(cfg.topics.name(role), timeout=timeout):
                row = {"p": m.partition(), "o": m.offset(), "h": chaos_live.digest(m.value())}
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
    admin = Admin(client_conf(cfg, "chaos-audit"), timeout)
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
) -> dict:
    """All checks; ``topics`` maps prompts/rollouts/scored to their full names, ``fuzz`` lists the
    injected records (``topic`` role, ``kind``, ``partition``, ``offset``); ``read_upto``
    (``read_positions``): a bad record at or past its group's committed offset was never read, and
    counts as unread, not as a missing dead letter (``None``: every bad record counts)."""
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

    # lost and stalled groups
    lost, stalled = [], []
    for g, row in sorted(fed.items()):
        if not 0 <= g < expected_groups:
            continue
        gid = row["group_id"]
        n = max(row["group_size"], published_size.get(gid, 0))
        missing = [i for i in range(n) if f"{gid}/{i}" not in accounted]
        if missing:
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
        if scored_tids[gid] and gid not in stepped_groups:
            stalled.append({"group_seq": g, "group_id": gid, "scored": len(scored_tids[gid])})
    lost += [{"group_seq": g, "group_id": None, "missing": "never fed"} for g in r["never_fed"]]
    r["lost_groups"] = len(lost) + max(0, r["never_fed_count"] - len(r["never_fed"]))
    r["lost_examples"] = lost[:EXAMPLES]
    r["stalled_groups"], r["stalled_examples"] = len(stalled), stalled[:EXAMPLES]

    # staleness bound
    viol = []
    for s in steps:
        cuts = s.get("token_masked") or {}
        for t in s["used"]:
            copy = first_copy.get(t)
            if copy is None:
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


# ---- the supervisor's event log --------------------------------------------------------------
def role_of(name: str) -> str:
    """``rollout-x1`` -> ``rollout``."""
    return name.split("-")[0]


def stuck_in(log_tail: str | None, frames: int = 4) -> list[str]:
    """From a watchdog's stack dump (faulthandler format) in a log tail: the innermost frames of the
    thread that runs the worker loop (the one whose stack passes through ``pipeline/worker.py``'s
    ``run``), as ``file:line function``."""
    blocks, cur = [], None
    for line in (log_tail or "").splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            cur = []
            blocks.append(cur)
        elif cur is not None and line.startswith('  File "'):
            path, _, rest = line.strip()[6:].partition('", line ')
            num, _, func = rest.partition(" in ")
            cur.append(f"{'/'.join(path.split('/')[-2:])}:{num} {func}")
        else:
            cur = None
    for b in blocks:
        if any(f.startswith("pipeline/worker.py") and f.endswith(" run") for f in b):
            return b[:frames]
    return []


def supervision(events: list[dict]) -> dict:
    """Our kills, and the hangs and crashes the run had (each with the end of that role's log)."""
    kills = Counter(role_of(e["name"]) for e in events if e["event"] == "signal" and e.get("signal") == "SIGKILL")
    hangs, crashes, unclean = [], [], []
    for e in events:
        brief = {k: e.get(k) for k in ("t", "name", "pid", "code", "cause", "why", "event", "log_tail")}
        if e["event"] == "stop_timeout":
            hangs.append({**brief, "kind": "ignored SIGTERM (killed after the stop timeout)"})
        elif e["event"] in ("exit", "stopped") and (e.get("cause") == "hung" or e.get("code") == 75):
            kind = "declared hung by the launcher" if e.get("why") else "own watchdog (exit 75)"
            hangs.append({**brief, "kind": kind, "stuck_in": stuck_in(e.get("log_tail"))})
        elif e["event"] == "exit" and e.get("cause") in ("crash", "exited"):
            crashes.append(brief)
        elif e["event"] == "stopped" and e.get("code") not in (0, None):
            unclean.append(brief)
    return {
        "kills": dict(kills),
        "kills_total": sum(kills.values()),
        "restarts": sum(1 for e in events if e["event"] == "restart"),
        "hangs": hangs,
        "crashes": crashes,
        "unclean_stops": unclean,
        "crash_loops": [e for e in events if e["event"] == "crash_loop"],
    }


# ---- availability ----------------------------------------------------------------------------
IDLE_WINDOW_S = 120.0
"""How long after a rollout-worker kill the trainer's longest idle gap is looked for."""


def _outside(a: float, b: float, hold: tuple[float, float] | None) -> float:
    """Seconds of [a, b] outside ``hold``."""
    inside = max(0.0, min(b, hold[1]) - max(a, hold[0])) if hold else 0.0
    return b - a - inside


def availability(
    steps: list[dict],
    events: list[dict],
    t_start: float | None,
    t_end: float | None,
    hold: tuple[float, float] | None = None,
) -> dict:
    """Availability under the faults, from the steps log (each step's end ``time`` and its
    ``step_time_s`` in the optimizer) and the supervisor's events (wall ``time`` of each kill -9),
    over the chaos phase [``t_start``, ``t_end``] (wall seconds; ``t_end`` None: the last step):

    * ``ettr``: effective training time ratio, time in optimizer steps / wall time;
    * ``trainer_kill_to_step_s``: from each kill -9 of the trainer to the end of its next step;
    * ``rollout_kill_trainer_idle_s``: per kill -9 of a rollout worker, the longest gap between two
      step ends that overlaps the ``IDLE_WINDOW_S`` after it (the trainer's idle time, with the step);
    * ``kills_per_min``: the kill rate those figures were measured at.

    ``hold`` (wall seconds): a time the trainer waited for the harness itself (the chaos feed's
    held-back groups), taken out of every figure."""
    done = sorted((s["time"], s.get("step_time_s") or 0.0) for s in steps if s.get("time"))
    if t_start is None or not done:
        return {"ettr": None, "trainer_kill_to_step_s": [], "rollout_kill_trainer_idle_s": [], "kills_per_min": None}
    end = t_end if t_end is not None else done[-1][0]
    inside = [(t, d) for t, d in done if t_start < t <= end]
    wall = max(1e-9, _outside(t_start, end, hold))
    kills = [e for e in events if e["event"] == "signal" and e.get("signal") == "SIGKILL" and e.get("time")]
    ends = [t for t, _ in done]

    def next_step(after: float) -> float | None:
        return next((t for t in ends if t > after), None)

    trainer = [
        round(_outside(e["time"], n, hold), 1)
        for e in kills
        if role_of(e["name"]) == "trainer" and (n := next_step(e["time"]))
    ]
    idle = []
    for e in kills:
        if role_of(e["name"]) != "rollout":
            continue
        k = e["time"]  # the step ends around the window: the last before the kill, those in it, the first after it
        before = [t for t in ends if t <= k][-1:]
        after = [t for t in ends if t > k + IDLE_WINDOW_S][:1]
        marks = before + [t for t in ends if k < t <= k + IDLE_WINDOW_S] + after
        gaps = [_outside(a, b, hold) for a, b in itertools.pairwise(marks)]
        if gaps:
            idle.append(round(max(gaps), 1))
    in_phase = [e for e in kills if t_start <= e["time"] <= end]
    return {
        "ettr": round(sum(d for _, d in inside) / wall, 3),
        "trainer_kill_to_step_s": trainer,
        "rollout_kill_trainer_idle_s": idle,
        "kills_per_min": round(len(in_phase) / (wall / 60), 2),
        "window_s": round(wall, 1),
    }


def availability_line(a: dict) -> str:
    if a.get("ettr") is None:
        return "availability: no steps in the chaos phase"
    most = lambda xs: f"{max(xs):.1f}s" if xs else "-"  # noqa: E731
    return (
        f"availability: ettr={a['ettr']:.3f} at {a['kills_per_min']} kills/min over {a['window_s']:.0f}s; "
        f"trainer kill -> next step max {most(a['trainer_kill_to_step_s'])} (n={len(a['trainer_kill_to_step_s'])}); "
        f"rollout kill -> longest trainer idle max {most(a['rollout_kill_trainer_idle_s'])} "
        f"(n={len(a['rollout_kill_trainer_idle_s'])})"
    )


# ---- verdict ---------------------------------------------------------------------------------
COUNTERS = (
    "lost",
    "trained_twice",
    "scored_twice",
    "staleness_violations",
    "out_of_order",
    "stalled",
    "hangs",
    "crashes",
    "unclean_stops",
    "dlq_missing",
    "nonfinite_steps",
)
"""The verdict's own counters, in the line's order (the live auditor's, ``chaos_live.COUNTERS``, follow)."""


def verdict(a: dict, sup: dict, faults: dict, status: str, wall_s: float, live: dict | None = None) -> dict:
    """PASS when the drain finished and every counter is 0 and the planned faults happened.
    ``live``: the concurrent auditor's ``chaos_live.check`` (its counters join the others)."""
    counts = {
        "lost": a["lost_groups"],
        "trained_twice": a["trained_twice"],
        "scored_twice": a["scored_twice"],
        "staleness_violations": a["staleness_violations"],
        "out_of_order": a.get("order_violations", 0),
        "stalled": a["stalled_groups"],
        "hangs": len(sup["hangs"]),
        "crashes": len(sup["crashes"]) + len(sup["crash_loops"]),
        "unclean_stops": len(sup["unclean_stops"]),  # a non-zero exit after our SIGTERM
        "dlq_missing": a["dlq_missing"] + a["fuzz_undelivered"],
        "nonfinite_steps": a["nonfinite_steps"],
        **(live["counts"] if live else {}),
    }
    failed = [k for k in counts if counts[k]] + (live["failed"] if live else [])
    if status != "ok":
        failed.insert(0, f"run {status}")
    failed += [
        f"planned {k} not done ({faults['done'][k]}/{n})" for k, n in faults["planned"].items() if faults["done"][k] < n
    ]
    if a["dlq_without_reason"]:
        failed.append("dead letters without a reason")
    if a.get("dropped_as_stale_but_fresh"):
        failed.append(f"{a['dropped_as_stale_but_fresh']} fresh samples dropped as stale")
    return {
        "verdict": "FAIL" if failed else "PASS",
        "failed": failed,
        "counts": counts,
        "wall_s": round(wall_s, 1),
        "kills": sup["kills"],
        "broker_restarts": faults["done"].get("broker_restarts", 0),
        "joins": faults["done"].get("joins", 0),
        "fuzzed": a["fuzz_injected"],
        "fuzz_unread": a.get("fuzz_unread", 0),
        "live": chaos_live.figures(live) if live else None,
    }


def verdict_line(v: dict) -> str:
    kills = ", ".join(f"{r} {n}" for r, n in sorted(v["kills"].items(), key=lambda x: -x[1]))
    line = (
        f"chaos: {v['verdict']} kills={sum(v['kills'].values())} ({kills or 'none'}) "
        f"broker_restarts={v['broker_restarts']} joins={v['joins']} fuzzed={v['fuzzed']} "
        + (f"fuzz_unread_at_end={v['fuzz_unread']} " if v.get("fuzz_unread") else "")
        + " ".join(f"{k}={n}" for k, n in v["counts"].items())
        + (f" {v['live']}" if v.get("live") else "")
        + f" wall={v['wall_s']:.0f}s"
    )
    return line + (f" failed: {'; '.join(v['failed'])}" if v["failed"] else "")
