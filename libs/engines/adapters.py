"""LoRA adapters on the rollout side: fetch + verify an announced adapter, check it was trained on
this worker's base model, and the two ways an engine applies it.

* ``prepare_adapter``: reads the adapter file a ``kind = "adapter"`` WeightUpdate names, verifies
  its sha256, checks that its config (inside the file's header) matches the notice (rank, alpha,
  target modules) and that the notice's ``base_sha256`` is the fingerprint of this worker's base
  model (``BaseModelMismatch`` otherwise: an adapter on the wrong base is garbage, so the worker
  stops loudly). Runs on the weight-fetch thread.
* ``PeftApplier`` (hf engine): injects PEFT LoRA layers into the model once and copies each new
  version's adapter tensors into them (``set_peft_model_state_dict``): only the small adapter
  moves, the frozen base stays where it is.
* ``merged_weights`` (vllm engine, any full-weights loader): ``W = W0 + (alpha / r) B A`` for every
  adapted linear, from a cached CPU copy of the base ``W0``: the result is a partial state dict
  with HF names that an in-place loader takes.

Not the trainer's side (``consumers.trainer.engines.lora``) nor the file layout
(``pipeline.checkpoint.write_adapter``). peft and torch are imported only when used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from pipeline.checkpoint import model_fingerprint, read_adapter
from pipeline.errors import RlstreamError
from pipeline.log import kv
from pipeline.records import update_adapter

log = logging.getLogger(__name__)
PEFT_PREFIX = "base_model.model."


class BaseModelMismatch(RlstreamError):
    """An adapter announces another base model than the one this worker holds."""


@dataclass
class PreparedAdapter:
    state: dict
    """Adapter tensors with PEFT's saved names (``base_model.model.<module>.lora_A.weight``)."""
    config: dict
    """PEFT adapter config (``r``, ``lora_alpha``, ``target_modules``, ...)."""

    @property
    def scale(self) -> float:
        r = int(self.config["r"])
        alpha = float(self.config["lora_alpha"])
        return alpha / (r**0.5) if self.config.get("use_rslora") else alpha / r


def prepare_adapter(update: dict, model_dir: Path) -> PreparedAdapter:
    """Fetch, verify and check the adapter ``update`` names against the base in ``model_dir``."""
    state, conf = read_adapter(update["uri"], update["sha256"])
    named = update_adapter(update)
    want = {
        "r": named["rank"] or int(conf["r"]),
        "lora_alpha": named["alpha"] or float(conf["lora_alpha"]),
        "target_modules": named["target_modules"] or sorted(conf["target_modules"]),
    }
    have = {
        "r": int(conf["r"]),
        "lora_alpha": float(conf["lora_alpha"]),
        "target_modules": sorted(conf["target_modules"]),
    }
    if want != have:
        raise RlstreamError(f"adapter v{update['version']}: its file says {have}, the notice {want}")
    base = update.get("base_sha256") or ""
    if base:
        mine = model_fingerprint(model_dir)
        if mine != base:
            raise BaseModelMismatch(
                f"adapter v{update['version']} was trained on base {base[:16]}..., this worker holds "
                f"{mine[:16]}... ({model_dir}): refusing to apply it to another model"
            )
    if not state or not all(".lora_A." in k or ".lora_B." in k for k in state):
        raise RlstreamError(f"adapter v{update['version']} holds tensors other than lora_A/lora_B: {sorted(state)[:4]}")
    return PreparedAdapter(state, conf)


def lora_pairs(state: dict) -> dict[str, tuple]:
    """``{module path (HF names): (A, B)}`` of an adapter state dict."""
    out: dict[str, list] = {}
    for k, v in state.items():
        path = k[len(PEFT_PREFIX) :] if k.startswith(PEFT_PREFIX) else k
        mod, _, rest = path.partition(".lora_")
        slot = out.setdefault(mod, [None, None])
        slot[0 if rest.startswith("A.") else 1] = v
    if any(a is None or b is None for a, b in out.values()):
        raise RlstreamError("adapter has a lora_A without its lora_B (or the reverse)")
    return {m: (a, b) for m, (a, b) in out.items()}


class BaseWeights:
    """CPU float32 copies of the base model's weights that adapters touch, read once from the
    model directory's safetensors files (only the tensors asked for)."""

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        self.cache: dict = {}

    def get(self, names: list[str]) -> dict:
        missing = [n for n in names if n not in self.cache]
        if missing:
            from safetensors import safe_open

            want = set(missing)
            for f in sorted(self.model_dir.glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as sf:
                    for n in want & set(sf.keys()):
                        self.cache[n] = sf.get_tensor(n).float()
            lost = [n for n in missing if n not in self.cache]
            if lost:
                raise RlstreamError(f"base model {self.model_dir} has no weight {lost[0]} (adapter does not fit)")
        return {n: self.cache[n] for n in names}


def merged_weights(prepared: PreparedAdapter, base: BaseWeights) -> dict:
    """``{<module>.weight: W0 + scale * B @ A}`` for every adapted module (float32, HF names)."""
    pairs = lora_pairs(prepared.state)
    w0 = base.get([f"{m}.weight" for m in pairs])
    out = {}
    for m, (a, b) in pairs.items():
        name = f"{m}.weight"
        out[name] = w0[name] + prepared.scale * (b.float() @ a.float())
    return out


class PeftApplier:
    """Holds a model with PEFT LoRA layers injected; ``apply`` loads one adapter version into them."""

    def __init__(self, model):
        self.base = model
        self.model = None  # the PeftModel, once an adapter was applied
        self.config: dict | None = None

    @staticmethod
    def _shape(conf: dict) -> tuple:
        return (
            int(conf["r"]),
            float(conf["lora_alpha"]),
            tuple(sorted(conf["target_modules"])),
            bool(conf.get("use_rslora")),
        )

    def apply(self, prepared: PreparedAdapter):
        """Returns the model to generate with (the PeftModel)."""
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

        if self.model is not None and self._shape(self.config) != self._shape(prepared.config):
            self.unload()  # another rank or other targets: inject afresh
        if self.model is None:
            conf = prepared.config
            lc = LoraConfig(
                r=int(conf["r"]),
                lora_alpha=float(conf["lora_alpha"]),
                target_modules=list(conf["target_modules"]),
                lora_dropout=0.0,
                use_rslora=bool(conf.get("use_rslora", False)),
                bias="none",
            )
            self.model = get_peft_model(self.base, lc).eval()
            self.config = dict(conf)
            log.info("injected LoRA layers %s", kv(r=lc.r, targets=sorted(lc.target_modules)))
        res = set_peft_model_state_dict(self.model, prepared.state)
        unexpected = list(getattr(res, "unexpected_keys", []) or [])
        missing = [k for k in (getattr(res, "missing_keys", []) or []) if "lora_" in k]
        if unexpected or missing:
            raise RlstreamError(f"adapter does not fit the model: unexpected={unexpected[:4]} missing={missing[:4]}")
        return self.model

    def unload(self):
        """Remove the LoRA layers (without merging); returns the plain base model."""
        if self.model is not None:
            self.base = self.model.unload()
            self.model = self.config = None
        return self.base
