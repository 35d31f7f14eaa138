"""Configuration of scoring: which reward functions score which task, the pool that runs them
(processes or threads, the per-call time limit), where ``module:function`` rewards are imported
from, and the code sandbox's limits. The reward workers' section (``consumers.reward.config``)
and the evaluator read it. Only validation lives here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from pipeline.config import StrictModel


class RewardSpec(StrictModel):
    """One reward function in a weighted sum."""

    name: str = Field(min_length=1)
    """A built-in (exact_match, regex, format, math, code, http, openai_judge) or ``module:function``."""
    weight: float = Field(1.0, ge=-1e6, le=1e6)
    """Multiplies this function's reward before the terms are summed."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the built-in's factory, or extra keyword arguments of ``module:function``."""


class SandboxConfig(StrictModel):
    """Default limits of the code-execution sandbox (the ``code`` reward may override them)."""

    wall_s: float = Field(5.0, gt=0, le=600)
    """Wall-time limit of one program run (one test case)."""
    cpu_s: int = Field(2, ge=1, le=600)
    """RLIMIT_CPU of the program, seconds."""
    memory_mb: int = Field(512, ge=32, le=65536)
    """RLIMIT_AS of the program (address space), MiB."""
    max_processes: int = Field(16, ge=1, le=4096)
    """RLIMIT_NPROC: processes (and threads) the program may have at once."""
    max_output_bytes: int = Field(1 << 20, ge=1024, le=1 << 30)
    """Largest stdout (and stderr) kept; a program that writes more is killed and fails."""
    max_open_files: int = Field(64, ge=16, le=65536)
    """RLIMIT_NOFILE of the program."""
    network: Literal["deny", "allow"] = "deny"
    """deny: run the program in a new, empty network namespace where the OS allows it."""
    require_isolation: bool = False
    """True: fail the run (setup error) when network isolation, the uid drop or (for isolation =
    "auto") bubblewrap is unavailable."""
    uid_base: int = Field(200_000, ge=1000, le=4_000_000_000)
    """As root, programs run as uid ``uid_base + pid of the scoring process`` (unique, no login)."""
    python: str | None = None
    """Interpreter that runs the programs. None: the worker's own."""
    python_flags: list[str] = Field(default_factory=lambda: ["-I"])
    """Flags given to that interpreter (``-I``: isolated mode)."""
    isolation: Literal["auto", "bwrap", "namespaces"] = "auto"
    """auto: bubblewrap (new user/pid/net/ipc/uts namespaces, seccomp filter, read-only minimal
    filesystem with a private work dir) when it works here, else a loud fallback to namespaces
    (a warning, and ``fallback`` in each run's isolation details; with require_isolation the run
    fails instead). bwrap: bubblewrap or fail. namespaces: rlimits, a network namespace and the uid
    drop only (no seccomp, host filesystem readable)."""
    seccomp: bool = True
    """Under bubblewrap, load the seccomp filter (``libs.rewards.seccomp``; needs libseccomp)."""
    bwrap: str = Field("bwrap", min_length=1)
    """The bubblewrap executable: a name looked up on PATH, or a path."""
    cgroup_parent: str | None = Field(None, pattern=r"^/")
    """An absolute cgroup v2 directory, writable, with memory and pids in its ``cgroup.subtree_control``;
    each run gets a child cgroup there with memory.max = memory_mb, pids.max and no swap. None:
    the worker's own cgroup if it qualifies, else these limits are off (logged once)."""


class ScoringConfig(StrictModel):
    """What scores a trajectory: the reward functions per task and the pool that runs them."""

    timeout_s: float = Field(10.0, gt=0, le=3600)
    """Wall-time limit of one reward call (all terms for one trajectory); past it -> DLQ reward_timeout."""
    executor: Literal["process", "thread"] = "process"
    """process: a pool of processes (CPU-bound verifiers; a hung call is killed). thread: threads
    in the worker (cheap rewards; a hung call is abandoned, not killed)."""
    pool_size: int = Field(2, ge=1, le=1024)
    """Processes (or threads) scoring in parallel."""
    default: list[RewardSpec] = Field(default_factory=lambda: [RewardSpec(name="exact_match")])
    """Reward for tasks not in ``tasks``: weighted sum of these. Empty: such tasks go to the DLQ."""
    tasks: dict[str, list[RewardSpec]] = Field(default_factory=dict)
    """Task name -> weighted sum of reward functions for that task."""
    import_dirs: list[Path] = Field(default_factory=list, max_length=64)
    """Directories where the module of a ``module:function`` reward is looked up first (by name;
    sys.path is not changed), then the import path (PYTHONPATH). ``rlstream run`` adds the job
    file's directory, so a reward module kept beside the job file is found by the job's roles and
    by roles started by hand with the run's config.toml. Relative paths are taken from the
    working directory."""
    sandbox: SandboxConfig = SandboxConfig()
    """Limits of the code-execution sandbox."""


def scoring_part(cfg) -> ScoringConfig:
    """The ``ScoringConfig`` part of a section that extends it (the reward workers' ``reward``)."""
    if type(cfg) is ScoringConfig:
        return cfg
    return ScoringConfig.model_validate(cfg.model_dump(mode="json", include=set(ScoringConfig.model_fields)))
