"""User plug-ins named by their dotted path in tests (``tests.user_plugins:Name``): a loss class, a
loss function, an advantage class and an advantage function, as a user's package would hold them."""

from consumers.trainer.advantages import Advantage
from consumers.trainer.losses import Loss

NOT_A_PLUGIN = 3


class Scaled(Loss):
    """``-options["scale"] * A * logp``; it declares that it needs the proximal logprobs."""

    needs_prox_logp = True

    def __call__(self, logp, old_logp, adv, mb, **kw):
        return -self.config.options["scale"] * adv * logp, {"scale": logp.detach() * 0 + 1}


def scaled_pg(logp, old_logp, adv, mb):
    """A function loss: ``-A * logp``."""
    return -adv * logp, {}


class Centered(Advantage):
    """``r - mean(r) + options["shift"]``."""

    def __call__(self, rewards):
        mean = sum(rewards) / len(rewards)
        return [r - mean + self.config.options.get("shift", 0.0) for r in rewards]


def signs(rewards):
    """A function estimator: +1 for a positive reward, else -1."""
    return [1.0 if r > 0 else -1.0 for r in rewards]
