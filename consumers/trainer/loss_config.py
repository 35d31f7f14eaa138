"""Configuration of the advantage estimator (``[trainer.advantage]``) and the policy loss
(``[trainer.loss]``): each a discriminated union of one model per built-in (its own keys only),
plus a user plug-in named by its dotted path (``module:Name``, settings in ``options``).

``[trainer.loss]`` keeps the keys every loss shares (``aggregation``, ``norm_tokens``,
``kl_coef``, ``kl_estimator``, ``entropy_coef``) beside ``type`` and that loss's own keys:

    [trainer.loss]
    type = "cispo"
    eps_high = 4.0          # cispo's own key (was cispo_eps_high)
    kl_coef = 0.01          # shared

The flat keys of earlier versions (``clip_eps_low``, ``tis_cap``, ``cispo_eps_high``,
``gspo_eps_low``, ...) are still read: under the loss they belong to they become its key, with a
one-time ``FutureWarning`` naming it; under another loss (where they never had an effect) they
are dropped with a warning. Setting an old key and its new key to different values is an error
naming both. Advantages: ``eps``/``std_unbiased`` belong to ``grpo`` and are dropped, with a
warning, under another estimator.

Only declarations and bounds live here (no torch): the formulas are in ``losses.py`` and
``advantages.py``, whose registries (``LOSSES``, ``ADVANTAGES``) map these names to code.
"""

from __future__ import annotations

import warnings
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, TypeAdapter, field_validator

from pipeline.config import StrictModel, plugin_union
from pipeline.plugins import is_dotted

# ---- advantages -------------------------------------------------------------------------------


class _AdvantageBase(StrictModel):
    """How a group's rewards become per-sample advantages (docs/reference/losses.md)."""

    estimator: str
    """grpo: (r - mean)/(std + eps); dr_grpo: r - mean; rloo: r - mean of the others; or a user
    estimator ``package.module:Name`` (an ``advantages.Advantage`` subclass or a function)."""


class GrpoAdvantageConfig(_AdvantageBase):
    estimator: Literal["grpo"] = "grpo"
    eps: float = Field(1e-6, gt=0, le=1.0)
    """Added to the group's std."""
    std_unbiased: bool = True
    """Sample std (n - 1), as TRL and verl do; false: population std (n)."""


class DrGrpoAdvantageConfig(_AdvantageBase):
    estimator: Literal["dr_grpo"] = "dr_grpo"


class RlooAdvantageConfig(_AdvantageBase):
    estimator: Literal["rloo"] = "rloo"


ADVANTAGE_CONFIGS = {
    m.model_fields["estimator"].default: m for m in (GrpoAdvantageConfig, DrGrpoAdvantageConfig, RlooAdvantageConfig)
}


class PluginAdvantageConfig(_AdvantageBase):
    """A user estimator: ``estimator = "my_pkg.adv:MyAdvantage"``."""

    options: dict[str, Any] = Field(default_factory=dict)
    """Settings handed to the estimator (``config.options``)."""

    @field_validator("estimator")
    @classmethod
    def _dotted(cls, v: str) -> str:
        if not is_dotted(v):
            raise ValueError(
                f"unknown advantage estimator {v!r}; built-ins: {', '.join(ADVANTAGE_CONFIGS)}, or package.module:Name"
            )
        return v


# ---- losses -----------------------------------------------------------------------------------


class _LossBase(StrictModel):
    """The policy loss (docs/reference/losses.md has every formula) and what every loss shares: the
    aggregation, the KL penalty and the entropy bonus. ``ratio`` is pi_theta / pi_behaviour."""

    type: str
    """ppo_clip, tis (truncated importance sampling), decoupled_ppo (AReaL), cispo (MiniMax-M1),
    gspo (Qwen's group sequence policy optimisation), sft (supervised: token NLL of
    demonstrations), or a user loss ``package.module:Name`` (a
    ``losses.Loss`` subclass or a function)."""
    entropy_coef: float = Field(0.0, ge=0, le=1.0)
    """Entropy bonus: every trained token adds ``-entropy_coef * H(pi_theta(.|context))`` (full
    vocabulary, with gradient); 0 disables it and its extra pass over the logits."""
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    """How token losses of one optimizer step become a scalar (docs/reference/losses.md)."""
    norm_tokens: int | None = Field(None, ge=1)
    """seq-mean-token-sum-norm: the constant token count L (Dr. GRPO); None: the longest response of the step."""
    kl_coef: float = Field(0.0, ge=0)
    """beta of the KL penalty to the frozen reference (version-0) model; 0 disables it and its forward pass."""
    kl_estimator: Literal["k3"] = "k3"
    """k3 = exp(ref - logp) - (ref - logp) - 1, per token (Schulman's unbiased, non-negative estimator)."""


class PPOClipLossConfig(_LossBase):
    """``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``."""

    type: Literal["ppo_clip"] = "ppo_clip"
    eps_low: float = Field(0.2, ge=0, le=1.0)
    """The ratio is clipped below at 1 - eps_low."""
    eps_high: float = Field(0.2, ge=0, le=10.0)
    """Clipped above at 1 + eps_high (DAPO's clip-higher uses 0.28)."""


class TISLossConfig(_LossBase):
    """Truncated importance sampling: ``-sg(min(r, cap)) A log pi_theta``."""

    type: Literal["tis"] = "tis"
    cap: float = Field(2.0, gt=0)
    """The importance weight min(ratio, cap) (detached) multiplies A * log pi_theta."""


class DecoupledPPOLossConfig(_LossBase):
    """AReaL's decoupled PPO: PPO clipping against the proximal policy (the weights at the start
    of the step), weighted by the behaviour weight pi_prox / pi_behaviour."""

    type: Literal["decoupled_ppo"] = "decoupled_ppo"
    eps_low: float = Field(0.2, ge=0, le=1.0)
    """The proximal ratio is clipped below at 1 - eps_low."""
    eps_high: float = Field(0.2, ge=0, le=10.0)
    """Clipped above at 1 + eps_high."""
    behav_weight_cap: float | None = Field(5.0, gt=0)
    """Tokens whose behaviour weight pi_prox / pi_behaviour exceeds this get weight 0; None
    (``"none"`` in a config file or ``--set``): uncapped."""


class CISPOLossConfig(_LossBase):
    """MiniMax-M1's CISPO: ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi_theta``."""

    type: Literal["cispo"] = "cispo"
    eps_low: float = Field(1.0, ge=0, le=1.0)
    """The detached IS weight is clipped below at 1 - eps_low (1.0: no lower clip)."""
    eps_high: float = Field(4.0, ge=0)
    """Clipped above at 1 + eps_high."""


class GSPOLossConfig(_LossBase):
    """Qwen's GSPO: the sequence-level ratio, clipped as a whole."""

    type: Literal["gspo"] = "gspo"
    eps_low: float = Field(3e-4, ge=0, le=1.0)
    """The sequence ratio s_i is clipped below at 1 - eps_low (the GSPO paper's 3e-4)."""
    eps_high: float = Field(4e-4, ge=0, le=10.0)
    """Clipped above at 1 + eps_high (the paper's 4e-4). Pair gspo with
    ``aggregation = "seq-mean-token-mean"`` to get the paper's objective exactly."""


class SFTLossConfig(_LossBase):
    """Supervised fine-tuning: the negative log-likelihood of the trained tokens (a demonstration's
    assistant tokens; ``feed.mode = "sft"``), advantages and behaviour logprobs ignored. With
    ``aggregation = "token-mean"`` the step loss is the mean NLL per assistant token."""

    type: Literal["sft"] = "sft"


LOSS_CONFIGS = {
    m.model_fields["type"].default: m
    for m in (PPOClipLossConfig, TISLossConfig, DecoupledPPOLossConfig, CISPOLossConfig, GSPOLossConfig, SFTLossConfig)
}


class PluginLossConfig(_LossBase):
    """A user loss: ``type = "my_pkg.losses:MyLoss"``, its settings in ``options``; the shared keys
    (aggregation, KL, entropy) apply to it as to the built-ins."""

    options: dict[str, Any] = Field(default_factory=dict)
    """Settings handed to the loss (``config.options``)."""

    @field_validator("type")
    @classmethod
    def _dotted(cls, v: str) -> str:
        if not is_dotted(v):
            raise ValueError(f"unknown loss {v!r}; built-ins: {', '.join(LOSS_CONFIGS)}, or package.module:Name")
        return v


# ---- the flat keys of earlier versions ----------------------------------------------------------

RENAMED_LOSS_KEYS: dict[str, dict[str, str]] = {
    "clip_eps_low": {"ppo_clip": "eps_low", "decoupled_ppo": "eps_low"},
    "clip_eps_high": {"ppo_clip": "eps_high", "decoupled_ppo": "eps_high"},
    "tis_cap": {"tis": "cap"},
    "behav_weight_cap": {"decoupled_ppo": "behav_weight_cap"},
    "cispo_eps_low": {"cispo": "eps_low"},
    "cispo_eps_high": {"cispo": "eps_high"},
    "gspo_eps_low": {"gspo": "eps_low"},
    "gspo_eps_high": {"gspo": "eps_high"},
}
"""Old flat key of ``[trainer.loss]`` -> {loss type: its key there}."""
GRPO_ONLY_KEYS: dict[str, dict[str, str]] = {"eps": {"grpo": "eps"}, "std_unbiased": {"grpo": "std_unbiased"}}
"""Keys of ``[trainer.advantage]`` that every estimator once accepted and only grpo reads."""


def _flat_keys(section: str, key: str, default: str, renamed: dict[str, dict[str, str]]):
    """A before-validator mapping the old flat keys of ``section`` onto the chosen member's keys."""

    def migrate(data):
        if not isinstance(data, dict) or not any(k in data for k in renamed):
            return data
        data, kind = dict(data), data.get(key, default)
        for old, where in renamed.items():
            if old not in data:
                continue
            new = where.get(kind)
            if new == old:
                continue
            value = data.pop(old)
            if new is None:
                uses = " or ".join(f'{section}.{n} with {key} = "{t}"' for t, n in where.items())
                warnings.warn(
                    f'{section}.{old} has no effect with {key} = "{kind}" and is ignored (it means {uses})',
                    FutureWarning,
                    stacklevel=1,
                )
                continue
            if new in data and data[new] != value:
                raise ValueError(
                    f"{section}.{old} (deprecated) = {value!r} and {section}.{new} = {data[new]!r} disagree; "
                    f"set {section}.{new} only"
                )
            data[new] = value
            warnings.warn(
                f'{section}.{old} is deprecated: use {section}.{new} (with {key} = "{kind}")',
                FutureWarning,
                stacklevel=1,
            )
        return data

    return BeforeValidator(migrate)


AdvantageConfig = Annotated[
    plugin_union(*ADVANTAGE_CONFIGS.values(), plugin=PluginAdvantageConfig, key="estimator", default="grpo"),
    _flat_keys("trainer.advantage", "estimator", "grpo", GRPO_ONLY_KEYS),
]
"""``[trainer.advantage]``: one of ``ADVANTAGE_CONFIGS`` by ``estimator``, or a user estimator."""
LossConfig = Annotated[
    plugin_union(*LOSS_CONFIGS.values(), plugin=PluginLossConfig, default="ppo_clip"),
    _flat_keys("trainer.loss", "type", "ppo_clip", RENAMED_LOSS_KEYS),
]
"""``[trainer.loss]``: one of ``LOSS_CONFIGS`` by ``type``, or a user loss."""

_ADVANTAGE = TypeAdapter(AdvantageConfig)
_LOSS = TypeAdapter(LossConfig)


def advantage_config(**values) -> _AdvantageBase:
    """The ``[trainer.advantage]`` model for ``values`` (``advantage_config(estimator="rloo")``)."""
    return _ADVANTAGE.validate_python(values)


def loss_config(**values) -> _LossBase:
    """The ``[trainer.loss]`` model for ``values`` (``loss_config(type="cispo", eps_high=2.0)``)."""
    return _LOSS.validate_python(values)
