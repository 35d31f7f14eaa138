"""What a finished trainer step reports: its counters and gauges (rl.metrics, Prometheus), its log
line, and its steps-log entry (``<checkpoint_dir>/steps.jsonl``, docs/reference/trainer.md#the-steps-log).

Every record the step disposed of is in exactly one of the entry's ``used``, ``update_skipped``,
``stale``, ``incomplete_dropped``, ``filtered``, ``overlong``. Under the token staleness rule the
entry also has ``token_masked``: for every trained sample whose oldest tokens were masked, the
first trained response index (``from``), the trainable tokens masked, and the version of the
oldest kept token (``oldest``), which the chaos audit checks against the record's own version
marks. Pure bookkeeping: no Kafka, no torch; the worker disposes of the offsets and writes the log.
"""

from __future__ import annotations

import logging
import time

from pipeline.log import kv
from pipeline.records import LAG_PREFIX, lag_gauges

log = logging.getLogger(__name__)

LOGGED_GAUGES = ("loss", "grad_norm", "lr", "reward_mean", "reward_mean_sampled", "samples_per_s", "step_time_s")


def account_step(
    metrics, step: int, version: int, plan, groups, filtered, result: dict, step_s: float, consumed: int,
    token_rule: bool,
) -> dict:  # fmt: skip
    """Count, set gauges, log and publish the metrics of one finished step; returns its steps-log
    entry. ``step`` is the step just finished, ``version`` the version the trainer now holds."""
    skipped = set(result["skipped_ids"])  # in an update that was skipped: not used
    used = [s for s in plan.train if s.trajectory_id not in skipped]
    masked = plan.token_masked()
    m = metrics
    m.inc("steps")
    m.inc("optimizer_steps", result["optimizer_steps"])
    m.inc("updates_skipped", result["skipped"])
    m.inc("groups_closed", len(groups))
    m.inc("groups_incomplete", plan.incomplete_groups)
    m.inc("samples_trained", len(used))
    m.inc("samples_update_skipped", len(skipped))
    m.inc("stale_dropped", len(plan.stale))
    m.inc("incomplete_dropped", len(plan.incomplete_dropped))
    m.inc("groups_filtered", len(filtered))
    m.inc("samples_filtered", sum(len(g.samples) for g in filtered))
    m.inc("overlong_masked", len(plan.overlong))
    if plan.tails:
        m.inc("tail_samples_trained", plan.tails)
    if token_rule:
        m.inc("samples_token_masked", len(masked))
        m.inc("tokens_stale_masked", sum(c["masked"] for c in masked.values()))
    lags = plan.version_lag_counts()
    for name in [n for n in m.gauges if n.startswith(LAG_PREFIX)]:
        del m.gauges[name]
    rewards = [s.reward for s in plan.train]
    sampled = [s.reward for s in [*plan.train, *plan.overlong]] + [s.reward for g in filtered for s in g.samples]
    gauges = {
        "step": step,
        "loss": result["loss"],
        "grad_norm": result["grad_norm"],
        "lr": result["lr"],
        "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        "reward_mean_sampled": sum(sampled) / len(sampled) if sampled else 0.0,
        "consumed_groups": consumed,
        "step_time_s": step_s,
        "samples_per_s": len(plan.train) / step_s if step_s > 0 else 0.0,
        **{f"loss_{k}": v for k, v in result["stats"].items()},
        **lag_gauges(lags),
    }
    for name, value in gauges.items():
        m.set(name, value)
    m.version = version
    entry = {
        "step": step,
        "version": plan.version,
        "time": time.time(),
        "used": [s.trajectory_id for s in used],
        "update_skipped": sorted(skipped),
        "stale": [s.trajectory_id for s in plan.stale],
        "incomplete_dropped": [s.trajectory_id for s in plan.incomplete_dropped],
        "groups": [g.id for g in groups],
        "filtered": [s.trajectory_id for g in filtered for s in g.samples],
        "filtered_groups": [g.id for g in filtered],
        "overlong": [s.trajectory_id for s in plan.overlong],
        "consumed_groups": consumed,
        "staleness": {str(d): n for d, n in lags.items()},
        **({"tails": plan.tails} if plan.tails else {}),
        **{k: gauges[k] for k in LOGGED_GAUGES},
        # mean |trainer logprob - engine logprob| per trained token before the update: at staleness
        # 0 the engine/trainer numerical mismatch (dtype, kernels), beyond it also the policy's drift
        **({"logp_diff": gauges["loss_logp_diff"]} if "loss_logp_diff" in gauges else {}),
    }
    if token_rule:
        entry["token_masked"] = masked
    log.info(
        "step %s",
        kv(
            step=step,
            version=version,
            samples=len(used),
            update_skipped=len(skipped),
            stale=len(plan.stale),
            **({"token_masked": len(masked)} if token_rule else {}),
            incomplete_dropped=len(plan.incomplete_dropped),
            filtered_groups=len(filtered),
            loss=round(result["loss"], 5),
            grad_norm=round(result["grad_norm"], 4),
            reward=round(gauges["reward_mean"], 3),
            s=round(step_s, 3),
        ),
    )
    m.publish()
    return entry
