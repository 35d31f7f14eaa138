"""Configuration of the prompt feed, the rollout workers and their environments.

Strict pydantic models (unknown keys are errors); every field has bounds and a docstring. The
engine sections are the generation engines' own (``libs.engines.config``, re-exported here).
Nothing here imports torch, vLLM or an HTTP client.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from libs.datasets import DatasetFields
from libs.engines.config import (  # noqa: F401  (re-exported: the rollout section's engines)
    EngineConfig,
    HFEngineConfig,
    OpenAIEngineConfig,
    SimEngineConfig,
    VLLMEngineConfig,
)
from pipeline.config import StrictModel
from pipeline.topology import DEFAULT as DEFAULT_IDENTITY


class FeedConfig(DatasetFields):
    """The prompt feed: its dataset (the fields of ``DatasetFields``), epochs, pacing and resume state."""

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
    on a long-tailed workload it measured slower than ``all`` (docs/results/performance.md)."""
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
    mode: Literal["rl", "sft"] = "rl"
    """``rl``: publish prompts to rl.prompts for the rollout workers. ``sft``: a supervised stage:
    each record is a chat conversation (``messages`` in OpenAI format, ``tool_calls`` on assistant
    turns, ``tool`` turns), rendered as a live episode of its task would be and written straight to
    rl.scored as a demonstration (a group of one, assistant tokens trained, everything else masked;
    ``producers.sft``), for a trainer with ``[trainer.loss] type = "sft"``. No rollout or reward
    worker is needed; resume is exact as in ``rl`` mode. Needs a chat template."""


class EnvConfig(StrictModel):
    """Multi-turn environments (environment-level async): which tasks run as episodes."""

    tasks: dict[str, str] = Field(default_factory=lambda: {"guess_number": "guess_number"})
    """Task name -> environment: a built-in name (``guess_number``, ``tools``, ``textarena``, ``verifiers``) or ``module:Class``."""
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
    stop: list[str] | None = None
    """Strings (single tokens) that end a model turn, besides EOS. Unset: a newline, except in
    environments that render the chat themselves (``tools``), whose turns end at EOS, the chat
    template's end-of-message; set (``[]`` included), it applies to every environment."""
    workers: int = Field(4, ge=1, le=1024)
    """Threads running ``env.step`` so a slow environment never blocks generation."""
    step_timeout_s: float = Field(60.0, gt=0, le=86_400)
    """Longest one ``env.step`` may run. A step past it ends its episode with a dead letter
    (error_type ``env_timeout``; one that raises: ``env_error``) and its thread is abandoned and
    replaced, so the other episodes go on. A tool environment's own per-call limit
    (``call_timeout_s``) should be well below it."""
    turn_sync: bool = False
    """A baseline for benchmarks, not a mode to run jobs in: behave like a turn-synchronous batch
    framework. Ended turns' ``env.step`` calls wait until no sample is generating, then run
    together; generation (next turns and new samples) waits until every one of them has returned.
    False (the default) is environment-level async: each episode's step runs as soon as its turn
    ends while the engine goes on with the others (``rlstream bench agentic`` compares the two)."""


class RolloutConfig(StrictModel):
    group_id: str = Field(DEFAULT_IDENTITY.group("rollout"), min_length=1)
    """Consumer group of the rollout workers on rl.prompts (``rlstream-rollout``; ``rlstream run``
    names it after the job: ``pipeline.topology.RunIdentity``)."""
    worker_id: str = ""
    """Id in trajectories, metrics and client ids; '' = host-pid."""
    heartbeat_interval_ms: int = Field(500, ge=100, le=3_600_000)
    """``heartbeat.interval.ms`` of the prompt consumer (a ``kafka.consumer`` setting wins): a member
    learns of a rebalance only from a heartbeat answer and a cooperative rebalance takes two rounds,
    so partitions that move (a worker joins or leaves) are unowned for about twice this long.
    librdkafka's 3000 held prompts back ~3 s when the second worker joined (docs/how-to/multi-machine.md,
    "Rebalances"). Must be below ``session_timeout_ms``."""
    session_timeout_ms: int = Field(15_000, ge=1000, le=3_600_000)
    """``session.timeout.ms`` of the prompt consumer (a ``kafka.consumer`` setting wins): how long the
    prompts of a worker that died without leaving (kill -9, a lost node) stay unowned, and how long
    a rebalance started by its restart (a new member, for a dynamic member) waits for the dead
    member; a static member (``group_instance_id``, ``slots``) restarted within it takes its
    partitions back at once, so it then bounds only the wait for a worker that does not come back.
    librdkafka's 45000 held a three-node chaos run's prompts back ~45 s after each rollout kill
    (docs/results/reliability.md). The heartbeat runs on librdkafka's own thread, so a busy
    engine does not miss it; the broker's ``group.min.session.timeout.ms`` (6000) is the floor."""
    group_instance_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]+$")
    """Static membership (``group.instance.id``) of a worker that a supervisor restarts, one id per
    worker and stable across its restarts (its ``worker_id``, say): killed and restarted within
    ``session_timeout_ms`` it takes its partitions back with no rebalance and without waiting for
    the session timeout (in the availability chaos run without a standby, one kill a minute: at most
    1.5 s of trainer idle per rollout kill instead of 5.7 s, ETTR 0.942-0.955 instead of 0.898;
    docs/results/reliability.md, "Availability"). The price: a static member
    does not leave the group when it stops cleanly either, so the partitions of a worker removed by
    hand, or lost for good, wait out ``session_timeout_ms``; leave it None (a dynamic member, the
    default) for workers you add and remove by hand. Under ``rlstream run`` (one config for every
    worker) use ``slots`` instead, which picks an id per worker; ``slots`` > 0 and this together are
    refused."""
    slots: int = Field(0, ge=0, le=256)
    """Static membership by slot (``producers.slots``): with N > 0 a worker takes the first free one of
    N slot locks in ``<run_dir>/rollout-slots`` and joins as ``group.instance.id`` rollout-slot-<i>;
    while all N are held it waits as a warm spare (engine built, weights followed) and takes the slot
    of a worker that dies, with its partitions and no rebalance. 0 (the default): dynamic members.
    ``job.rollout_standby`` sets it and runs one spare; set to the number of rollout workers without
    a spare, every worker is a static member and a restarted one takes back the slot it left (the
    availability a standby gives rollout kills, without its process: docs/how-to/multi-machine.md,
    "Rebalances")."""
    engine: EngineConfig = HFEngineConfig()
    """The generation engine: ``type`` = hf | vllm | openai | sim, or a plug-in ``package.module:Class``."""
    max_inflight: int = Field(32, ge=1, le=100_000)
    """Most samples the worker keeps in its engine at once (queue scheduling)."""
    prefetch_samples: int | None = Field(None, ge=0, le=1_000_000)
    """Admitted samples the worker keeps queued beyond its free slots (None = ``max_inflight``), so
    a slot that frees starts the next sample at once instead of waiting for a fetch from the
    broker (measured on the sim bench, uniform k = 1: 32 samples/s with 0, see docs/results/performance.md).
    0 takes only what can start now; a larger look-ahead holds work other workers could do."""
    queue_samples: int | None = Field(None, ge=1, le=10_000_000)
    """Samples of consumed, not yet admitted prompt messages the worker keeps in memory (None =
    ``16 * max_inflight``), shared evenly by its partitions; a partition whose share is full is
    paused (a partition with nothing queued always takes a message, so inadmissible groups queued
    from one partition never keep another partition's admissible ones out). Pausing is the
    exception, not the flow control: librdkafka drops a paused partition's fetched messages and a
    resume waits for a new fetch, which left 13-18% of the decode slots idle on the sim bench when
    the worker paused whenever its look-ahead was full (docs/results/performance.md).
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
    Off by default; measured on the sim long-tail bench in docs/results/performance.md."""
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
    waste comes from (docs/results/performance.md). ``all``: both."""
    restart_margin: int | None = Field(None, ge=0, le=100)
    """Versions of look-ahead for regenerating a message's held samples when its last sample
    finishes (``restart_scope`` ``all``/``finished``): those the trainer would drop at the loaded
    version + this margin are generated again before the message is published, as long as the last
    sample itself would train. Under the token rule with ``interrupt`` reloads the same look-ahead
    also applies at every weight load, so such samples run again beside the sample their message
    still waits for instead of after it (k = 2 bench: 0.71 -> 0.75 of ideal, stale drops 14 -> 0-6).
    None = 1 at k >= 2, else 0. Measured on the sim long-tail bench
    (docs/results/performance.md): at k = 2, token rule, stale drops 81 -> 12 at the same throughput; at
    k = 1 a margin of 1 regenerated 232 samples to save 68 drops and lost about 10% throughput
    (the trainer, starved at k = 1, mostly trains a group at the version it was loaded with)."""
    overprovision: int = Field(0, ge=0, le=64)
    """Past the group barrier (opt-in; docs/reference/losses.md "Over-provisioned groups"): start this many
    samples per group beyond ``rl.group_size``; the first ``group_size`` to finish are the group
    (numbered 0.. in the order they finished) and the rest are aborted, so a group no longer waits
    for its slowest sample. It changes what is trained: the slowest samples of every group are never
    seen (a bias toward short responses, documented there with the sim and real-model figures).
    Single-turn prompts whose message carries the whole group only; 0 = off (every sample is kept).
    Counted in ``overprovision_aborted_samples`` and ``overprovision_discarded_tokens``.
    With ``overprovision_tail = "train"`` nothing is aborted and nothing is dropped (below)."""
    overprovision_tail: Literal["abort", "train"] = "abort"
    """What becomes of an over-provisioned group's last ``overprovision`` samples to finish.
    ``abort``: as above. ``train``: they run to the end and are published too, as the group's tail
    (the group is published with ``group_size + overprovision`` samples and a quorum of
    ``group_size``): the trainer trains the first ``group_size`` as the group as soon as they are
    in, and each tail sample in a later step with the baseline of the samples already trained, so
    every sample drawn is trained (or dropped as stale by the usual bound) and none is selected out
    by its length (docs/reference/losses.md "Over-provisioned groups")."""
    poll_timeout_s: float = Field(0.05, gt=0, le=10)
    """Longest a loop iteration waits on Kafka when the engine is idle."""
    metrics_interval_s: float = Field(2.0, gt=0)
    """How often a MetricEvent goes to rl.metrics."""
    prometheus_port: int = Field(0, ge=0, le=65535)
    """Serve Prometheus /metrics on this port (0 = off)."""
    exit_when_idle_s: float = Field(0.0, ge=0)
    """Stop after this long with nothing to do and no new prompts (0 = run forever). The time
    counts from the worker's latest partition assignment; a worker the group never gives a
    partition (more workers than prompt partitions) stops after ``liveness.startup_timeout_s``."""
    env: EnvConfig = EnvConfig()
    """Multi-turn environments."""

    @model_validator(mode="after")
    def _one_static_id(self):
        if self.slots and self.group_instance_id:
            raise ValueError(
                f"rollout.group_instance_id={self.group_instance_id!r} and rollout.slots={self.slots} both name the "
                "worker's static member id: set one (slots picks an id per worker on one machine)"
            )
        return self

    @model_validator(mode="after")
    def _heartbeat_below_session(self):
        if self.heartbeat_interval_ms >= self.session_timeout_ms:
            raise ValueError(
                f"rollout.heartbeat_interval_ms={self.heartbeat_interval_ms} must be below "
                f"rollout.session_timeout_ms={self.session_timeout_ms}"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _default_engine_type(cls, data):
        """A partial ``[rollout.engine]`` table without ``type`` means the hf engine."""
        if isinstance(data, dict) and isinstance(data.get("engine"), dict) and "type" not in data["engine"]:
            data = {**data, "engine": {**data["engine"], "type": "hf"}}
        return data
