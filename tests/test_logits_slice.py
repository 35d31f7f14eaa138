"""token_logprobs computes logits only from the first trained position on (the vocabulary
projection is a large share of a small model's step): the logprobs and entropies of every trained
position, and the gradients, equal those of the full computation."""

import pytest

torch = pytest.importorskip("torch")

from consumers.trainer.engines.base import token_logprobs  # noqa: E402
from pipeline.models import TinyModelConfig, build_tiny_model  # noqa: E402


class _MB:
    position_ids = None  # the padded layout (collate.MicroBatch)

    def __init__(self, ids, first):
        self.input_ids = ids
        self.attention_mask = torch.ones_like(ids)
        self.targets = ids[:, 1:]
        self.token_mask = torch.zeros(ids.shape[0], ids.shape[1] - 1)
        self.token_mask[0, first:] = 1.0
        self.token_mask[1, first + 3 :] = 1.0


def test_sliced_logits_equal_the_full_computation():
    model, _ = build_tiny_model(TinyModelConfig())
    ids = torch.randint(4, 60, (2, 24), generator=torch.Generator().manual_seed(0))
    sliced = _MB(ids, first=9)
    full = _MB(ids, first=0)
    full.token_mask = torch.ones_like(full.token_mask)  # forces the whole-sequence path
    lp_s, ent_s = token_logprobs(model, sliced, entropy=True)
    lp_f, ent_f = token_logprobs(model, full, entropy=True)
    assert lp_s.shape == lp_f.shape == sliced.token_mask.shape
    m = sliced.token_mask.bool()
    assert torch.allclose(lp_s[m], lp_f[m], atol=1e-5)
    assert torch.allclose(ent_s[m], ent_f[m], atol=1e-5)
    assert (lp_s[:, :9] == 0).all()  # untrained positions carry 0, never used
    (lp_s * sliced.token_mask).sum().backward()
    g_sliced = model.lm_head.weight.grad.clone()
    model.zero_grad()
    (lp_f * sliced.token_mask).sum().backward()
    assert torch.allclose(g_sliced, model.lm_head.weight.grad, atol=1e-5)
