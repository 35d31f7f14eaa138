"""The report of a finished ``rlstream chaos`` run: the verdict (``rlstream.dev.chaos_audit``) with
the faults planned and done, the availability (overall and per fault class), what the roles said
on screen, and the files for people to read (``report.json``, the timeline picture, the docs block:
``rlstream.dev.chaos_docs``). Also the fingerprint of the code the roles run, taken at the start and
the end of a run (a run whose code changed under it is not valid).

Runs nothing and stops nothing: ``rlstream.dev.chaos`` runs the faults and calls ``write_report``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict
from pathlib import Path

from pipeline.log import kv
from rlstream.dev import chaos_audit, chaos_docs, chaos_live

log = logging.getLogger(__name__)


def code_fingerprint() -> dict[str, str]:
    """path -> hash of every module and schema the roles run. Processes restarted during the run
    load the code of that moment: if it changed (a shared working tree), the run is not valid."""
    root = Path(__file__).resolve().parents[2]
    return {
        str(f.relative_to(root)): hashlib.sha1(f.read_bytes()).hexdigest()
        for top in ("schemas", "pipeline", "producers", "consumers", "rlstream")
        for f in sorted((root / top).rglob("*"))
        if f.suffix in (".py", ".avsc") and f.is_file()
    }


def write_report(
    run_dir, opts, p, status, audits, chaos, injector, ops, bootstrap, wall_s, changed, steps, how
) -> dict:
    """The run's report (returned, and written to ``<run_dir>/report.json``), its timeline picture,
    the docs block with ``opts.docs``; the availability per fault class on stderr, the availability
    line and the verdict line on stdout."""
    audit, live = audits
    command, host = how
    live = live or chaos_live.not_run(status if status != "ok" else "the run ended before its audit")
    events = chaos.launcher.sup.events if chaos and chaos.launcher.sup else []
    sup = chaos_audit.supervision(events)
    wall = chaos.wall if chaos else {}
    hold = None  # the trainer waiting for the held-back groups is the harness's doing, not a fault's cost
    if wall.get("released") and chaos.held_from:
        dry = [s["time"] for s in steps if s.get("step", 0) == chaos.held_from and s.get("time")]
        if dry and dry[0] < wall["released"]:
            hold = (dry[0], wall["released"])
    avail = chaos_audit.availability(steps, events, wall.get("chaos"), wall.get("drain"), hold)
    done = chaos.done_counts(sup, audit["fuzz_injected"] if audit else 0)
    planned = {k: p[k] for k in ("kills", "trainer_kills", "feed_kills", "broker_restarts", "joins", "fuzz")}
    if p.get("worker_kills"):
        planned["worker_kills"] = p["worker_kills"]
    planned.update(chaos.class_counts(planned=True))
    said = chaos.launcher.progress.fault_log
    records = chaos_audit.fault_records(chaos.classes.done(), events, ops.done, wall.get("chaos"))
    per_class = chaos_audit.by_fault_class(records, steps, said, wall.get("chaos"))
    faults = {"planned": planned, "done": done}
    if audit is None:
        audit = {
            "lost_groups": -1,
            "trained_twice": -1,
            "scored_twice": -1,
            "staleness_violations": -1,
            "stalled_groups": -1,
            "dlq_missing": -1,
            "fuzz_undelivered": 0,
            "nonfinite_steps": -1,
            "dlq_without_reason": 0,
            "fuzz_injected": 0,
        }
    v = chaos_audit.verdict(audit, sup, faults, status, wall_s, live)
    if changed:
        v["verdict"] = "FAIL"
        v["failed"].append(f"the code changed during the run ({len(changed)} files, e.g. {', '.join(changed[:3])})")
    line = chaos_audit.verdict_line(v)
    report = {
        **v,
        "line": line,
        "availability_line": chaos_audit.availability_line(avail),
        "command": command,
        "machine": {**host, "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
        "wall": wall,
        "steps_timeline": chaos_docs.steps_series(steps),
        "status": status,
        "size": opts.size,
        "seed": opts.seed,
        "plan": p,
        "run_dir": str(run_dir),
        "bootstrap": bootstrap,
        "broker": (
            "--bootstrap: no broker restarts"
            if opts.bootstrap
            else f"own local KRaft cluster of {opts.nodes} nodes, hard faults"
            if opts.nodes > 1
            else "own local KRaft broker, restarted"
        ),
        "phases": chaos.phases,
        "faults": {
            **faults,
            "broker_restarts": ops.done,
            "timeline": [asdict(f) for f in chaos.faults],
            "records": records,
            "said_on_screen": said,
        },
        "by_fault_class": per_class,
        "supervision": sup,
        "availability": avail,
        "audit": audit,
        "live_audit": live,
        "code_changed_during_run": changed,
        "fuzz_records": injector.records if injector else [],
    }
    (run_dir / "report.json").write_text(json.dumps(report, indent=1, default=str))
    picture = chaos_docs.timeline(report, run_dir / "timeline.png")
    if opts.docs is not None:
        chaos_docs.publish(report, opts.docs, picture)
        log.info("docs updated %s", kv(page=opts.docs, block=f"chaos:{opts.size}", picture=picture))
    for row in per_class:
        chaos.say(chaos_audit.fault_class_line(row))
    print(report["availability_line"], flush=True)
    print(line, flush=True)
    return report
