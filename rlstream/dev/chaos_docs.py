"""What ``rlstream chaos`` leaves for people to read: the timeline picture of a run (the trainer's
steps and samples trained over wall time, with a marker per injected fault) and, with ``--docs``,
the run's generated block of a results page (``<!-- chaos:<size> -->`` … ``<!-- /chaos:<size> -->``):
the command that reproduces it, git revision, date, machine, load, and the audit's figures.

Reads only a finished run's report (``report.json``, ``rlstream.dev.chaos_report.write_report``); runs nothing
and judges nothing (the verdict is ``rlstream.dev.chaos_audit``'s). The block and picture writers
are the benchmarks' (``rlstream.dev.bench.harness``: ``update_docs``, ``machine``, ``pyplot``).
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
from pathlib import Path

from rlstream.dev.bench.harness import REPO, img_dir_of, machine, md_table, pyplot, save_figure, update_docs

log = logging.getLogger(__name__)

DEFAULTS = {"seed": 0, "drain_s": 600.0}
OPTIONS = (  # ChaosOptions field -> its option on the command line (the values that change a run)
    ("seed", "--seed"), ("bootstrap", "--bootstrap"), ("groups", "--groups"), ("duration_s", "--duration"),
    ("kills", "--kills"), ("trainer_kills", "--trainer-kills"), ("feed_kills", "--feed-kills"),
    ("broker_restarts", "--broker-restarts"), ("joins", "--joins"), ("fuzz", "--fuzz"),
    ("drain_s", "--drain-timeout"), ("partitions", "--partitions"), ("net_latency", "--net-latency"), ("net_resets", "--net-resets"),
    ("storage_faults", "--storage-faults"), ("stops", "--stops"), ("ooms", "--ooms"),
)  # fmt: skip
SWITCHES = (("unpaced", "--unpaced"), ("standby", "--standby"), ("rollout_standby", "--rollout-standby"))
KIND_STYLE = {  # kind -> (colour, label in the legend)
    "kill": ("tab:red", "kill -9"),
    "broker": ("tab:purple", "broker down"),
    "join": ("tab:green", "worker added"),
    "leave": ("tab:olive", "worker removed"),
    "fuzz": ("tab:gray", "bad records written"),
    "partition": ("tab:brown", "network partition"),
    "latency": ("tab:pink", "network latency"),
    "reset": ("tab:brown", "connections reset"),
    "disk_full": ("tab:cyan", "disk full"),
    "store_slow": ("tab:cyan", "store slow, then failing"),
    "weights_vanish": ("tab:blue", "weights deleted"),
    "stop": ("gold", "SIGSTOP"),
    "oom": ("darkred", "OOM kill"),
}
SPANNED = ("broker", "partition", "latency", "disk_full", "store_slow", "stop")
"""The kinds drawn as a band over the time they lasted (the others as a line at their start)."""


def command_line(opts, config_path: Path | None = None, sets: list[str] | None = None) -> str:
    """The ``rlstream chaos`` command that runs the same plan (``--out``, ``--docs`` and
    ``--keep-data`` left out: they change where things go, not what happens)."""
    words = ["rlstream", "chaos", "--size", opts.size]
    for field, flag in OPTIONS:
        v = getattr(opts, field)
        if v is not None and (v != DEFAULTS.get(field) or field == "seed"):
            words += [flag, f"{v:g}" if isinstance(v, float) else str(v)]
    size_nodes = 1 if opts.bootstrap else {"scale": 3}.get(opts.size, 1)
    if opts.nodes is not None and opts.nodes != size_nodes:
        words += ["--nodes", str(opts.nodes)]
    words += [flag for field, flag in SWITCHES if getattr(opts, field)]
    if config_path is not None:
        words += ["--config", str(config_path)]
    for s in sets or []:
        words += ["--set", s]
    return shlex.join(words)


def machine_info() -> dict:
    """``harness.machine()`` with whether the working tree differs from that revision (``git_dirty``)."""
    m = machine()
    changed = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True
    )
    m["git_dirty"] = bool(changed.stdout.strip()) if changed.returncode == 0 else None
    return m


def steps_series(steps: list[dict]) -> list[list]:
    """``[wall time, step, samples trained in it]`` per line of the trainer's steps log, in order
    (a step redone after a trainer kill appears again, at the time it was redone)."""
    return [[s["time"], s["step"], len(s.get("used") or [])] for s in steps if s.get("time") is not None]


def _fault_marks(report: dict) -> list[tuple[float, str, str, float]]:
    """(seconds into the chaos phase, kind, label, seconds it lasted) of every fault that happened."""
    marks = []
    broker = {r.get("t"): r for r in report.get("faults", {}).get("broker_restarts", [])}
    lasted = {(r["kind"], r.get("t")): r.get("seconds") or 0.0 for r in report.get("faults", {}).get("records", [])}
    for f in report.get("faults", {}).get("timeline", []):
        out = f.get("outcome") or ""
        if f.get("t_done") is None or not out or out.startswith("skipped"):
            continue
        kind, label, span = f["kind"], "", 0.0
        if kind == "kill":
            label = out.split(" (pid")[0].removeprefix("kill -9 ")
        elif kind == "broker":
            rec = broker.get(f["t_done"], {})
            span = sum(rec.get(k) or 0.0 for k in ("stop_s", "down_s", "start_s")) or f.get("arg") or 0.0
            label = f"broker {f.get('target') or 'restart'}"
        elif kind in ("join", "leave"):
            label = f.get("target", "")
        elif kind == "fuzz":
            label = out.split()[0]
        elif kind in KIND_STYLE:  # a fault class's: how long it lasted is in its record
            label, span = f.get("target", ""), lasted.get((kind, f["t_done"]), 0.0)
        marks.append((float(f["t_done"]), kind, label, float(span)))
    return marks


def timeline(report: dict, path: Path) -> Path | None:
    """Draw the run's timeline to ``path`` (PNG): the trainer's step and the samples trained so far
    over the seconds since the chaos phase began, a line per fault (coloured by kind, labelled with
    the role killed) and a band per broker outage. None when matplotlib is missing or the run has
    no chaos phase."""
    plt = pyplot()
    t0 = (report.get("wall") or {}).get("chaos")
    if plt is None:
        log.warning("matplotlib not installed; no timeline picture (pip install 'rlstream[plots]')")
        return None
    if t0 is None:
        return None
    series = report.get("steps_timeline") or []
    latest: dict[int, int] = {}
    xs, ys, cum = [], [], []
    for t, step, n in series:
        latest[step] = n  # a redone step replaces the one lost with the kill
        xs.append(t - t0)
        ys.append(step)
        cum.append(sum(latest.values()))
    fig, ax = plt.subplots(figsize=(10, 4.8))
    ax.plot(xs, ys, drawstyle="steps-post", color="tab:blue", label="trainer step")
    ax.set_xlabel("seconds since the chaos phase began")
    ax.set_ylabel("trainer step", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(xs, cum, color="tab:orange", alpha=0.7, label="samples trained")
    ax2.set_ylabel("samples trained", color="tab:orange")
    seen = set()
    top = max(ys, default=1)
    for t, kind, label, span in _fault_marks(report):
        colour, name = KIND_STYLE.get(kind, ("black", kind))
        legend = None if kind in seen else name
        seen.add(kind)
        if kind in SPANNED and span:
            ax.axvspan(t, t + max(span, 1.0), color=colour, alpha=0.15, label=legend)
        else:
            ax.axvline(t, color=colour, lw=1, alpha=0.8, ls="-" if kind == "kill" else ":", label=legend)
        if kind not in ("join", "leave", "fuzz") and label:
            ax.text(t, top, f" {label}", rotation=90, va="top", ha="left", fontsize=7, color=colour)
    drain = (report.get("wall") or {}).get("drain")
    if drain is not None:
        ax.axvline(drain - t0, color="black", ls="--", lw=1, label="drain (no more faults)")
    lines = ax.get_legend_handles_labels()
    more = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="lower right", fontsize=8)
    ax.set_title(f"rlstream chaos --size {report.get('size')}: {report.get('verdict')}")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path)
    return path


def _join(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items(), key=lambda x: (-x[1], x[0]))) or "none"


def _seconds(xs: list) -> str:
    return ", ".join(f"{x:g}" for x in xs) if xs else "–"


def block(report: dict, image: str | None = None, command: str | None = None) -> str:
    """The markdown of a run's docs block: how it was made (``command``: the one that wrote it,
    default the report's), then the figures, no prose."""
    m = report.get("machine") or {}
    cpu = f"{m.get('cpus')} CPUs" + (f", {m['cpu_model']}" if m.get("cpu_model") else "")
    cpu += f" (flags: {' '.join(m['cpu_flags'])})" if m.get("cpu_flags") else ""
    load = f"{_load(m.get('loadavg_at_start'))} at the start, {_load(m.get('loadavg_at_end'))} at the end"
    head = [
        f"_Generated by `{command or report.get('command')}`._",
        "",
        f"- git revision: {m.get('git')}" + (" with uncommitted changes" if m.get("git_dirty") else ""),
        f"- date: {m.get('time')}",
        f"- machine: {cpu}",
        f"- load average (1, 5, 15 min): {load}",
        f"- wall: {report.get('wall_s')} s; verdict: **{report.get('verdict')}**"
        + (f" ({'; '.join(report['failed'])})" if report.get("failed") else ""),
    ]
    counts = report.get("counts") or {}
    audit = report.get("audit") or {}
    sup = report.get("supervision") or {}
    faults = report.get("faults") or {}
    planned, done = faults.get("planned") or {}, faults.get("done") or {}
    series = report.get("steps_timeline") or []
    guarantees = md_table(["audit", "count"], [[k.replace("_", " "), v] for k, v in counts.items()])
    injected = md_table(
        ["fault", "planned", "done"],
        [[k.replace("_", " "), planned[k], done.get(k)] for k in planned]
        + [
            ["kill -9 by role", "", _join(report.get("kills") or {})],
            ["restarts by the supervisor", "", sup.get("restarts")],
        ],
    )
    dlq = md_table(
        ["dead letters", "value"],
        [
            ["bad records injected", audit.get("fuzz_injected")],
            ["records on rl.dlq", audit.get("dlq_records")],
            ["by error type", _join(audit.get("dlq_by_error_type") or {})],
            ["by role", _join(audit.get("dlq_by_role") or {})],
            ["without a reason", audit.get("dlq_without_reason")],
            ["repeats", audit.get("dlq_repeats")],
            ["of real records", audit.get("dlq_real_records")],
            ["bad records never read (written after a stage's last read)", audit.get("fuzz_unread")],
        ],
    )
    a = report.get("availability") or {}
    avail = md_table(
        ["availability", "value"],
        [
            ["ETTR (optimizer seconds / wall seconds)", a.get("ettr")],
            ["kills per minute", a.get("kills_per_min")],
            ["window (s)", a.get("window_s")],
            ["trainer kill -> next step (s)", _seconds(a.get("trainer_kill_to_step_s") or [])],
            ["rollout kill -> longest trainer idle (s)", _seconds(a.get("rollout_kill_trainer_idle_s") or [])],
            ["steps logged (redone ones included)", len(series)],
            ["samples trained", sum({s: n for _, s, n in series}.values()) if series else None],
        ],
    )
    lines = ["```text", report.get("availability_line", ""), report.get("line", ""), "```"]
    parts = ["\n".join(head), guarantees, injected, dlq, avail]
    if report.get("by_fault_class"):
        parts.append(by_fault_class(report["by_fault_class"]))
    parts.append("\n".join(x for x in lines if x is not None))
    if image:
        parts.append(f"![timeline of the {report.get('size')} fault run]({image})")
    return "\n\n".join(parts)


def by_fault_class(rows: list[dict]) -> str:
    """The availability per fault class table (``chaos_audit.by_fault_class``)."""
    cell = lambda text: (text or "–").replace("|", "\\|").replace("\n", " ")[:160]  # noqa: E731
    return md_table(
        ["fault class", "n", "roles saw", "longest pause (s)", "said on screen"],
        [[r["kind"], r["n"], ", ".join(r["roles_saw"]) or "–", r["pause_s"], cell(r["said"])] for r in rows],
    )


def _load(xs) -> str:
    return " / ".join(f"{x:g}" for x in xs) if xs else "–"


def publish(report: dict, docs: Path, picture: Path | None) -> None:
    """Regenerate the ``<!-- chaos:<size> -->`` block of ``docs`` from ``report``, and copy the
    timeline picture to ``<docs img>/chaos-<size>-timeline.png``, linked from the block."""
    docs = Path(docs)
    size = report.get("size")
    img_dir, link = img_dir_of(docs), None
    if picture is not None:
        img_dir.mkdir(parents=True, exist_ok=True)
        target = img_dir / f"chaos-{size}-timeline.png"
        shutil.copyfile(picture, target)
        link = os.path.relpath(target, docs.parent)
    page = docs.resolve()  # named from the root of the repository that holds it
    root = next((d for d in page.parents if (d / ".git").exists()), None)
    named = page.relative_to(root) if root is not None else docs
    command = f"{report.get('command')} --docs {shlex.quote(str(named))}"
    update_docs(docs, str(size), block(report, link, command), [], marker="chaos", img_dir=img_dir)
