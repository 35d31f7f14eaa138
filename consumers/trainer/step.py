"""One trainer step on this rank: split the step's samples into ``trainer.minibatches`` seeded
minibatches (each further cut so that no optimizer step exceeds ``trainer.max_tokens_per_step``),
shard each over the data-parallel ranks into micro-batches (by count or by
``max_tokens_per_micro_batch``; padded or packed), fill in the proximal logprobs (decoupled PPO:
the weights *before* the step's first update) and the reference logprobs (KL penalty), then run
one optimizer step per minibatch and sum the results over ranks.

It is called by every rank with the same samples (rank 0 broadcasts them); Kafka, versions and
the staleness gate are the caller's (``worker.py``, ``batch.plan_step``).
"""

from __future__ import annotations

from consumers.trainer.batch import sample_weights, shard_micro_batches, split_by_tokens, split_minibatches
from consumers.trainer.engines.base import all_reduce_sums, token_logprobs


def prepare(engine, samples, trainer_cfg, loss_fn, step: int, ref=None, progress=None) -> tuple[list[list], list[list]]:
    """The minibatches (every rank's samples) and, per minibatch, this rank's micro-batches with
    ``prox_logp`` (when ``loss_fn.needs_prox_logp``) and ``ref_logp`` (with ``ref``) filled.
    ``progress``: a ``heartbeat.StepHeartbeat`` told the phase (rank 0), or None."""
    tc = trainer_cfg
    minis = [
        part
        for m in split_minibatches(samples, tc.minibatches, tc.seed * 1_000_003 + step)
        if m
        for part in split_by_tokens(m, tc.max_tokens_per_step)
    ]
    plans = [
        shard_micro_batches(
            m,
            sample_weights(m, tc.loss),
            engine.rank,
            engine.world_size,
            tc.micro_batch_size,
            engine.pad_id,
            max_tokens=tc.max_tokens_per_micro_batch,
            packing=tc.packing,
        )
        for m in minis
    ]
    if progress is not None and (loss_fn.needs_prox_logp or ref is not None):
        progress.phase("logprobs")
    if loss_fn.needs_prox_logp:  # proximal policy = the weights before this step's first update
        for mbs in plans:
            for mb, lp in zip(mbs, engine.compute_logprobs(mbs), strict=True):
                mb.prox_logp = lp
    if ref is not None:
        import torch

        with torch.no_grad():
            for mbs in plans:
                for mb in mbs:
                    mb.ref_logp = token_logprobs(ref, mb.to(engine.device), autocast_dtype=engine.autocast).cpu()
    return minis, plans


def train_samples(engine, samples, trainer_cfg, loss_fn, step: int, ref=None, on_minibatch=None, progress=None) -> dict:
    """Run the optimizer steps of one trainer step. Returns loss (mean over minibatches of the
    summed-over-ranks loss), grad_norm and lr of the last update, counts, token-mean stats, and
    ``skipped_ids``: the trajectory ids of minibatches whose update was skipped on some rank (a
    non-finite gradient): they contributed nothing and must not be reported as used.
    ``on_minibatch(micro_batches)`` is called before each update (tests inspect the inputs);
    ``progress`` (rank 0's ``heartbeat.StepHeartbeat``, or None) is told the minibatch, micro-batch
    and phase as they go."""
    out = {"loss": 0.0, "grad_norm": 0.0, "lr": engine.lr, "optimizer_steps": 0, "skipped": 0, "stats": {}}
    out["skipped_ids"] = []
    if not samples:  # nothing to learn from: no update (Adam's momentum would still move weights)
        return out
    minis, plans = prepare(engine, samples, trainer_cfg, loss_fn, step, ref, progress)
    world = engine.world_size
    stats: dict[str, list[float]] = {}
    for i, (mini, mbs) in enumerate(zip(minis, plans, strict=True)):
        if on_minibatch is not None:
            on_minibatch(mbs)
        if progress is not None:
            progress.minibatch(i + 1, len(plans))
            mbs = progress.counted(mbs)
        res = engine.train_step(mbs, loss_fn)
        names = sorted(res.stats)
        flat = [res.loss, float(res.skipped)] + [x for n in names for x in res.stats[n]]
        tot = all_reduce_sums(flat, world, engine.device if world > 1 else "cpu")
        out["loss"] += tot[0] / len(plans)
        if tot[1] > 0:
            out["skipped"] += 1
            out["skipped_ids"] += [s.trajectory_id for s in mini]
        out["grad_norm"] = res.grad_norm
        out["lr"] = res.lr
        out["optimizer_steps"] += 1
        for i, n in enumerate(names):
            s, c = stats.get(n, [0.0, 0.0])
            stats[n] = [s + tot[2 + 2 * i], c + tot[3 + 2 * i]]
    out["stats"] = {n: s / c for n, (s, c) in stats.items() if c > 0}
    return out
