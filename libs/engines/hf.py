"""The transformers engine: continuous batching over an HF causal LM with our own decode loop.

Every submitted request joins the running batch at the next refill point (every
``refill_every`` decode steps, or at once when the batch is empty): its prompt is prefilled on
its own and its KV cache is left-padded and concatenated to the batch's, so no running row is
recomputed. Each decode step feeds every row's last token, samples the next one, and drops rows
that finished (their cache rows too), so ``step`` returns each sample the moment it ends.

Logprobs: the model's raw logits (what ``generate(output_logits=True)`` returns, not the
processed ``output_scores``), ``log_softmax(logits / T)`` over the full vocabulary, evaluated at
the sampled token; tokens are drawn from exactly that distribution (``T = 1`` for logprobs when
greedy). What this is not: a fast server; use the vllm engine for throughput.

Weights: a ``full`` update is staged in the background (``prepare_weights``): each shard, once read
and verified (``pipeline.checkpoint.iter_weights``, later shards still being read), is converted to
the model's dtypes and moved to its device; ``load_weights`` at the safe point then only checks
names and shapes and swaps the staged tensors in (``load_state_dict(assign=True)``), so the
generation pause does not grow with the checkpoint. The price: old and new weights both live on the
device while a version is staged. LoRA ``adapter`` updates go through PEFT
(``libs.engines.adapters.PeftApplier``): the LoRA layers are injected once and each version's
adapter tensors are copied into them, the base weights never move.
"""

from __future__ import annotations

import logging
import zlib
from collections import deque
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from libs.engines.base import Engine, EngineContext, GenOutput, GenRequest
from pipeline.checkpoint import iter_weights
from pipeline.log import kv
from pipeline.models import load_model, resolve_dtype
from pipeline.records import update_kind

log = logging.getLogger(__name__)


@dataclass
class _Row:
    req: GenRequest
    fed: int = 0
    """Real tokens of this row already in the KV cache (= next position id)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None


class HFEngine(Engine):
    name = "hf"
    weight_kinds = frozenset({"full", "adapter"})

    def __init__(self, cfg, ctx: EngineContext):
        super().__init__(cfg, ctx)
        model_dir, tokenizer, worker_id = ctx.model_dir, ctx.tokenizer, ctx.worker_id
        device = cfg.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.dtype = resolve_dtype(cfg.dtype, device)
        self.model = load_model(model_dir, self.dtype, device).eval()
        self._peft = None  # PeftApplier once an adapter was loaded
        self._dtypes = {k: v.dtype for k, v in self.model.state_dict().items()}  # full-weights staging
        self.refill_every = cfg.refill_every
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        self.max_model_len = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.gen = torch.Generator(device=self.device).manual_seed(cfg.seed ^ zlib.crc32(worker_id.encode()))
        self.pending: deque[GenRequest] = deque()
        self.rows: list[_Row] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # (B, L) attention mask of the cache
        self.steps_since_refill = 0
        log.info("hf engine ready %s", kv(device=self.device, dtype=self.dtype, requested=cfg.dtype))

    # -- interface -------------------------------------------------------------------------------
    def submit(self, req: GenRequest) -> None:
        if len(req.context) + req.max_new_tokens > self.max_model_len:
            raise ValueError(f"request {req.rid}: context + max_new_tokens exceeds {self.max_model_len}")
        self.pending.append(req)

    def inflight(self) -> int:
        return len(self.pending) + len(self.rows)

    def step(self, timeout: float = 0.0) -> list[GenOutput]:
        with torch.inference_mode():
            if self.pending and (not self.rows or self.steps_since_refill >= self.refill_every):
                self._admit()
            elif self.rows:
                self._decode()
            return self._collect()

    def abort(self, rids: list[str] | None = None) -> list[GenOutput]:
        want = None if rids is None else set(rids)
        out = []
        keep_pending = deque()
        for r in self.pending:
            if want is None or r.rid in want:
                out.append(GenOutput(r.rid, [], [], "abort"))
            else:
                keep_pending.append(r)
        self.pending = keep_pending
        keep = []
        for i, row in enumerate(self.rows):
            if want is None or row.req.rid in want:
                out.append(GenOutput(row.req.rid, row.tokens, row.logprobs, "abort"))
            else:
                keep.append(i)
        self._select(keep)
        return out

    def load_weights(self, update: dict, prepared) -> None:
        if self.inflight():
            raise RuntimeError("load_weights with requests in flight")
        if update_kind(update) == "adapter":
            from libs.engines.adapters import PeftApplier

            self._peft = self._peft or PeftApplier(self.model)
            self.model = self._peft.apply(prepared)
            self.version = int(update["version"])
            return
        if self._peft is not None:  # full weights after adapters: back to the plain model
            self.model = self._peft.unload()
            self._peft = None
        current = self.model.state_dict()
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        missing = [k for k in current if k not in prepared and not (tied and k == "lm_head.weight")]
        unexpected = [k for k in prepared if k not in current]
        shapes = [k for k in prepared if k in current and prepared[k].shape != current[k].shape]
        if missing or unexpected or shapes:
            raise ValueError(f"checkpoint {update['uri']} does not fit the model: {missing=} {unexpected=} {shapes=}")
        self.model.load_state_dict(prepared, strict=False, assign=True)  # a swap: staged by prepare_weights
        if tied:
            self.model.tie_weights()
        self.version = int(update["version"])

    def prepare_weights(self, update: dict):
        """Full weights: every verified shard converted to the model's dtypes and device as soon as
        it is read (the next shards are being read meanwhile), on the weight-fetch thread."""
        if update_kind(update) == "adapter":
            return super().prepare_weights(update)
        staged = {}
        for _, tensors in iter_weights(update["uri"], update["sha256"]):
            for k, t in tensors.items():
                dt = self._dtypes.get(k, t.dtype) if t.is_floating_point() else t.dtype
                staged[k] = t.to(device=self.device, dtype=dt)
        return staged

    # -- internals -------------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, rows: list[_Row]) -> None:
        """Draw one token per row from ``logits`` (B, V) and append it with its logprob."""
        logits = logits.float()
        temps = torch.tensor([r.req.temperature for r in rows], device=logits.device)
        greedy = temps <= 0
        scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
        logp = torch.log_softmax(scaled, dim=-1)
        sampled = torch.multinomial(logp.exp(), 1, generator=self.gen).squeeze(1)
        tok = torch.where(greedy, scaled.argmax(-1), sampled)
        lp = logp.gather(1, tok[:, None]).squeeze(1)
        for row, t, p in zip(rows, tok.tolist(), lp.tolist(), strict=True):
            row.tokens.append(t)
            row.logprobs.append(p)
            if t in row.req.stop_ids:
                row.finish = "stop"
            elif len(row.tokens) >= row.req.max_new_tokens:
                row.finish = "length"

    def _admit(self) -> None:
        new = [_Row(self.pending.popleft()) for _ in range(len(self.pending))]
        lens = [len(r.req.context) for r in new]
        width = max(lens)
        ids = torch.full((len(new), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(new), width), dtype=torch.long)
        for i, r in enumerate(new):
            ids[i, width - lens[i] :] = torch.tensor(r.req.context, dtype=torch.long)
            mask[i, width - lens[i] :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        for r, n in zip(new, lens, strict=True):
            r.fed = n
        self._sample(out.logits[:, -1, :], new)
        self._merge(new, out.past_key_values, mask)
        self.steps_since_refill = 0

    def _merge(self, new: list[_Row], cache: DynamicCache, mask: torch.Tensor) -> None:
        if not self.rows:
            self.rows, self.cache, self.mask = new, cache, mask
            return
        old_len, new_len = self.mask.shape[1], mask.shape[1]
        width = max(old_len, new_len)
        if not all(type(layer) is DynamicLayer for layer in [*self.cache.layers, *cache.layers]):
            raise NotImplementedError("hf engine: only models with plain DynamicCache layers are supported")
        for a, b in zip(self.cache.layers, cache.layers, strict=True):
            a.keys = torch.cat([_pad_left(a.keys, width, 2), _pad_left(b.keys, width, 2)], 0)
            a.values = torch.cat([_pad_left(a.values, width, 2), _pad_left(b.values, width, 2)], 0)
        self.mask = torch.cat([_pad_left(self.mask, width, 1), _pad_left(mask, width, 1)], 0)
        self.rows = self.rows + new

    def _decode(self) -> None:
        last = torch.tensor([[r.tokens[-1]] for r in self.rows], dtype=torch.long, device=self.device)
        pos = torch.tensor([[r.fed] for r in self.rows], dtype=torch.long, device=self.device)
        self.mask = torch.cat([self.mask, torch.ones((len(self.rows), 1), dtype=torch.long, device=self.device)], 1)
        out = self.model(
            input_ids=last, attention_mask=self.mask, position_ids=pos, past_key_values=self.cache, use_cache=True
        )
        self.cache = out.past_key_values
        for r in self.rows:
            r.fed += 1
        self._sample(out.logits[:, -1, :], self.rows)
        self.steps_since_refill += 1

    def _collect(self) -> list[GenOutput]:
        done = [GenOutput(r.req.rid, r.tokens, r.logprobs, r.finish) for r in self.rows if r.finish]
        if done:
            self._select([i for i, r in enumerate(self.rows) if not r.finish])
        return done

    def _select(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (and their cache), then drop all-padding columns on the left."""
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.rows, self.cache, self.mask = [], None, None
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.rows = [self.rows[i] for i in keep]
        self.cache.batch_select_indices(idx)
        self.mask = self.mask[idx]
        start = int((self.mask.sum(0) > 0).nonzero()[0])
        if start > 0:
            for layer in self.cache.layers:
                layer.keys = layer.keys[:, :, start:, :]
                layer.values = layer.values[:, :, start:, :]
            self.mask = self.mask[:, start:]
        log.debug("hf batch %s", kv(rows=len(self.rows), width=self.mask.shape[1]))


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    extra = width - t.shape[dim]
    if extra <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([torch.zeros(shape, dtype=t.dtype, device=t.device), t], dim)
