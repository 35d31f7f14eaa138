"""The audit of a fault run (``rlstream chaos``), beyond what ``rlstream audit`` checks: the
checks of the topics and the steps log (lost, scored or trained twice, order, staleness, the DLQ)
are ``rlstream.audit``'s, re-exported here (``read_topics``, ``read_positions``, ``audit``,
``version_at``); this module adds what only a fault run has.

``supervision`` reads the supervisor's event log (hangs, crashes, our kills), ``availability``
measures the training time under the faults, and ``verdict`` turns everything (with the planned
faults and the live auditor's counters) into PASS/FAIL and the one-line summary. Not a monitor of
a live run.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter

from rlstream.audit import EXAMPLES, audit, read_positions, read_topics, version_at  # noqa: F401 (re-exported)
from rlstream.dev import chaos_live


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


# ---- availability per fault class -------------------------------------------------------------
SETTLE_S = 30.0
"""How long after a fault ends (a kill -9: after it struck) its effects are still counted as its own:
a restart, a rebalance, a role noticing that its weights vanished."""
ROLE_NAME = re.compile(r"^(trainer|feed|rollout|reward|eval)[\w.-]*$")


def _pause(ends: list[float], a: float, b: float) -> float | None:
    """The trainer's longest time without a step end from ``a`` (the fault's start: a pause that
    began before it counts from there) through [a, b] to its first step end after ``b`` (None when
    the trainer took no step after ``b``)."""
    after = [t for t in ends if t > b][:1]
    if not after:
        return None
    marks = [a] + [t for t in ends if a < t <= b] + after
    gaps = [y - x for x, y in itertools.pairwise(marks)]
    return round(max(gaps), 1) if gaps else None


def fault_records(fault_done: list[dict], events: list[dict], broker_done: list[dict], t0: float | None) -> list[dict]:
    """Every fault of a run as ``{"kind", "target", "t", "seconds", "seen"}`` (``t``: seconds into the
    chaos phase that began at wall time ``t0``): the fault classes' ``done`` records, our kill -9s
    (from the supervisor's events) and the broker faults (``BrokerOps.done``)."""
    recs = [dict(d) for d in fault_done]
    if t0 is not None:
        recs += [
            {"kind": "kill", "target": e["name"], "t": round(e["time"] - t0, 1), "seconds": 0.0, "seen": []}
            for e in events
            if e["event"] == "signal"
            and e.get("signal") == "SIGKILL"
            and e.get("time")
            and "chaos" in (e.get("cause") or "")
        ]
    recs += [
        {"kind": "broker", "target": r.get("fault") or "restart", "t": r["t"], "seen": [],
         "seconds": round(sum(r.get(k) or 0.0 for k in ("stop_s", "down_s", "start_s")), 1)}
        for r in broker_done if r.get("ok")
    ]  # fmt: skip
    return sorted(recs, key=lambda r: r.get("t") or 0.0)


def by_fault_class(records: list[dict], steps: list[dict], said: list[dict], t0: float | None) -> list[dict]:
    """Availability per fault kind: ``n`` faults; ``roles_saw``, the roles that said a fault line on
    screen while one lasted (``said``: the launcher's fault log, ``{worker, text, start, end}``) or
    whose own lines the class recorded (``seen``); ``pause_s``, the trainer's longest time without a
    step from a fault's start to ``SETTLE_S`` after its end, and then to its next step (the worst of
    that kind); ``said``, the first fault line the user saw on screen for that kind (or None):
    a role's line from ``said`` (of the faulted role itself when the fault struck one role), else a
    line of the supervisor's that the class recorded (``supervisor: ...``, printed by the harness)."""
    ends = sorted(s["time"] for s in steps if s.get("time"))
    rows: dict[str, dict] = {}
    for r in records:
        row = rows.setdefault(r["kind"], {"kind": r["kind"], "n": 0, "roles_saw": set(), "pause_s": None, "said": None})
        row["n"] += 1
        if t0 is None or r.get("t") is None:
            continue
        a, b = t0 + r["t"], t0 + r["t"] + (r.get("seconds") or 0.0) + SETTLE_S
        pause = _pause(ends, a, b)
        if pause is not None:
            row["pause_s"] = max(row["pause_s"] or 0.0, pause)
        target = r.get("target") or ""
        for e in said:  # a fault of one role: that role's lines; of the store or the broker: anyone's
            role, _, worker = e["worker"].partition("/")
            if a - 2 <= e["start"] <= b and (not ROLE_NAME.match(target) or target in (role, worker)):
                row["roles_saw"].add(worker or role)
                row["said"] = row["said"] or f"{worker or role}: {e['text']}"
        for line in r.get("seen") or []:  # "<role>: ...", "<role>/<worker>: ..." or the target's own line
            who = str(line).partition(": ")[0]
            if "/" in who and " " not in who:
                row["roles_saw"].add(who.partition("/")[2])
            elif ROLE_NAME.match(who) or ROLE_NAME.match(who := target):
                row["roles_saw"].add(who)
            if str(line).startswith("supervisor: "):  # the supervisor's own line is on the run's screen too
                row["said"] = row["said"] or str(line)
    return [{**row, "roles_saw": sorted(row["roles_saw"])} for row in rows.values()]


def fault_class_line(row: dict) -> str:
    """One ``by_fault_class`` row as a progress line."""
    pause = "-" if row["pause_s"] is None else f"{row['pause_s']:g} s"
    return (
        f"{row['kind']}: n={row['n']} roles saw: {', '.join(row['roles_saw']) or 'none'}; longest pause {pause}; "
        f"on screen: {row['said'] or 'nothing'}"
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
