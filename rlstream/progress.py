"""What a run looks like while it runs: ``Progress`` folds rl.metrics events into the trainer's step
log and each worker's newest event; ``render`` draws the live view. Read-only; no Kafka here.

A step that trained no sample (every one was stale) has no reward: its ``reward_mean`` is None in
the step log (null in report.json), left out of every mean and curve, never drawn as 0.0.
"""

from __future__ import annotations

from pipeline.records import lag_counts, step_samples


def mean_reward(steps: list[dict]) -> float | None:
    """Mean ``reward_mean`` of the steps that trained something (None if none did)."""
    rewards = [s["reward_mean"] for s in steps if s["reward_mean"] is not None]
    return sum(rewards) / len(rewards) if rewards else None


GAP_METRICS = {"reward": "commit_gap_s_max", "rollout": "produce_gap_s_max"}
"""Per stage, the MetricEvent field that holds its longest gap in the last window."""
TOOL_FIGURES = ("tool_call_rate", "tool_call_success", "malformed_call_rate", "turns_mean")
"""The eval figures of held-out episodes in an environment (``consumers.eval.episodes``), less ``eval_``."""


class Progress:
    """Folds rl.metrics into what the live view and the report need."""

    def __init__(self):
        self.steps: list[dict] = []
        self.workers: dict[str, dict] = {}
        self.evals: dict[int, dict] = {}
        """version -> {reward_mean, pass_at_1, answers} from ``rlstream eval``."""
        self.final_eval: int | None = None
        """The newest version ``rlstream eval`` evaluated as a run's final one (``eval_final``)."""
        self.pause_s = {"reward": 0.0, "rollout": 0.0}
        """Per stage, the longest gap reported after the first step: between two commits of one
        reward worker (``commit_gap_s``), between two trajectories of one rollout worker
        (``produce_gap_s``)."""
        self.faults: dict[str, dict] = {}
        """worker key -> the fault it says it waits on now (``labels["fault"]``, ``WorkerMetrics.set_fault``)."""
        self.fault_log: list[dict] = []
        """Every fault a worker said, ended or not: {worker, text, start, end} (report.json ``faults``)."""
        self.to_say: list[tuple[str, str]] = []
        """(worker key, line) for the live view to print: a fault that began, changed or ended."""

    def add(self, ev: dict) -> None:
        key = f"{ev['role']}/{ev['worker_id']}"
        self.workers[key] = ev
        self._fold_fault(key, (ev.get("labels") or {}).get("fault"), ev["timestamp_ms"] / 1000)
        m = ev["metrics"]
        if ev["role"] == "eval" and "eval_reward_mean" in m:
            self.evals[ev["version"]] = {
                "reward_mean": m["eval_reward_mean"], "pass_at_1": m.get("eval_pass_at_1"), "answers": m.get("eval_answers")
            }  # fmt: skip
            if "eval_tool_call_rate" in m:  # held-out episodes in an environment: the tool-use figures
                self.evals[ev["version"]]["tools"] = [m.get(f"eval_{k}") for k in TOOL_FIGURES]
            if m.get("eval_final"):
                self.final_eval = max(ev["version"], self.final_eval or 0)
        gap = GAP_METRICS.get(ev["role"])
        if gap in m and self.steps and ev["timestamp_ms"] / 1000 > self.steps[0]["time"]:
            self.pause_s[ev["role"]] = max(self.pause_s[ev["role"]], float(m[gap]))
        if ev["role"] == "trainer" and "step" in m and "reward_mean" in m:
            step = int(m["step"])
            if self.steps and self.steps[-1]["step"] >= step:
                return  # periodic event repeating the last step's gauges
            t = ev["timestamp_ms"] / 1000
            samples = step_samples(m)
            prev_t = self.steps[-1]["time"] if self.steps else None
            self.steps.append(
                {
                    "step": step,
                    "version": ev["version"],
                    "time": t,
                    "reward_mean": m["reward_mean"] if samples else None,  # all stale: no reward
                    "samples": samples,
                    "loss": m.get("loss"),
                    "staleness": lag_counts(m),
                    "samples_per_s": samples / (t - prev_t) if prev_t and t > prev_t else 0.0,
                }
            )

    def recent_reward(self, n: int = 10) -> float | None:
        """Mean reward of the last ``n`` steps that trained something."""
        return mean_reward([s for s in self.steps if s["reward_mean"] is not None][-n:])

    def throughput(self, n: int = 10) -> float:
        tail = self.steps[-n:]
        if len(tail) < 2 or tail[-1]["time"] <= tail[0]["time"]:
            return 0.0
        return sum(s["samples"] for s in tail[1:]) / (tail[-1]["time"] - tail[0]["time"])

    def longest_pauses(self) -> dict:
        """The longest pause of each stage after the first trainer step, in seconds: ``trainer``
        (between two consecutive steps; ``trainer_before_step`` is the step that ended it) and
        ``reward`` (between two commits of one reward worker, the ``commit_gap_s`` window) and
        ``rollout`` (between two trajectories of one rollout worker, ``produce_gap_s``). A rebalance
        that takes a worker's partitions away for seconds shows here."""
        gap, before = 0.0, None
        for a, b in zip(self.steps, self.steps[1:], strict=False):
            if b["time"] - a["time"] > gap:
                gap, before = b["time"] - a["time"], b["step"]
        return {
            "trainer": round(gap, 2),
            "trainer_before_step": before,
            **{k: round(v, 2) for k, v in self.pause_s.items()},
        }

    def eval_curve(self) -> list[list]:
        """[[version, mean reward, pass@1], ...] in version order."""
        return [[v, round(e["reward_mean"], 4), round(e["pass_at_1"] or 0.0, 4)] for v, e in sorted(self.evals.items())]

    def tool_curve(self) -> list[list]:
        """[[version, tool call rate, call success, malformed call rate, turns mean, pass@1], ...] of
        the versions whose held-out set ran in an environment, in version order."""
        return [[v, *(round(x or 0.0, 4) for x in e["tools"]), round(e["pass_at_1"] or 0.0, 4)]
                for v, e in sorted(self.evals.items()) if "tools" in e]  # fmt: skip

    def _fold_fault(self, key: str, text: str | None, t: float) -> None:
        now = self.faults.get(key)
        if (now["text"] if now else None) == (text or None):
            return
        if now is not None:
            now["end"] = t
            del self.faults[key]
            if not text:
                self.to_say.append((key, f"resumed after {t - now['start']:.0f} s (was: {now['text']})"))
        if text:
            self.faults[key] = rec = {"worker": key, "text": text, "start": t, "end": None}
            self.fault_log.append(rec)
            self.to_say.append((key, text))

    def staleness(self) -> dict[int, int]:
        from rlstream.report import staleness_histogram

        return staleness_histogram(self.steps)


def render(p: Progress, lags: dict, max_steps: int, k: int, elapsed: float, title: str = "rlstream", restarts=None,
           dead_letters: str = "", stalled: list[str] | None = None, busy: str | None = None):  # fmt: skip
    """The live view: a rich table of the run's state; ``dead_letters`` and ``stalled`` (from
    ``rlstream.stall``) are shown in red when there are any, ``busy`` (the trainer inside a long
    step, ``StallWatch.busy``) as the row ``trainer``."""
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=f"{title} — k = {k}, {elapsed:.0f} s", show_header=False, expand=False)
    last = p.steps[-1] if p.steps else None
    t.add_row(
        "trainer step / version", f"{last['step'] if last else 0} / {max_steps}   v{last['version'] if last else 0}"
    )
    r = p.recent_reward()
    t.add_row("mean reward (last 10 steps)", f"{r:.3f}" if r is not None else "-")
    t.add_row("samples/s (trainer, last 10 steps)", f"{p.throughput():.1f}")
    hist = p.staleness()
    t.add_row("staleness histogram", "  ".join(f"{d}: {n}" for d, n in hist.items()) or "-")
    t.add_row("lag (records) per stage", "  ".join(f"{s}: {n}" for s, n in lags.items()) or "-")
    versions = {k2.split("/", 1)[1]: ev["version"] for k2, ev in sorted(p.workers.items()) if ev["role"] == "rollout"}
    t.add_row("rollout loaded versions", "  ".join(f"{w}: v{v}" for w, v in versions.items()) or "-")
    if p.evals:
        v = max(p.evals)
        t.add_row(
            "eval (newest)", f"v{v}: reward {p.evals[v]['reward_mean']:.3f}  pass@1 {p.evals[v]['pass_at_1']:.3f}"
        )
    if busy:
        t.add_row("trainer", escape(busy))
    t.add_row("restarts", "  ".join(f"{n}: {c}" for n, c in sorted((restarts or {}).items())) or "none")
    if dead_letters:
        t.add_row("dead letters (rl.dlq)", f"[red]{escape(dead_letters)}[/]")
    if stalled:
        t.add_row("stalled", f"[bold red]{escape('; '.join(stalled))}[/]")
    return t
