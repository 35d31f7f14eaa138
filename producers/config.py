"""Configuration of the prompt feed, the rollout workers, their engines and environments.

Strict pydantic models (unknown keys are errors); every field has bounds and a docstring. The
engine is a discriminated union on ``type`` (``hf`` | ``vllm`` | ``openai``, and ``sim``, a load
generator for benchmarks). Nothing here imports torch, vLLM or an HTTP client.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.config import StrictModel, plugin_union
from pipeline.topology import DEFAULT as DEFAULT_IDENTITY


class FeedConfig(StrictModel):
    source: Path | None = None
    """Dataset: a .jsonl/.json file, a .parquet file, or a directory saved by HF ``datasets``."""
    format: Literal["auto", "jsonl", "parquet", "hf_disk"] = "auto"
    """How to read ``source``; ``auto`` picks by suffix (a directory is ``hf_disk``)."""
    name: str = Field("default", min_length=1, max_length=100, pattern=r"^[A-Za-z0-9._-]+$")
    """Feed name: resume state on rl.control is kept per name (one feed per topic prefix)."""
    epochs: int = Field(1, ge=1, le=100_000)
    """Passes over the dataset. group_seq keeps counting across epochs."""
    shuffle_seed: int | None = None
    """If set, each epoch is shuffled with ``seed + epoch`` (deterministic, so resume is exact)."""
    rate: float = Field(0.0, ge=0.0)
    """Most groups published per second; 0 = no limit."""
    limit: int = Field(0, ge=0)
    """Feed at most this many groups in all (group_seq < limit; 0 = all ``epochs``). A total over
    every run of this feed, like ``epochs``: a restarted or re-run feed continues up to it and
    never past it, so a crash never changes what the job is fed. Raise it to feed more."""
    dispatch: Literal["all", "paced"] = "all"
    """``all``: publish every group as fast as ``rate`` allows, then exit. ``paced``: publish a group
    only once the rollout workers may start it (admission, following rl.control) and put each
    message on the prompts partition with the shortest backlog (producers.pacing); runs until every
    group is published. The examples and ``rlstream demo`` use ``paced`` (their feeds are unbounded);
    on a long-tailed workload it measured slower than ``all`` (docs/benchmarks.md)."""
    paced_backlog: int = Field(8, ge=1, le=10_000)
    """``paced``: most of the feed's messages per prompts partition not yet committed by the rollout
    workers (queued or being generated). A worker commits a partition in offset order, so one long
    sample holds back the count of everything behind it: 1 and 4 starved the workers on the
    long-tailed sim benchmark (56 and 62 samples/s at k = 4, against 80 with 8)."""
    paced_lead_steps: int = Field(1, ge=0, le=1000)
    """``paced``: publish up to this many steps' worth of groups (``rl.groups_per_step`` each) beyond
    what admission allows at the newest version. The workers hold them (their own admission check
    stays the hard bound) and start them the moment they load the version that admits them, instead
    of waiting for the feed to see that version and publish (sim benchmark, long tail, k = 4: 62
    samples/s with 0, 80 with 1). 0 = publish only what is admissible now."""
    checkpoint_every: int = Field(64, ge=1, le=1_000_000)
    """Publish the feed state to rl.control after this many groups (and at the end)."""
    id_field: str = "id"
    """Record field with the prompt id (falls back to ``prompt_id``, then to the record's index)."""
    prompt_field: str = "prompt"
    """Record field with the prompt text (falls back to ``text``)."""
    messages_field: str = "messages"
    """Record field with chat messages (OpenAI format); such a record needs no prompt text."""
    task_field: str = "task"
    """Record field with the task name (falls back to ``default_task``)."""
    reference_field: str = "reference"
    """Record field with the verifier data; if absent, every field except id/prompt/task/n is used."""
    default_task: str = "default"
    """Task of records that name none."""


class HFEngineConfig(StrictModel):
    """transformers engine: our own batched decode loop over the HF model, CPU or GPU."""

    type: Literal["hf"] = "hf"
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?|mps)$")
    """torch device; ``auto`` = cuda if available, else cpu."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and activations dtype."""
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
    """How new weights reach the server (docs/engines.md, "Which reload mode for which server"):
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
    """A load generator, not a model (``producers/engines/sim.py``): continuous batching with a fixed
    time per decode step and heavy-tailed (lognormal) response lengths of random tokens. For
    benchmarks of the pipeline's scheduling; see docs/benchmarks.md."""

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


class EnvConfig(StrictModel):
    """Multi-turn environments (environment-level async): which tasks run as episodes."""

    tasks: dict[str, str] = Field(default_factory=lambda: {"guess_number": "guess_number"})
    """Task name -> environment: a built-in name (``guess_number``) or ``module:Class``."""
    options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Task name -> options handed to that task's environment (its ``config``)."""
    import_dirs: list[Path] = Field(default_factory=list, max_length=64)
    """Directories where the module of a ``module:Class`` environment is looked up first (by name;
    sys.path is not changed), then the import path. ``rlstream run`` adds the job file's
    directory, as it does for ``reward.import_dirs``."""
    max_turns: int = Field(8, ge=1, le=1000)
    """Most model turns per episode."""
    max_turn_tokens: int = Field(16, ge=1, le=65536)
    """Most tokens the model may produce in one turn."""
    stop: list[str] = Field(default_factory=lambda: ["\n"])
    """Strings (single tokens) that end a model turn, besides EOS."""
    workers: int = Field(4, ge=1, le=1024)
    """Threads running ``env.step`` so a slow environment never blocks generation."""


class RolloutConfig(StrictModel):
    group_id: str = Field(DEFAULT_IDENTITY.group("rollout"), min_length=1)
    """Consumer group of the rollout workers on rl.prompts (``rlstream-rollout``; ``rlstream run``
    names it after the job: ``pipeline.topology.RunIdentity``)."""
    worker_id: str = ""
    """Id in trajectories, metrics and client ids; '' = host-pid."""
    engine: EngineConfig = HFEngineConfig()
    """The generation engine: ``type`` = hf | vllm | openai | sim, or a plug-in ``package.module:Class``."""
    max_inflight: int = Field(32, ge=1, le=100_000)
    """Most samples the worker keeps in its engine at once (queue scheduling)."""
    prefetch_samples: int | None = Field(None, ge=0, le=1_000_000)
    """Admitted samples the worker keeps queued beyond its free slots (None = ``max_inflight``), so
    a slot that frees starts the next sample at once instead of waiting for a fetch from the
    broker (measured on the sim bench, uniform k = 1: 32 samples/s with 0, see docs/benchmarks.md).
    0 takes only what can start now; a larger look-ahead holds work other workers could do."""
    queue_samples: int | None = Field(None, ge=1, le=10_000_000)
    """Samples of consumed, not yet admitted prompt messages the worker keeps in memory (None =
    ``16 * max_inflight``), shared evenly by its partitions; a partition whose share is full is
    paused (a partition with nothing queued always takes a message, so inadmissible groups queued
    from one partition never keep another partition's admissible ones out). Pausing is the
    exception, not the flow control: librdkafka drops a paused partition's fetched messages and a
    resume waits for a new fetch, which left 13-18% of the decode slots idle on the sim bench when
    the worker paused whenever its look-ahead was full (docs/benchmarks.md).
    Queued messages are not admitted: a revoked partition's queue goes to its next owner."""
    max_new_tokens: int = Field(64, ge=1, le=1_000_000)
    """Default response budget per sample (a prompt may lower or raise it); multi-turn: whole episode."""
    max_prompt_tokens: int = Field(1024, ge=1, le=10_000_000)
    """Longer prompts go to rl.dlq with error_type too_long."""
    chat_template: Literal["auto", "always", "never"] = "auto"
    """Render prompts with the tokenizer's chat template: ``auto`` for prompts that carry chat
    ``messages``, ``always`` also for plain text (as one user message), ``never`` (text as is)."""
    system_prompt: str = ""
    """With a chat template: a system message put first when the conversation has none."""
    add_generation_prompt: bool = True
    """With a chat template: end the rendered prompt with the assistant turn's opening."""
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    """Sampling temperature; 0 = greedy. Logprobs are log_softmax(raw_logits / T) (T = 1 when greedy)."""
    reload_policy: Literal["drain", "interrupt"] = "drain"
    """On a new version: ``drain`` finishes in-flight samples first; ``interrupt`` aborts them, loads,
    and resumes them under the new weights (partial rollouts with version_min < version_max)."""
    stale_restarts: int = Field(0, ge=0, le=100)
    """How many times a single-turn sample that a new version makes certain to be dropped as stale
    (the trainer trains at that version or later) is generated again from its prompt under the new
    weights instead of being finished or published and then dropped; which samples:
    ``restart_scope``. In flight, under ``interrupt`` reloads and the sample rule
    (``version - version_min > k``), its tokens so far are discarded (``restarted_samples``,
    ``restart_discarded_tokens``). 0 = never. A sample restarted this many times is finished as
    before, so a sample longer than k steps cannot loop. Never applied to multi-turn samples.
    Off by default; measured on the sim long-tail bench in docs/benchmarks.md."""
    restart_scope: Literal["all", "finished", "in_flight"] = "all"
    """Which samples ``stale_restarts`` restarts. ``in_flight``: the samples an ``interrupt`` reload
    catches (above). ``finished`` (any reload policy, either staleness rule): a prompt message's
    finished single-turn samples are held until its last sample finishes (the trainer trains a
    group only once it is complete, so this delays nothing), and a held sample that a weight load
    makes certain to be dropped (sample rule: ``version - version_min > k``; token rule: every token
    too old, ``version - version_max > k``) is generated again from its prompt, counted in
    ``regenerated_samples`` and ``regenerate_discarded_tokens``; so is one the trainer will likely
    drop (``restart_margin``) when the message's last sample finishes and will itself train.
    Those are the short samples of a group whose long sample is still generating, where most stale
    waste comes from (docs/benchmarks.md). ``all``: both."""
    restart_margin: int | None = Field(None, ge=0, le=100)
    """Versions of look-ahead for regenerating a message's held samples when its last sample
    finishes (``restart_scope`` ``all``/``finished``): those the trainer would drop at the loaded
    version + this margin are generated again before the message is published, as long as the last
    sample itself would train. Under the token rule with ``interrupt`` reloads the same look-ahead
    also applies at every weight load, so such samples run again beside the sample their message
    still waits for instead of after it (k = 2 bench: 0.71 -> 0.75 of ideal, stale drops 14 -> 0-6).
    None = 1 at k >= 2, else 0. Measured on the sim long-tail bench
    (docs/benchmarks.md): at k = 2, token rule, stale drops 81 -> 12 at the same throughput; at
    k = 1 a margin of 1 regenerated 232 samples to save 68 drops and lost about 10% throughput
    (the trainer, starved at k = 1, mostly trains a group at the version it was loaded with)."""
    poll_timeout_s: float = Field(0.05, gt=0, le=10)
    """Longest a loop iteration waits on Kafka when the engine is idle."""
    metrics_interval_s: float = Field(2.0, gt=0)
    """How often a MetricEvent goes to rl.metrics."""
    prometheus_port: int = Field(0, ge=0, le=65535)
    """Serve Prometheus /metrics on this port (0 = off)."""
    exit_when_idle_s: float = Field(0.0, ge=0)
    """Stop after this long with nothing to do and no new prompts (0 = run forever)."""
    env: EnvConfig = EnvConfig()
    """Multi-turn environments."""

    @model_validator(mode="before")
    @classmethod
    def _default_engine_type(cls, data):
        """A partial ``[rollout.engine]`` table without ``type`` means the hf engine."""
        if isinstance(data, dict) and isinstance(data.get("engine"), dict) and "type" not in data["engine"]:
            data = {**data, "engine": {**data["engine"], "type": "hf"}}
        return data
