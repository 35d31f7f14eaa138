"""From scored records to a step plan: the ``TrainSample`` a record decodes to, the step plan (the
staleness gate, the incomplete-group policy, advantages, overlong filtering), dynamic sampling's
test of a group (``informative``), minibatches, and the aggregation weights of docs/losses.md.

``plan_step`` is the one place where the hard staleness bound is enforced (``staleness.py``): under
the sample rule a sample with ``v - version_min > k`` at trainer version ``v`` never enters a
micro-batch; under the token rule its tokens older than ``v - k`` are masked out of the loss and a
sample with no trainable token left is dropped the same way. Plain Python, no
torch: the tensors (padded or packed micro-batches) are built by ``collate.py``, whose names are
re-exported here. Not a data loader: the trainer's consumer loop feeds it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from consumers.trainer import advantages
from consumers.trainer.collate import MicroBatch, collate, pack, shard_micro_batches, split_by_tokens, trainable_start
from consumers.trainer.staleness import TokenCut, gate, parse_marks

__all__ = [
    "MicroBatch",
    "StepPlan",
    "TrainSample",
    "collate",
    "informative",
    "pack",
    "plan_step",
    "sample_from_record",
    "sample_weights",
    "shard_micro_batches",
    "split_by_tokens",
    "split_minibatches",
]
from pipeline.records import VERSIONS_KEY, check_scored, group_quorum


@dataclass
class TrainSample:
    """One scored trajectory, decoded. ``mask`` has one 0/1 per response token (1 = trained).

    The token arrays are numpy arrays when read from Kafka (views of the record's bytes, see
    ``pipeline.records.check_trajectory``); tests may pass lists. Code here treats them as
    sequences (``len``, slices, ``np.asarray``), never as lists."""

    trajectory_id: str
    prompt_group: str
    """The id of its GRPO prompt group (the record's ``group_id``)."""
    partition: int
    offset: int
    prompt: Sequence[int]
    response: Sequence[int]
    logprobs: Sequence[float]
    mask: Sequence[int]
    reward: float
    version_min: int
    version_max: int
    group_size: int
    group_seq: int = -1
    advantage: float = 0.0
    finish_reason: str = "stop"
    """stop | length (truncated at its token budget) | abort | env_done | ..."""
    version_marks: tuple = ()
    """``((response index, version), ...)``: where each version's tokens start (the token rule
    only; ``staleness.parse_marks``). Empty: every token counts as ``version_min``."""
    cut: TokenCut | None = None
    """Set by ``plan_step`` on a trained copy whose oldest tokens the token rule masked."""
    quorum: int = 0
    """``rollout.overprovision_tail = "train"``: its group closes once this many samples are in (the
    rest are its tail, ``GroupAssembler``); 0 = when all ``group_size`` are."""


def sample_from_record(
    rec: dict,
    partition: int,
    offset: int,
    vocab_size: int | None = None,
    max_len: int | None = None,
    token_versions: bool = False,
) -> TrainSample:
    """A ScoredTrajectory record as a TrainSample; ``InvalidRecord`` (a DecodeError) if it cannot train:
    inconsistent arrays or versions, non-finite numbers, token ids outside ``vocab_size``, longer
    than ``max_len`` (pipeline.records), or (``token_versions``, the token rule) version marks that
    do not fit the response and its versions."""
    prompt, response, logprobs, mask = check_scored(rec, vocab_size, max_len)
    t = rec["trajectory"]
    tid = t["trajectory_id"]
    marks = ()
    if token_versions:
        text = (t.get("metadata") or {}).get(VERSIONS_KEY)
        marks = parse_marks(text, len(response), int(t["version_min"]), int(t["version_max"]), tid)
    return TrainSample(
        trajectory_id=tid,
        prompt_group=t["group_id"],
        partition=partition,
        offset=offset,
        prompt=prompt,
        response=response,
        logprobs=logprobs,
        mask=mask,
        reward=float(rec["reward"]),
        version_min=int(t["version_min"]),
        version_max=int(t["version_max"]),
        group_size=int(t["group_size"]),
        group_seq=int(t["group_seq"]),
        finish_reason=str(t.get("finish_reason") or "stop"),
        version_marks=marks,
        quorum=group_quorum(t),
    )


@dataclass
class StepPlan:
    """What one trainer step does with its G closed groups."""

    version: int
    train: list[TrainSample] = field(default_factory=list)
    """Samples that contribute to the gradient, with their advantages set."""
    stale: list[TrainSample] = field(default_factory=list)
    """Dropped by the hard bound: ``version - version_min > k`` (token rule: no trainable token
    newer than ``version - k``)."""
    incomplete_dropped: list[TrainSample] = field(default_factory=list)
    """Samples of incomplete groups under ``incomplete_groups = "drop"``."""
    incomplete_groups: int = 0
    """Closed groups that had fewer than group_size samples."""
    overlong: list[TrainSample] = field(default_factory=list)
    """Truncated samples masked out by overlong filtering (in their group's baseline, no gradient)."""
    tails: int = 0
    """Fresh tail samples of quorum groups (``rollout.overprovision_tail = "train"``) in the step."""

    def version_lag_counts(self) -> dict[int, int]:
        """{v - oldest trained version: samples trained} of this step (the oldest trained version is
        ``version_min`` unless the token rule masked the sample's oldest tokens)."""
        out: dict[int, int] = {}
        for s in self.train:
            d = self.version - (s.cut.oldest if s.cut else s.version_min)
            out[d] = out.get(d, 0) + 1
        return dict(sorted(out.items()))

    def token_masked(self) -> dict[str, dict]:
        """``{trajectory id: {"from", "masked", "oldest"}}`` of the trained samples the token rule cut."""
        return {
            s.trajectory_id: {"from": s.cut.start, "masked": s.cut.masked, "oldest": s.cut.oldest}
            for s in self.train
            if s.cut is not None
        }


def plan_step(
    groups,
    version: int,
    k: int,
    incomplete_policy: str,
    adv_cfg,
    overlong_filter: bool = False,
    staleness_rule: str = "sample",
    tails=(),
) -> StepPlan:
    """Apply the staleness bound and the incomplete-group policy, compute advantages, then (with
    ``overlong_filter``) move truncated samples (finish_reason "length") out of the trained set.

    ``groups`` are closed groups (``.samples``, ``.complete``). Stale samples are removed before
    advantages are computed, so they do not even enter their group's baseline; a group left with
    fewer samples is normalised over the fresh ones it has. Truncated samples do stay in the
    baseline (their reward is information about the prompt); they only get no gradient. Under the
    token rule a sample whose oldest tokens are too old is planned as a copy with those tokens'
    loss mask set to 0 and ``cut`` set (the group's own samples are left as recorded).

    ``tails`` (``assembler.Tail``): tail samples of quorum groups an earlier step took. Each fresh
    one gets the advantage the estimator gives it over its group's earlier rewards
    (``baseline_rewards``, stale samples' included) followed by its own reward: the baseline it
    would have had had it arrived with its group.
    """
    plan = StepPlan(version=version)
    estimator = advantages.build_advantage(adv_cfg)
    fresh_of = lambda samples: _gate_all(samples, version, k, staleness_rule, plan)  # noqa: E731
    for g in groups:
        if not g.complete:
            plan.incomplete_groups += 1
        fresh = fresh_of(g.samples)
        if not g.complete and incomplete_policy == "drop":
            plan.incomplete_dropped.extend(fresh)
            continue
        for s, a in zip(fresh, estimator([s.reward for s in fresh]), strict=True):
            s.advantage = a
        _keep(plan, fresh, overlong_filter)
    for t in tails:
        fresh = fresh_of([t.sample])
        if fresh:
            fresh[0].advantage = estimator([*t.baseline_rewards, t.sample.reward])[-1]
            plan.tails += 1
        _keep(plan, fresh, overlong_filter)
    return plan


def _gate_all(samples, version: int, k: int, staleness_rule: str, plan: StepPlan) -> list[TrainSample]:
    """The samples the staleness bound lets train (the stale ones go to ``plan.stale``); under the
    token rule a sample whose oldest tokens are too old comes back as a masked copy."""
    fresh = []
    for s in samples:
        cut = gate(s, version, k, staleness_rule, trainable_start(s))
        if cut is None:
            plan.stale.append(s)
        elif cut.start == 0:
            fresh.append(s)
        else:
            mask = np.array(s.mask, dtype=np.uint8)  # a copy: the group's sample keeps its mask
            mask[: cut.start] = 0
            fresh.append(replace(s, mask=mask, cut=cut))
    return fresh


def _keep(plan: StepPlan, fresh: list[TrainSample], overlong_filter: bool) -> None:
    for s in fresh:
        (plan.overlong if overlong_filter and s.finish_reason == "length" else plan.train).append(s)


def informative(
    group, version: int, k: int, incomplete_policy: str, tol: float = 1e-9, staleness_rule: str = "sample"
) -> bool:
    """Dynamic sampling's test: False for a group that would train but whose fresh samples' rewards
    are all equal (max - min <= ``tol``): every advantage is 0, so it carries no signal. A group
    that would not train anyway (incomplete under "drop", or with no fresh sample) is kept, so it
    counts towards G as before."""
    if not group.complete and incomplete_policy == "drop":
        return True
    rewards = [s.reward for s in group.samples if gate(s, version, k, staleness_rule, trainable_start(s)) is not None]
    if not rewards:
        return True
    return max(rewards) - min(rewards) > tol


def split_minibatches(samples: list[TrainSample], n: int, seed: int) -> list[list[TrainSample]]:
    """``n`` near-equal minibatches after a seeded shuffle (every sample in exactly one)."""
    order = list(samples)
    random.Random(seed).shuffle(order)
    return [order[i::n] for i in range(n)]


def sample_weights(samples: list[TrainSample], loss_cfg) -> list[float]:
    """Per-sample weight w_i such that the step loss is ``sum_i w_i * sum_t mask_it * l_it``.

    Computed over the whole minibatch (all micro-batches, all ranks), so accumulation and data
    parallelism give the same loss as one big batch. Sequences without a trained token get 0
    and do not count in B.
    """
    counts = [int(np.count_nonzero(np.asarray(s.mask)[trainable_start(s) :])) for s in samples]
    nonzero = [c for c in counts if c > 0]
    if not nonzero:
        return [0.0] * len(samples)
    b, total = len(nonzero), sum(nonzero)
    agg = loss_cfg.aggregation
    if agg == "token-mean":
        return [1.0 / total if c else 0.0 for c in counts]
    if agg == "seq-mean-token-mean":
        return [1.0 / (b * c) if c else 0.0 for c in counts]
    if agg == "seq-mean-token-sum":
        return [1.0 / b if c else 0.0 for c in counts]
    if agg == "seq-mean-token-sum-norm":
        norm = loss_cfg.norm_tokens or max(len(s.response) for s in samples)
        return [1.0 / (b * norm) if c else 0.0 for c in counts]
    raise ValueError(f"unknown aggregation {agg!r}")
