"""Where a run's CPU and its broker's work go, for ``rlstream bench peer``'s cold arm.

* ``ProcessCPU``: CPU seconds per process of a run (the ``rlstream run`` process, every process
  under it, and the broker), read from ``/proc`` every ``period`` seconds while the run lasts; each
  process is named from the run's ``events.jsonl`` (``launcher``, ``forkserver``, ``trainer``,
  ``rollout-0``, ...). A process's last ``period`` before it exits is not seen.
* ``broker_requests``: requests the broker answered, by type (Kafka's own request counters, read
  over JMX with Kafka's ``JmxTool``), so a step's broker work can be told apart: fetches, produces,
  the requests of a transaction, offset commits, metadata.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import threading
from collections import Counter
from pathlib import Path

from rlstream.dev.bench.harness import cpu_seconds

JMX_OBJECT = "kafka.network:type=RequestMetrics,name=RequestsPerSec,request=*,version=*"


def jmx_options(port: int) -> list[str]:
    """Java options that open the broker's JMX port on loopback (no authentication: local only)."""
    return [
        f"-Dcom.sun.management.jmxremote.port={port}",
        f"-Dcom.sun.management.jmxremote.rmi.port={port}",
        "-Dcom.sun.management.jmxremote.authenticate=false",
        "-Dcom.sun.management.jmxremote.ssl=false",
        "-Dcom.sun.management.jmxremote.host=127.0.0.1",
        "-Djava.rmi.server.hostname=127.0.0.1",
    ]


def broker_requests(port: int, timeout_s: float = 60.0) -> dict[str, int]:
    """Requests the broker listening for JMX on ``port`` has answered since it started, by type
    (every API version summed); empty if it cannot be read."""
    from rlstream.kafka_jars import classpath

    cmd = ["java", "-cp", classpath(lambda _msg: None), "org.apache.kafka.tools.JmxTool",
           "--jmx-url", f"service:jmx:rmi:///jndi/rmi://127.0.0.1:{port}/jmxrmi", "--object-name", JMX_OBJECT,
           "--attributes", "Count", "--one-time", "true", "--report-format", "properties"]  # fmt: skip
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    counts: Counter[str] = Counter()
    for m in re.finditer(r"request=(\w+),version=\d+:Count=(\d+)", out):
        counts[m.group(1)] += int(m.group(2))
    return dict(counts.most_common())


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = set(), [root]
    while todo:
        kids = [c for c in children.get(todo.pop(), ()) if c not in out]
        out.update(kids)
        todo.extend(kids)
    return out


class ProcessCPU:
    """Samples the CPU of process ``root``, its descendants and ``others`` (name -> pid, counted
    from the start of sampling) until ``stop()``."""

    def __init__(self, root: int, others: dict[str, int], period: float = 0.2):
        self.root, self.period = root, period
        self.base = {pid: cpu_seconds(pid) or 0.0 for pid in others.values()}
        self.names = {pid: name for name, pid in others.items()}
        self.cpu: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="process-cpu", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        for pid in {self.root, *_descendants(self.root), *self.base}:
            got = cpu_seconds(pid)
            if got is not None:
                self.cpu[pid] = got - self.base.get(pid, 0.0)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def stop(self) -> None:
        self._sample()
        self._stop.set()
        self._thread.join()

    def by_name(self, events: Path) -> dict[str, float]:
        """CPU seconds per process name (``events``: the run's events.jsonl; the root is
        ``launcher``; a role restarted is summed; a process not named there is ``other``)."""
        names = {self.root: "launcher", **self.names}
        if events.is_file():
            for line in events.read_text().splitlines():
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if ev.get("pid") and ev.get("event") in ("start", "fork_server"):
                    names[int(ev["pid"])] = ev.get("name") or "other"
        out: Counter[str] = Counter()
        for pid, cpu in self.cpu.items():
            out[names.get(pid, "other")] += cpu
        return {k: round(v, 2) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


KINDS = {
    "fetch": ("Fetch",),
    "produce": ("Produce",),
    "transaction": ("AddPartitionsToTxn", "AddPartitionsToTxnVerification", "AddOffsetsToTxn", "TxnOffsetCommit",
                    "EndTxn", "WriteTxnMarkers", "InitProducerId"),
    "offsets": ("OffsetCommit", "OffsetFetch", "ListOffsets"),
}  # fmt: skip
"""Request types grouped by what they do; every other type is ``group and metadata``
(``FetchConsumer``/``FetchFollower`` are sub-counts of ``Fetch`` and left out)."""
SUBCOUNTS = ("FetchConsumer", "FetchFollower")


def kind_of(request: str) -> str:
    return next((k for k, names in KINDS.items() if request in names), "group and metadata")


def table(runs: list[dict], steps: int, trl_cpu_s: float | None) -> str:
    """Markdown: the median CPU seconds of each process of ``runs`` (the cold arm's), per run and
    per step, beside TRL's whole run; then the broker's requests per step by kind and by type."""
    from rlstream.dev.bench.harness import md_table

    runs = [r for r in runs if r.get("cpu_by_process")]
    if not runs:
        return ""
    procs = list(dict.fromkeys(p for r in runs for p in r["cpu_by_process"]))
    rows = []
    for p in procs:
        cpu = statistics.median([r["cpu_by_process"].get(p, 0.0) for r in runs])
        rows.append([p, f"{cpu:.1f}", f"{1000 * cpu / steps:.0f}"])
    total = statistics.median([sum(r["cpu_by_process"].values()) for r in runs])
    rows.append(["**all**", f"**{total:.1f}**", f"**{1000 * total / steps:.0f}**"])
    if trl_cpu_s:
        rows.append(["TRL (one process, whole run)", f"{trl_cpu_s:.1f}", f"{1000 * trl_cpu_s / steps:.0f}"])
    out = md_table(["process (cold arm, median of runs)", "CPU s per run", "CPU ms per step"], rows)
    reqs = [r["broker_requests"] for r in runs if r.get("broker_requests")]
    if reqs:
        per = {
            t: statistics.median([q.get(t, 0) / steps for q in reqs]) for t in dict.fromkeys(t for q in reqs for t in q)
        }
        per = {t: v for t, v in per.items() if t not in SUBCOUNTS}
        kinds: dict[str, float] = {}
        for t, v in per.items():
            kinds[kind_of(t)] = kinds.get(kind_of(t), 0.0) + v
        total = sum(per.values())
        rows = [[k, f"{v:.1f}", ", ".join(f"{t} {per[t]:.1f}" for t in sorted(per, key=lambda t: -per[t])
                                          if kind_of(t) == k and per[t] >= 0.05)]
                for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])]  # fmt: skip
        rows.append(["**all**", f"**{total:.1f}**", ""])
        out += "\n\n" + md_table(["broker requests (cold arm, median per step)", "per step", "by type"], rows)
    return out
