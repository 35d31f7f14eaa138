"""The policy model's description, shared by rollout engines and trainers.

``model.type = "tiny"`` builds a small random-init Llama with a character-level tokenizer in
code (nothing is downloaded), deterministically from a seed, so every role starts from the
same version-0 weights. ``model.type = "pretrained"`` names a local HF model directory.
``materialize`` turns either into a directory that every engine (HF, vLLM, trainers) loads.

torch and transformers are imported inside functions only.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import string
import tempfile
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from pipeline.config import StrictModel
from pipeline.model_import import MODEL_CACHE, resolve_model_path

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARSET = string.digits + string.ascii_letters + string.punctuation + " \n"


class TinyModelConfig(StrictModel):
    type: Literal["tiny"] = "tiny"
    hidden_size: int = Field(128, ge=8, le=4096)
    """Width of the random-init Llama."""
    num_layers: int = Field(2, ge=1, le=64)
    """Decoder layers."""
    num_heads: int = Field(4, ge=1, le=64)
    """Attention heads (must divide hidden_size)."""
    intermediate_size: int = Field(256, ge=8)
    """MLP width."""
    max_position_embeddings: int = Field(512, ge=16)
    """Longest prompt + response in tokens."""
    charset: str = CHARSET
    """Characters of the character-level vocabulary (after <pad> <bos> <eos> <unk>)."""
    seed: int = 0
    """Init seed: the same seed gives the same version-0 weights in every process."""
    chat_template: str = ""
    """A Jinja chat template for the tokenizer ('' = none), e.g. to try chat datasets on the tiny model."""

    def key(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]


class PretrainedModelConfig(StrictModel):
    type: Literal["pretrained"] = "pretrained"
    path: Path
    """A local HF model directory (config.json, weights, tokenizer), a llama-family ``.gguf`` file, or
    a packaged model's name (``smollm2-135m-instruct``); GGUF files are imported once into the model
    cache (``rlstream model import``). Never downloaded."""


ModelConfig = Annotated[TinyModelConfig | PretrainedModelConfig, Field(discriminator="type")]


def build_char_tokenizer(charset: str = CHARSET, chat_template: str = ""):
    """A character-level ``PreTrainedTokenizerFast`` built in code (with ``chat_template`` if given)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*SPECIALS, *dict.fromkeys(charset)])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    if chat_template:
        tok.chat_template = chat_template
    return tok


def build_tiny_model(cfg: TinyModelConfig):
    """(model, tokenizer) with deterministic random init."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_char_tokenizer(cfg.charset, cfg.chat_template)
    lc = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = LlamaForCausalLM(lc)
    return model.float().eval(), tok


def materialize(cfg, cache_dir: Path | None = None) -> Path:
    """A directory holding the model (config, safetensors weights, tokenizer). Idempotent and
    safe when several processes call it at once (built in a temp dir, then renamed)."""
    if isinstance(cfg, PretrainedModelConfig):
        return resolve_model_path(cfg.path)
    root = Path(cache_dir or MODEL_CACHE)
    target = root / f"tiny-{cfg.key()}"
    if (target / "done.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=root))
    try:
        model, tok = build_tiny_model(cfg)
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "done.json").write_text(json.dumps(cfg.model_dump()))
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its copy is identical
            if not (target / "done.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def native_bf16(device) -> bool:
    """Whether ``device`` computes in bfloat16 natively: a CUDA GPU that supports it, or a CPU with
    AVX512-BF16 or AMX. Elsewhere (an AVX2-only CPU) bf16 is emulated and several times slower than
    float32: a real-model trainer step measured 221 s in bf16 on such a CPU."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if dev.type != "cpu":
        return False
    cpu = torch.cpu
    return any(getattr(cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def resolve_dtype(dtype: str, device) -> str:
    """``auto``: bfloat16 where ``device`` does it natively (``native_bf16``), else float32; any
    other name is returned as it is."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if native_bf16(device) else "float32"


def load_model(path: Path, dtype: str = "float32", device: str = "cpu"):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype))
    return model.to(device)
