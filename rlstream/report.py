"""Run reports: a JSON file and PNG plots (reward vs step, staleness distribution, throughput
over time, and the eval curve when ``rlstream eval`` ran, with the exported best version marked;
``tools.png``, tool call rate, call success, malformed calls and pass@1 by version, when the
held-out set ran as episodes in a tools environment)
from the trainer's per-step MetricEvents. Used by ``rlstream run``, ``rlstream demo`` and benchmarks.

A step that trained no sample (every one stale; ``reward_mean`` None) has no point on the reward
plot and no part in its moving mean; it is marked with a red tick at the top instead.

matplotlib is imported only when plotting (the ``plots`` extra); without it the JSON is still
written and the plots are skipped with a message.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def staleness_histogram(steps: list[dict]) -> dict[int, int]:
    """Sum the per-step ``staleness_<d>`` counts into one histogram {d: samples}."""
    hist: dict[int, int] = {}
    for s in steps:
        for k, v in s.get("staleness", {}).items():
            hist[int(k)] = hist.get(int(k), 0) + int(v)
    return dict(sorted(hist.items()))


def write_report(run_dir: Path, report: dict) -> Path:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "report.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    return path


def plot_report(run_dir: Path, report: dict) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib not installed; skipping plots (pip install 'rlstream[plots]')")
        return []
    run_dir = Path(run_dir)
    steps = report.get("steps", [])
    out = []
    if steps:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        rewarded = [s for s in steps if s["reward_mean"] is not None]
        xs, ys = [s["step"] for s in rewarded], [s["reward_mean"] for s in rewarded]
        ax.plot(xs, ys, lw=1, alpha=0.5, label="batch mean")
        w = max(1, len(xs) // 20)
        smooth = [sum(ys[max(0, i - w + 1) : i + 1]) / len(ys[max(0, i - w + 1) : i + 1]) for i in range(len(ys))]
        ax.plot(xs, smooth, lw=2, label=f"moving mean ({w} steps)")
        stale_only = [s["step"] for s in steps if s["reward_mean"] is None]
        if stale_only:
            ax.plot(stale_only, [1.0] * len(stale_only), "|", color="tab:red", ms=10, label="all samples stale")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("reward")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(report.get("title", "reward vs step"))
        ax.legend(loc="lower right")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        out.append(_save(fig, run_dir / "reward.png"))

        hist = staleness_histogram(steps)
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.bar(list(hist), list(hist.values()))
        ax.set_xticks(list(hist))
        ax.set_xlabel("staleness (trainer version − version_min)")
        ax.set_ylabel("samples trained")
        ax.set_title(f"staleness distribution (k = {report.get('max_staleness', '?')})")
        fig.tight_layout()
        out.append(_save(fig, run_dir / "staleness.png"))

        fig, ax = plt.subplots(figsize=(6, 3.5))
        t0 = steps[0]["time"]
        ts, rates = [], []
        for i in range(1, len(steps)):
            window = steps[max(0, i - 10) : i + 1]  # rolling window of up to 10 steps
            dt = window[-1]["time"] - window[0]["time"]
            if dt > 0:
                ts.append(window[-1]["time"] - t0)
                rates.append(sum(s.get("samples", 0) for s in window[1:]) / dt)
        ax.plot(ts, rates, lw=1.5)
        ax.set_xlabel("seconds since first step")
        ax.set_ylabel("samples/s trained (10-step window)")
        ax.set_title("throughput over time")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        out.append(_save(fig, run_dir / "throughput.png"))
    if report.get("eval_curve"):
        curve = report["eval_curve"]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([c[0] for c in curve], [c[1] for c in curve], marker="o", label="mean reward")
        ax.plot([c[0] for c in curve], [c[2] for c in curve], marker="s", label="pass@1")
        best = ((report.get("export") or {}).get("best") or {}).get("version")
        if best is not None:  # the version kept beside the rolling window (eval.best_metric)
            ax.axvline(best, ls=":", color="tab:green", label=f"best: version {best} (exported)")
        out.append(
            _by_version(fig, ax, "held-out score", "evaluation while training", "lower right", run_dir / "eval.png")
        )
    if report.get("tool_curve"):  # held-out episodes in an environment (consumers.eval.episodes)
        curve = report["tool_curve"]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for i, label, mark in ((1, "tool call rate", "o"), (2, "call success", "s"), (3, "malformed calls", "x"),
                               (5, "pass@1", "^")):  # fmt: skip
            ax.plot([c[0] for c in curve], [c[i] for c in curve], marker=mark, label=label)
        out.append(
            _by_version(
                fig, ax, "share (held-out episodes)", "tool use on held-out episodes", "best", run_dir / "tools.png"
            )
        )
    return out


def _by_version(fig, ax, ylabel: str, title: str, legend: str, path: Path) -> Path:
    """Finish a plot of shares (0..1) by policy version and save it."""
    ax.set_xlabel("policy version")
    ax.set_ylabel(ylabel)
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.legend(loc=legend)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
