"""LoRA on the trainer side (``trainer.lora``), shared by the torch and DeepSpeed engines: wrap the
HF model with PEFT adapters (the base frozen), name what to publish (the adapter tensors with
PEFT's saved names) and its ``adapter_config.json`` content, and the trainable-only state an
engine checkpoint needs (the frozen base is the version-0 model, rebuilt from ``cfg.model``).

Not the rollout side (``libs.engines.adapters``) nor the file layout
(``pipeline.checkpoint.write_adapter``). peft is imported only here, only when LoRA is on.
"""

from __future__ import annotations

import enum
import json


def apply_lora(module, lora_cfg, gradient_checkpointing: bool = False):
    """``module`` (an HF causal LM) with LoRA adapters on ``lora_cfg.target_modules``; only the
    adapters require gradients."""
    from peft import LoraConfig, get_peft_model

    lc = LoraConfig(
        r=lora_cfg.rank,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=list(lora_cfg.target_modules),
        use_rslora=lora_cfg.rslora,
        bias="none",
    )
    if gradient_checkpointing:  # checkpointed blocks need an input that requires grad to backprop into adapters
        module.enable_input_require_grads()
    return get_peft_model(module, lc)


def _jsonable(x):
    if isinstance(x, set | frozenset):
        return sorted(x)
    if isinstance(x, enum.Enum):
        return x.value
    raise TypeError(f"not JSON serialisable: {x!r}")


def adapter_config(peft_model) -> dict:
    """PEFT's ``adapter_config.json`` content of the model's (only) adapter, JSON-clean."""
    conf = peft_model.peft_config["default"].to_dict()
    conf = json.loads(json.dumps(conf, default=_jsonable))
    conf["target_modules"] = sorted(conf["target_modules"])
    return conf


def adapter_state(peft_model) -> dict:
    """The adapter tensors with PEFT's saved names (``base_model.model.<module>.lora_A.weight``), on CPU."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model, save_embedding_layers=False)  # never the base's lm_head/embeddings
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def trainable_state(module) -> dict:
    """The parameters that train (the adapters), by their names in ``module``: an engine checkpoint
    holds these and the optimizer; the frozen base is rebuilt from the model config."""
    return {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}


def load_trainable(module, state: dict) -> None:
    """Restore ``trainable_state``; a missing or unexpected name is an error."""
    want = {n for n, p in module.named_parameters() if p.requires_grad}
    if set(state) != want:
        raise ValueError(
            f"LoRA checkpoint does not fit: missing={sorted(want - set(state))[:4]} "
            f"unexpected={sorted(set(state) - want)[:4]}"
        )
    module.load_state_dict(state, strict=False)
