"""Policy losses on per-token logprobs, and the step loss of a micro-batch.

Per token, with ``A`` the sample's advantage, ``mu`` the behaviour logprob (from the rollout
engine), ``logp`` the current policy's and ``sg`` stop-gradient (docs/reference/losses.md):

* ``ppo_clip``: ``r = exp(logp - mu)``; ``l = -min(r A, clip(r, 1 - e_lo, 1 + e_hi) A)``.
* ``tis``: ``l = -sg(min(exp(logp - mu), C)) * A * logp`` (truncated importance sampling).
* ``decoupled_ppo`` (AReaL): ``w = exp(prox - mu)`` (tokens with ``w > cap`` get ``w = 0``),
  ``r = exp(logp - prox)``; ``l = -sg(w) * min(r A, clip(r, 1 - e_lo, 1 + e_hi) A)``; ``prox``
  is recomputed with the weights at the start of the trainer step.
* ``cispo`` (MiniMax-M1): ``l = -sg(clip(exp(logp - mu), 1 - e_lo, 1 + e_hi)) * A * logp``.
* ``gspo`` (Qwen, GSPO): the sequence ratio ``s_i = exp(mean_t (logp - mu))`` over the sample's
  trained tokens, clipped as a whole: ``l_it = -min(s_it A, clip(s_it, 1 - e_lo, 1 + e_hi) A)``
  with ``s_it = sg(s_i) * exp(logp - sg(logp))`` (value ``s_i``, gradient ``s_i * grad logp``):
  under ``seq-mean-token-mean`` aggregation this is GSPO's objective and gradient exactly.
* ``sft`` (supervised fine-tuning): ``l = -logp``, the negative log-likelihood of the trained
  tokens (a demonstration's assistant tokens, ``producers.sft``); advantages and behaviour
  logprobs are ignored, so with ``aggregation = "token-mean"`` the step loss is the mean NLL per
  assistant token.
* KL penalty (``kl_coef = beta > 0``): ``l += beta * (exp(ref - logp) - (ref - logp) - 1)`` (k3).
* Entropy bonus (``entropy_coef = c > 0``): ``l -= c * H_t``, ``H_t`` the entropy of the policy's
  next-token distribution at position t (the engine computes it from the logits, with gradient).

Tokens with mask 0 (padding, environment observations, and tokens older than ``v - k`` under
``trainer.staleness_rule = "token"``) contribute nothing: not to the loss, its gradient, GSPO's
sequence ratio (a mean over the trained tokens only) nor the aggregation counts.

The micro-batch loss is ``sum_i w_i sum_t mask_it l_it`` with the aggregation weights ``w_i`` of
``batch.sample_weights``; per-sample values reach their tokens through ``MicroBatch.per_token``
(padded rows or packed segments alike).

Every policy loss is a ``Loss`` (an object with a declared interface and capabilities) in the
registry ``LOSSES``, chosen by ``[trainer.loss] type``; a user loss is named by its dotted path
(``type = "my_pkg.losses:MyLoss"``, a ``Loss`` subclass or a plain function). Not an optimizer or
a trainer: engines call a ``LossFn``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from pipeline.plugins import Registry


def ppo_clip(logp, old_logp, adv, eps_low: float, eps_high: float):
    ratio = torch.exp(logp - old_logp)
    s1 = ratio * adv
    s2 = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -torch.minimum(s1, s2)
    return loss, {"ratio": ratio.detach(), "clipped": (s2 < s1).float()}


def tis(logp, old_logp, adv, cap: float):
    w = torch.clamp(torch.exp(logp - old_logp), max=cap).detach()
    return -w * adv * logp, {"ratio": torch.exp(logp - old_logp).detach(), "is_weight": w}


def decoupled_ppo(logp, old_logp, prox_logp, adv, eps_low: float, eps_high: float, cap: float | None):
    if prox_logp is None:
        raise ValueError("decoupled_ppo needs proximal logprobs (recomputed before the step)")
    w = torch.exp(prox_logp - old_logp).detach()
    capped = torch.zeros_like(w) if cap is None else (w > cap).float()
    if cap is not None:
        w = torch.where(w > cap, torch.zeros_like(w), w)
    pg, stats = ppo_clip(logp, prox_logp, adv, eps_low, eps_high)
    return w * pg, {**stats, "behav_weight": w, "behav_capped": capped}


def cispo(logp, old_logp, adv, eps_low: float, eps_high: float):
    ratio = torch.exp(logp - old_logp)
    w = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high).detach()
    return -w * adv * logp, {"ratio": ratio.detach(), "clipped": (w != ratio.detach()).float()}


def seq_mean(x, mask, segments=None):
    """Per token, the mean of ``x`` over the trained tokens (``mask``) of the sample it belongs to:
    per row (padded layout) or per segment (packed layout). A sample without trained tokens gets 0."""
    xm = x * mask
    if segments is None:
        return (xm.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)).expand_as(x)
    flat = segments.reshape(-1)
    n = int(flat.max()) + 1
    sums = torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, flat, xm.reshape(-1))
    cnt = torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, flat, mask.reshape(-1).to(x.dtype))
    return (sums / cnt.clamp(min=1))[segments]


def gspo(logp, old_logp, adv, mask, eps_low: float, eps_high: float, segments=None):
    """GSPO with the sequence-level ratio ``s_i = exp(mean of log ratios over trained tokens)``."""
    log_s = seq_mean((logp - old_logp).detach(), mask, segments)
    s_tok = torch.exp(log_s + logp - logp.detach())  # value s_i, d/dlogp = s_i
    s1 = s_tok * adv
    s2 = torch.clamp(s_tok, 1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -torch.minimum(s1, s2)
    return loss, {"ratio": torch.exp(log_s), "clipped": (s2 < s1).float()}


def k3(logp, ref_logp):
    """Schulman's k3 estimator of KL(pi || ref) per token: exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def behaviour_logp(logp, mb):
    """The behaviour logprobs where a token is trained, and ``sg(logp)`` (ratio 1) elsewhere.

    Untrained positions (padding, environment tokens, tokens masked by the token staleness rule)
    are multiplied by a zero mask anyway, but a masked stale token keeps its recorded logprob, and
    ``exp(logp - mu)`` of a far off-policy token can overflow: ``inf * 0`` would make the loss and
    every gradient NaN. Trained positions are untouched, so the loss is bit-identical."""
    return torch.where(mb.token_mask > 0, mb.old_logp.to(logp.dtype), logp.detach())


class Loss(ABC):
    """A policy loss: what every built-in is, and what a user loss (``[trainer.loss] type =
    "my_pkg.losses:MyLoss"``, its settings in ``options``) subclasses. Built as ``cls(config)``,
    ``config`` its ``[trainer.loss]`` section (``loss_config.py``).

    ``__call__(logp, old_logp, adv, mb)`` returns the per-token loss ``[b, T-1]`` (before the token
    mask, the aggregation weights and the shared KL and entropy terms, which ``LossFn`` adds) and
    ``{name: per-token tensor}`` statistics (averaged over trained tokens in the metrics).
    ``logp``: the current policy's logprobs (with gradient); ``old_logp``: the behaviour
    logprobs (``sg(logp)`` on untrained positions); ``adv``: each token's advantage; ``mb``: the
    ``MicroBatch`` (``token_mask``, ``segments``, ``prox_logp``, ...).

    What a loss needs beyond that is declared, never probed:"""

    needs_prox_logp: ClassVar[bool] = False
    """The step recomputes ``mb.prox_logp`` (the weights before the step's first update) for it."""
    needs_entropy: ClassVar[bool] = False
    """It is called with ``entropy=``, the per-token entropy of the policy (with gradient)."""

    def __init__(self, config):
        self.config = config

    @abstractmethod
    def __call__(self, logp, old_logp, adv, mb, **kw) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token loss and statistics (``entropy=`` too when ``needs_entropy``)."""


class FunctionLoss(Loss):
    """A plain function ``fn(logp, old_logp, adv, mb) -> (loss, stats)`` as a ``Loss`` (no capabilities)."""

    def __init__(self, fn, config):
        super().__init__(config)
        self.fn = fn

    def __call__(self, logp, old_logp, adv, mb, **kw):
        return self.fn(logp, old_logp, adv, mb)


class PPOClip(Loss):
    def __call__(self, logp, old_logp, adv, mb, **kw):
        return ppo_clip(logp, old_logp, adv, self.config.eps_low, self.config.eps_high)


class TIS(Loss):
    def __call__(self, logp, old_logp, adv, mb, **kw):
        return tis(logp, old_logp, adv, self.config.cap)


class DecoupledPPO(Loss):
    needs_prox_logp = True

    def __call__(self, logp, old_logp, adv, mb, **kw):
        c = self.config
        prox = None if mb.prox_logp is None else mb.prox_logp.to(logp.dtype)
        return decoupled_ppo(logp, old_logp, prox, adv, c.eps_low, c.eps_high, c.behav_weight_cap)


class CISPO(Loss):
    def __call__(self, logp, old_logp, adv, mb, **kw):
        return cispo(logp, old_logp, adv, self.config.eps_low, self.config.eps_high)


class GSPO(Loss):
    def __call__(self, logp, old_logp, adv, mb, **kw):
        mask = mb.token_mask.to(logp.dtype)
        return gspo(logp, old_logp, adv, mask, self.config.eps_low, self.config.eps_high, mb.segments)


class SFT(Loss):
    """Token NLL: ``-logp`` on the trained tokens (the token mask holds the assistant tokens only)."""

    def __call__(self, logp, old_logp, adv, mb, **kw):
        nll = -logp
        return nll, {"nll": nll.detach()}


LOSSES = Registry("loss", hint="package.module:Name (a consumers.trainer.losses.Loss subclass or a function)")
"""``[trainer.loss] type`` -> a ``Loss`` subclass (or a function); a dotted ``module:Name`` works too."""
for _name, _cls in {
    "ppo_clip": PPOClip,
    "tis": TIS,
    "decoupled_ppo": DecoupledPPO,
    "cispo": CISPO,
    "gspo": GSPO,
    "sft": SFT,
}.items():
    LOSSES.register(_name, _cls)


def build_loss(cfg) -> Loss:
    """The policy loss ``cfg.type`` names (a built-in, or ``module:Name``), built with ``cfg``."""
    return LOSSES.build_callable(cfg.type, cfg, Loss, FunctionLoss)


def token_loss(logp, mb, cfg, policy: Loss | None = None, entropy=None):
    """Per-token loss [b, T-1] and per-token statistics of ``policy`` (default: ``cfg``'s) plus
    the KL penalty of ``cfg`` (a ``[trainer.loss]`` section)."""
    policy = build_loss(cfg) if policy is None else policy
    adv = mb.per_token(mb.advantages.to(logp.dtype))
    old = behaviour_logp(logp, mb)
    if policy.needs_entropy:
        loss, stats = policy(logp, old, adv, mb, entropy=entropy)
    else:
        loss, stats = policy(logp, old, adv, mb)
    stats = dict(stats)
    if cfg.kl_coef > 0:
        if mb.ref_logp is None:
            raise ValueError("kl_coef > 0 needs reference logprobs")
        kl = k3(logp, mb.ref_logp.to(logp.dtype))
        loss = loss + cfg.kl_coef * kl
        stats["kl"] = kl.detach()
    return loss, stats


def micro_batch_loss(logp, mb, cfg, entropy=None, policy: Loss | None = None):
    """Scalar loss of one micro-batch and ``{stat: (sum, count)}`` over its trained tokens.
    ``entropy``: per-token policy entropy (needed when ``cfg.entropy_coef > 0`` or the policy
    loss ``needs_entropy``)."""
    policy = build_loss(cfg) if policy is None else policy
    if entropy is None and (cfg.entropy_coef > 0 or policy.needs_entropy):
        raise ValueError("entropy_coef > 0 needs the per-token entropy (use LossFn, engines compute it)")
    loss_tok, stats = token_loss(logp, mb, cfg, policy, entropy)
    if cfg.entropy_coef > 0:
        loss_tok = loss_tok - cfg.entropy_coef * entropy.to(logp.dtype)
        stats["entropy"] = entropy.detach()
    mask = mb.token_mask.to(logp.dtype)
    weights = mb.per_token(mb.weights.to(logp.dtype))
    loss = (loss_tok * mask * weights).sum()
    n = float(mask.sum())
    out = {k: (float((v * mask).sum()), n) for k, v in stats.items()}
    out["logp_diff"] = (float(((logp.detach() - behaviour_logp(logp, mb)).abs() * mask).sum()), n)
    return loss, out


class LossFn:
    """The engines' ``loss_fn(logp, mb, entropy=None) -> (loss, stats)`` for one ``[trainer.loss]``
    section: its policy loss (built once), the KL penalty, the entropy bonus, the aggregation
    weights. Its capabilities, read by the engines and the step: ``needs_entropy`` (compute the
    per-token entropy from the logits) and ``needs_prox_logp`` (recompute the proximal logprobs
    before the step's first update)."""

    def __init__(self, cfg, policy: Loss | None = None):
        self.cfg = cfg
        self.policy = build_loss(cfg) if policy is None else policy
        self.needs_prox_logp: bool = self.policy.needs_prox_logp
        self.needs_entropy: bool = cfg.entropy_coef > 0 or self.policy.needs_entropy

    def __call__(self, logp, mb, entropy=None):
        return micro_batch_loss(logp, mb, self.cfg, entropy, self.policy)
