"""What a run looks like while it runs: ``Progress`` folds rl.metrics events into the trainer's step
log and each worker's newest event; ``render`` draws the live view. Read-only; no Kafka here."""

from __future__ import annotations


class Progress:
    """Folds rl.metrics into what the live view and the report need."""

    def __init__(self):
        self.steps: list[dict] = []
        self.workers: dict[str, dict] = {}
        self.evals: dict[int, dict] = {}
        """version -> {reward_mean, pass_at_1, answers} from ``rlstream eval``."""

    def add(self, ev: dict) -> None:
        key = f"{ev['role']}/{ev['worker_id']}"
        self.workers[key] = ev
        m = ev["metrics"]
        if ev["role"] == "eval" and "eval_reward_mean" in m:
            self.evals[ev["version"]] = {
                "reward_mean": m["eval_reward_mean"], "pass_at_1": m.get("eval_pass_at_1"), "answers": m.get("eval_answers")
            }  # fmt: skip
        if ev["role"] == "trainer" and "step" in m and "reward_mean" in m:
            step = int(m["step"])
            if self.steps and self.steps[-1]["step"] >= step:
                return  # periodic event repeating the last step's gauges
            t = ev["timestamp_ms"] / 1000
            samples = int(sum(v for k, v in m.items() if k.startswith("version_lag_")))
            prev_t = self.steps[-1]["time"] if self.steps else None
            self.steps.append(
                {
                    "step": step,
                    "version": ev["version"],
                    "time": t,
                    "reward_mean": m["reward_mean"],
                    "samples": samples,
                    "loss": m.get("loss"),
                    "staleness": {
                        k.removeprefix("version_lag_"): int(v) for k, v in m.items() if k.startswith("version_lag_")
                    },
                    "samples_per_s": samples / (t - prev_t) if prev_t and t > prev_t else 0.0,
                }
            )

    def recent_reward(self, n: int = 10) -> float | None:
        if not self.steps:
            return None
        tail = self.steps[-n:]
        return sum(s["reward_mean"] for s in tail) / len(tail)

    def throughput(self, n: int = 10) -> float:
        tail = self.steps[-n:]
        if len(tail) < 2 or tail[-1]["time"] <= tail[0]["time"]:
            return 0.0
        return sum(s["samples"] for s in tail[1:]) / (tail[-1]["time"] - tail[0]["time"])

    def eval_curve(self) -> list[list]:
        """[[version, mean reward, pass@1], ...] in version order."""
        return [[v, round(e["reward_mean"], 4), round(e["pass_at_1"] or 0.0, 4)] for v, e in sorted(self.evals.items())]

    def staleness(self) -> dict[int, int]:
        from rlstream.report import staleness_histogram

        return staleness_histogram(self.steps)


def render(p: Progress, lags: dict, max_steps: int, k: int, elapsed: float, title: str = "rlstream", restarts=None):
    """The live view: a rich table of the run's state."""
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
    t.add_row("restarts", "  ".join(f"{n}: {c}" for n, c in sorted((restarts or {}).items())) or "none")
    return t
