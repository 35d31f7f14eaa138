"""Samples to tensors: the micro-batches an engine runs, padded or packed, and how a minibatch is cut
into them (by sample count or by a token budget, the same number on every data-parallel rank).

Two layouts of a ``MicroBatch`` (shifted arrays have length T - 1: position t predicts t + 1):

* **padded** (``collate``): one right-padded row per sample; ``attention_mask`` marks real tokens.
* **packed** (``pack``, ``trainer.packing``): every sample of the micro-batch concatenated into
  one row with ``position_ids`` restarting at 0 per sample and no padding. The HF attention
  implementations turn such position ids into a block-causal mask (sdpa/eager, via
  ``transformers.masking_utils.find_packed_sequence_indices``) or varlen kernels (flash-attention),
  so every token attends only to its own sample: the loss equals the padded computation's.
  ``segments`` maps each position to its sample; the position ending sample i never predicts
  sample i + 1's first token (that target is masked).

Per-sample values (``advantages``, ``weights``) have one entry per sample in both layouts; the
loss broadcasts them over a sample's tokens with ``segments`` (packed) or per row (padded).
Everything is built with numpy slice assignments, one per array and sample (no per-token Python). Not
the step plan (``batch.py``) nor the loss (``losses.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

_TENSORS = ("input_ids", "attention_mask", "targets", "token_mask", "old_logp", "advantages", "weights")
_OPTIONAL = ("prox_logp", "ref_logp", "position_ids", "segments")


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
    """[n] per-sample advantage (n samples; a packed micro-batch has one row and n samples)."""
    weights: object
    """[n] per-sample aggregation weight (0 for dummy rows)."""
    ids: list[str]
    prox_logp: object = None
    """decoupled_ppo: logprobs of the weights at the start of the step (recomputed, no grad)."""
    ref_logp: object = None
    """KL penalty: logprobs of the frozen reference model."""
    position_ids: object = None
    """Packed layout: [1, T] positions restarting at 0 per sample (None: padded layout)."""
    segments: object = None
    """Packed layout: [1, T - 1] index of the sample each shifted position belongs to (None: the row)."""

    def to(self, device) -> MicroBatch:
        out = MicroBatch(**{k: getattr(self, k) for k in self.__dataclass_fields__})
        for k in _TENSORS:
            setattr(out, k, getattr(self, k).to(device))
        for k in _OPTIONAL:
            if getattr(self, k) is not None:
                setattr(out, k, getattr(self, k).to(device))
        return out

    def per_token(self, values):
        """Broadcast a per-sample tensor ([n]) to the shape of ``token_mask``."""
        if self.segments is None:
            return values.unsqueeze(-1)
        return values[self.segments]

    @property
    def packed(self) -> bool:
        return self.position_ids is not None


def trainable_start(s) -> int:
    """First response index that can be predicted (the first token needs a prompt token)."""
    return 0 if len(s.prompt) else 1


def _dummy(pad_id: int) -> MicroBatch:
    """A one-row all-zero-weight micro-batch (every data-parallel rank runs the same number of passes)."""
    import torch

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


def _fill(samples, rows: int, width: int, pad_id: int, packed: bool):
    """numpy arrays of the batch: token ids and attention ([rows, width]), and the token mask and
    behaviour logprobs of the shifted positions ([rows, width - 1]). One slice assignment per array
    and sample (padded: sample i is row i; packed: samples follow each other in row 0), so the
    per-token work is numpy's."""
    import numpy as np

    ids = np.full((rows, width), pad_id, dtype=np.int64)
    attn = np.zeros((rows, width), dtype=np.int64)
    mask = np.zeros((rows, width - 1), dtype=np.float32)
    old = np.zeros((rows, width - 1), dtype=np.float32)
    start = 0
    for i, s in enumerate(samples):
        row = 0 if packed else i
        p, r = len(s.prompt), len(s.response)
        ids[row, start : start + p] = s.prompt
        ids[row, start + p : start + p + r] = s.response
        attn[row, start : start + p + r] = 1
        first = trainable_start(s)  # position start + p + j - 1 predicts response token j
        mask[row, start + p + first - 1 : start + p + r - 1] = s.mask[first:]
        old[row, start + p + first - 1 : start + p + r - 1] = s.logprobs[first:]
        if packed:
            start += p + r
    return ids, attn, mask, old


def collate(samples: list, weights: list[float], pad_id: int = 0) -> MicroBatch:
    """Right-padded tensors of ``samples``; an empty list gives a one-row all-zero-weight dummy."""
    import torch

    if not samples:
        return _dummy(pad_id)
    t = max(max(seq_len(s) for s in samples), 2)
    ids, attn, mask, old = (torch.from_numpy(x) for x in _fill(samples, len(samples), t, pad_id, packed=False))
    return MicroBatch(
        input_ids=ids,
        attention_mask=attn,
        targets=ids[:, 1:].clone(),
        token_mask=mask,
        old_logp=old,
        advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        weights=torch.tensor(weights, dtype=torch.float32),
        ids=[s.trajectory_id for s in samples],
    )


def pack(samples: list, weights: list[float], pad_id: int = 0) -> MicroBatch:
    """One padding-free row holding every sample, ``position_ids`` restarting at 0 per sample."""
    import torch

    if not samples:
        return _dummy(pad_id)
    lens = torch.tensor([seq_len(s) for s in samples], dtype=torch.long)
    total = int(lens.sum())
    n = max(total, 2)  # a single one-token sample: pad to the two positions a shifted array needs
    ids, _, mask, old = (torch.from_numpy(x) for x in _fill(samples, 1, n, pad_id, packed=True))
    seg_of_token = torch.repeat_interleave(torch.arange(len(samples)), lens)
    position_ids = torch.arange(total) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    if n > total:
        seg_of_token = torch.cat([seg_of_token, seg_of_token[-1:].expand(n - total)])
        position_ids = torch.cat([position_ids, position_ids[-1:] + 1])
    return MicroBatch(
        input_ids=ids,
        attention_mask=torch.ones(1, n, dtype=torch.long),
        targets=ids[:, 1:].clone(),
        token_mask=mask,
        old_logp=old,
        advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        weights=torch.tensor(weights, dtype=torch.float32),
        ids=[s.trajectory_id for s in samples],
        position_ids=position_ids.unsqueeze(0),
        segments=seg_of_token[:-1].unsqueeze(0),
    )


def seq_len(s) -> int:
    return len(s.prompt) + len(s.response)


def chunk(items: list, micro_batch_size: int, max_tokens: int | None, packing: bool) -> list[list]:
    """Consecutive chunks of length-sorted ``(sample, weight)`` items: ``micro_batch_size`` items
    each, or, with ``max_tokens``, as many as fit the budget (padded: rows x longest; packed: the sum
    of lengths); an item longer than the budget gets a chunk of its own."""
    if max_tokens is None:
        return [items[i : i + micro_batch_size] for i in range(0, len(items), micro_batch_size)]
    out: list[list] = []
    cur: list = []
    used = longest = 0
    for it in items:
        n = seq_len(it[0])
        cost = used + n if packing else (len(cur) + 1) * max(longest, n)
        if cur and cost > max_tokens:
            out.append(cur)
            cur, used, longest = [], 0, 0
        cur.append(it)
        used += n
        longest = max(longest, n)
    if cur:
        out.append(cur)
    return out


def shard_micro_batches(
    samples: list,
    weights: list[float],
    rank: int,
    world: int,
    micro_batch_size: int,
    pad_id: int = 0,
    max_tokens: int | None = None,
    packing: bool = False,
) -> list[MicroBatch]:
    """This rank's micro-batches of one minibatch: samples ``rank::world``, length-sorted, cut by
    ``chunk``, padded with dummies to the same count on every rank (every rank computes every
    rank's cut, so no collective is needed)."""
    per_rank = [list(zip(samples[r::world], weights[r::world], strict=True)) for r in range(world)]
    cuts = [chunk(sorted(x, key=lambda sw: seq_len(sw[0])), micro_batch_size, max_tokens, packing) for x in per_rank]
    n_micro = max(max(len(c) for c in cuts), 1)
    mine = cuts[rank] + [[] for _ in range(n_micro - len(cuts[rank]))]
    build = pack if packing else collate
    return [build([s for s, _ in c], [w for _, w in c], pad_id) for c in mine]


def split_by_tokens(samples: list, max_tokens: int | None) -> list[list]:
    """Consecutive runs of ``samples`` with at most ``max_tokens`` (prompt + response) tokens each
    (a longer sample is a run of its own); ``[samples]`` when there is no limit."""
    if not max_tokens:
        return [samples]
    out: list[list] = []
    cur: list = []
    used = 0
    for s in samples:
        n = seq_len(s)
        if cur and used + n > max_tokens:
            out.append(cur)
            cur, used = [], 0
        cur.append(s)
        used += n
    if cur:
        out.append(cur)
    return out
