"""Configuration of the generation engines: a discriminated union on ``type`` (``hf`` | ``vllm`` |
``openai``, and ``sim``, a load generator for benchmarks); a plug-in engine brings its own model.
Used by the rollout workers' ``rollout.engine`` section and by the evaluator. Nothing here imports
torch, vLLM or an HTTP client.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from pipeline.config import StrictModel, plugin_union


class HFEngineConfig(StrictModel):
    """transformers engine: our own batched decode loop over the HF model, CPU or GPU."""

    type: Literal["hf"] = "hf"
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?|mps)$")
    """torch device; ``auto`` = cuda if available, else cpu."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """Weights and activations dtype. auto: bfloat16 where the device computes it natively (a GPU
    with bf16, a CPU with AVX512-BF16 or AMX), else float32."""
    refill_every: int = Field(8, ge=1, le=4096)
    """Decode steps between re-batching (admitting waiting samples, dropping finished ones)."""
    seed: int = 0
    """Seed of the sampler (mixed with the worker id)."""
    threads: int = Field(0, ge=0, le=1024)
    """torch intra-op threads (0 = torch's default); 1 when several workers share a small machine."""


class VLLMEngineConfig(StrictModel):
    """The vLLM Python engine (``vllm.LLM``), stepped request by request."""

    type: Literal["vllm"] = "vllm"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """vLLM dtype (``float32`` on CPU for the tiny test model)."""
    max_model_len: int = Field(0, ge=0)
    """Context length; 0 = the model's max_position_embeddings."""
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    """Share of GPU memory vLLM may take (ignored on CPU)."""
    enforce_eager: bool = True
    """No CUDA graphs / compiled model (faster start, needed on CPU)."""
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    """GPUs per engine."""
    kwargs: dict[str, str | int | float | bool] = Field(default_factory=dict)
    """Extra ``vllm.LLM(...)`` keyword arguments, passed through verbatim."""


class OpenAIEngineConfig(StrictModel):
    """Any OpenAI-compatible /v1/completions server that returns token ids and logprobs."""

    type: Literal["openai"] = "openai"
    base_url: str = Field("http://127.0.0.1:8000/v1", pattern=r"^https?://")
    """Server base URL, up to and including /v1."""
    model: str = ""
    """``model`` field of requests ('' = the server's first model from /v1/models)."""
    api_key: str = ""
    """Bearer token, if the server wants one."""
    timeout_s: float = Field(600.0, gt=0)
    """Socket timeout of one request."""
    max_retries: int = Field(3, ge=0, le=100)
    """Retries of a request that failed to connect or got a 5xx, with backoff; then the worker stops."""
    reload: Literal["rlstream", "vllm", "none"] = "rlstream"
    """How new weights reach the server (docs/how-to/engines.md, "Which reload mode for which server"):
    ``rlstream`` = POST {uri, sha256, version, kind} to ``reload_path`` (rlstream's own server,
    ``producers.openai_server``, or a proxy of yours); ``vllm`` = a stock vLLM OpenAI server started
    with ``VLLM_SERVER_DEV_MODE=1``: ``collective_rpc reload_weights`` of the notice's
    ``metadata.hf_dir`` (``trainer.publish_hf``), prefix-cache reset and a weight-version handshake;
    ``none`` = the server is updated by someone else and the notice's version is trusted.
    ``post`` is read as ``rlstream`` (its old name)."""
    reload_path: str = "/rlstream/load_weights"
    """Path (relative to the host, not /v1) of the reload endpoint for ``reload = "rlstream"``."""
    reload_timeout_s: float = Field(600.0, gt=0, le=86_400)
    """Longest one reload call may take (``rlstream``: the POST; ``vllm``: vLLM's RPC timeout and
    the socket timeout); the other control calls (version check, cache reset) get at most 30 s."""
    version_check_s: float = Field(5.0, ge=0, le=3600)
    """``vllm``: a request starts only if the server's weight version was confirmed to be the
    engine's within this many seconds (re-read with ``GET /weight_info`` when older; always after a
    failed connection), so a server restarted underneath (base weights again) stops the worker
    instead of mislabelling trajectories. 0 = confirm only after each reload."""
    lora_name: str = Field("rlstream-lora", min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:-]+$")
    """``vllm``: name under which a LoRA adapter (``kind = "adapter"`` without an HF directory) is
    loaded with ``/v1/load_lora_adapter`` and then requested as ``model``."""

    @field_validator("reload", mode="before")
    @classmethod
    def _old_reload_name(cls, v):
        return "rlstream" if v == "post" else v


class SimEngineConfig(StrictModel):
    """A load generator, not a model (``libs/engines/sim.py``): continuous batching with a fixed
    time per decode step and heavy-tailed (lognormal) response lengths of random tokens. For
    benchmarks of the pipeline's scheduling; see docs/results/performance.md."""

    type: Literal["sim"] = "sim"
    token_latency_s: float = Field(0.01, gt=0, le=10)
    """Wall time of one decode step; every in-flight sample advances one token per step."""
    max_batch: int = Field(0, ge=0, le=1_000_000)
    """Most samples decoding at once (more wait in a queue); 0 = no limit beyond rollout.max_inflight."""
    median_tokens: int = Field(64, ge=1, le=1_000_000)
    """Median response length of the lognormal."""
    sigma: float = Field(1.0, ge=0, le=5)
    """Shape of the lognormal (0 = every response has ``median_tokens``)."""
    min_tokens: int = Field(1, ge=1)
    """Shortest response."""
    clip_tokens: int = Field(0, ge=0)
    """Longest response; 0 = the request's max_new_tokens (which always clips)."""
    long_fraction: float = Field(0.0, ge=0, le=1)
    """Share of samples that run to the clip: a few very long responses per batch."""
    seed: int = 0
    """Seeds the lengths (a function of seed and trajectory id, the same on every worker)."""
    load_delay_s: float = Field(0.0, ge=0)
    """Time ``load_weights`` takes (0 = instant)."""
    verify_weights: bool = True
    """Fetch the announced checkpoint and verify its sha256 before loading, as real engines do."""
    max_step_s: float = Field(0.05, gt=0, le=10)
    """Longest one ``step`` call blocks waiting for the next sample to finish."""


EngineConfig = plugin_union(HFEngineConfig, VLLMEngineConfig, OpenAIEngineConfig, SimEngineConfig)
