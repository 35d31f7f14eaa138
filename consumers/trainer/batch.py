"""From scored records to training tensors: the ``Sample`` a record decodes to, the step plan
(the staleness gate, the incomplete-group policy, advantages), and the micro-batches an engine
runs (padding, per-token masks, the aggregation weights of docs/losses.md).

``plan_step`` is the one place where the hard staleness bound is enforced: a sample with
``v - version_min > k`` at trainer version ``v`` never enters a micro-batch. Everything above
``collate`` is plain Python; torch is imported inside the functions that build tensors. Not a
data loader: the trainer's consumer loop feeds it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from consumers.trainer import advantages
from pipeline.control import is_stale
from pipeline.records import check_scored


@dataclass
class Sample:
    """One scored trajectory, decoded. ``mask`` has one 0/1 per response token (1 = trained)."""

    trajectory_id: str
    group_id: str
    partition: int
    offset: int
    prompt: list[int]
    response: list[int]
    logprobs: list[float]
    mask: list[int]
    reward: float
    version_min: int
    version_max: int
    group_size: int
    group_seq: int = -1
    advantage: float = 0.0


def sample_from_record(
    rec: dict, partition: int, offset: int, vocab_size: int | None = None, max_len: int | None = None
) -> Sample:
    """A ScoredTrajectory record as a Sample; ``InvalidRecord`` (a DecodeError) if it cannot train:
    inconsistent arrays or versions, non-finite numbers, token ids outside ``vocab_size``, longer
    than ``max_len`` (pipeline.records)."""
    prompt, response, logprobs, mask = check_scored(rec, vocab_size, max_len)
    t = rec["trajectory"]
    tid = t["trajectory_id"]
    return Sample(
        trajectory_id=tid,
        group_id=t["group_id"],
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
    )


@dataclass
class StepPlan:
    """What one trainer step does with its G closed groups."""

    version: int
    train: list[Sample] = field(default_factory=list)
    """Samples that contribute to the gradient, with their advantages set."""
    stale: list[Sample] = field(default_factory=list)
    """Dropped by the hard bound: ``version - version_min > k``."""
    incomplete_dropped: list[Sample] = field(default_factory=list)
    """Samples of incomplete groups under ``incomplete_groups = "drop"``."""
    incomplete_groups: int = 0
    """Closed groups that had fewer than group_size samples."""

    def version_lag_counts(self) -> dict[int, int]:
        """{v - version_min: samples trained} of this step."""
        out: dict[int, int] = {}
        for s in self.train:
            d = self.version - s.version_min
            out[d] = out.get(d, 0) + 1
        return dict(sorted(out.items()))


def plan_step(groups, version: int, k: int, incomplete_policy: str, adv_cfg) -> StepPlan:
    """Apply the staleness bound and the incomplete-group policy, then compute advantages.

    ``groups`` are closed groups (``.samples``, ``.complete``). Stale samples are removed before
    advantages are computed, so they do not even enter their group's baseline; a group left with
    fewer samples is normalised over the fresh ones it has.
    """
    plan = StepPlan(version=version)
    for g in groups:
        if not g.complete:
            plan.incomplete_groups += 1
        fresh = []
        for s in g.samples:
            (plan.stale if is_stale(version, s.version_min, k) else fresh).append(s)
        if not g.complete and incomplete_policy == "drop":
            plan.incomplete_dropped.extend(fresh)
            continue
        for s, a in zip(fresh, advantages.compute([s.reward for s in fresh], adv_cfg), strict=True):
            s.advantage = a
        plan.train.extend(fresh)
    return plan


def split_minibatches(samples: list[Sample], n: int, seed: int) -> list[list[Sample]]:
    """``n`` near-equal minibatches after a seeded shuffle (every sample in exactly one)."""
    order = list(samples)
    random.Random(seed).shuffle(order)
    return [order[i::n] for i in range(n)]


def sample_weights(samples: list[Sample], loss_cfg) -> list[float]:
    """Per-sample weight w_i such that the step loss is ``sum_i w_i * sum_t mask_it * l_it``.

    Computed over the whole minibatch (all micro-batches, all ranks), so accumulation and data
    parallelism give the same loss as one big batch. Sequences without a trained token get 0
    and do not count in B.
    """
    counts = [sum(s.mask[i] for i in _trainable_positions(s)) for s in samples]
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


def _trainable_positions(s: Sample) -> range:
    """Response token indices that can be predicted (the first token needs a prompt token)."""
    return range(0 if s.prompt else 1, len(s.response))


@dataclass
class MicroBatch:
    """Tensors of one forward/backward. Shifted arrays have length T - 1 (position t predicts t + 1)."""

    input_ids: object
    attention_mask: object
    targets: object
    token_mask: object
    """1.0 where a trained response token is predicted."""
    old_logp: object
    """Behaviour logprobs (from the rollout engine), aligned with ``targets``."""
    advantages: object
    """[b] per-sample advantage."""
    weights: object
    """[b] per-sample aggregation weight (0 for padding rows)."""
    ids: list[str]
    prox_logp: object = None
    """decoupled_ppo: logprobs of the weights at the start of the step (recomputed, no grad)."""
    ref_logp: object = None
    """KL penalty: logprobs of the frozen reference model."""

    def to(self, device) -> MicroBatch:
        out = MicroBatch(**{k: getattr(self, k) for k in self.__dataclass_fields__})
        for k in ("input_ids", "attention_mask", "targets", "token_mask", "old_logp", "advantages", "weights"):
            setattr(out, k, getattr(self, k).to(device))
        for k in ("prox_logp", "ref_logp"):
            if getattr(self, k) is not None:
                setattr(out, k, getattr(self, k).to(device))
        return out


def collate(samples: list[Sample], weights: list[float], pad_id: int = 0) -> MicroBatch:
    """Right-padded tensors of ``samples``; an empty list gives a one-row all-zero-weight dummy
    (so every data-parallel rank runs the same number of backward passes)."""
    import torch

    if not samples:
        z = torch.zeros(1, 1)
        return MicroBatch(
            input_ids=torch.full((1, 2), pad_id, dtype=torch.long),
            attention_mask=torch.ones(1, 2, dtype=torch.long),
            targets=torch.full((1, 1), pad_id, dtype=torch.long),
            token_mask=z.clone(),
            old_logp=z.clone(),
            advantages=torch.zeros(1),
            weights=torch.zeros(1),
            ids=[],
        )
    t = max(len(s.prompt) + len(s.response) for s in samples)
    t = max(t, 2)
    b = len(samples)
    input_ids = torch.full((b, t), pad_id, dtype=torch.long)
    attn = torch.zeros(b, t, dtype=torch.long)
    token_mask = torch.zeros(b, t - 1)
    old = torch.zeros(b, t - 1)
    for i, s in enumerate(samples):
        seq = s.prompt + s.response
        input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attn[i, : len(seq)] = 1
        p = len(s.prompt)
        for j in _trainable_positions(s):
            token_mask[i, p + j - 1] = float(s.mask[j])
            old[i, p + j - 1] = s.logprobs[j]
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attn,
        targets=input_ids[:, 1:].clone(),
        token_mask=token_mask,
        old_logp=old,
        advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        weights=torch.tensor(weights, dtype=torch.float32),
        ids=[s.trajectory_id for s in samples],
    )


def shard_micro_batches(
    samples: list[Sample], weights: list[float], rank: int, world: int, micro_batch_size: int, pad_id: int = 0
) -> list[MicroBatch]:
    """This rank's micro-batches of one minibatch: samples ``rank::world``, length-sorted, in
    chunks of ``micro_batch_size``, padded with dummies to the same count on every rank."""
    per_rank = [list(zip(samples[r::world], weights[r::world], strict=True)) for r in range(world)]
    n_micro = max(max(-(-len(x) // micro_batch_size) for x in per_rank), 1)
    mine = sorted(per_rank[rank], key=lambda sw: len(sw[0].prompt) + len(sw[0].response))
    out = []
    for i in range(n_micro):
        chunk = mine[i * micro_batch_size : (i + 1) * micro_batch_size]
        out.append(collate([s for s, _ in chunk], [w for _, w in chunk], pad_id))
    return out
