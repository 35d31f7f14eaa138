"""The Python API: ``from rlstream import Job``, for notebooks and scripts.

A ``Job`` is what ``rlstream run`` runs, held as an object: a job file (``Job("job.toml")``) or
the same settings built in code (``Job(config={...}, name="sums")``), resolved by
``rlstream.job.resolve`` into the same topics (``<name>.``), consumer groups and run dir
(``<run_dir>/<name>``). So a notebook job and a file job of the same name are one job: either
resumes the other. Its methods are the commands a job is used with, reusing their functions:

* ``run(steps)``: ``rlstream run`` (``rlstream.job.launch``): every role as a supervised process,
  until the trainer reaches ``steps``; returns the report (``report.json``). Running it again
  resumes the job.
* ``status()``: the snapshot ``rlstream status --json`` prints (``rlstream.status``).
* ``export(version, dest)``: ``rlstream export`` (``rlstream.export``), an HF model directory.
* ``eval(version)``: ``rlstream eval --version N`` / ``--latest`` (``consumers.eval.worker``), once.
* ``samples(...)``: ``rlstream samples``: what the model wrote, read from the scored topic.
* ``fork(name, from_version)``: a ``Job`` for ``rlstream run --fork NAME --from-version N``.
* ``restart(steps)``: ``rlstream run --restart``; ``remove()``: ``rlstream jobs rm``.

Every method reaches Kafka the way ``rlstream run`` does (``rlstream.job.connected``): the
configured cluster, else the local broker, started by the first call that needs it and kept for
the object's life: stopped by ``close()`` (or the end of a ``with Job(...) as job:`` block, or
the interpreter's exit) unless it was already running or ``keep_broker``. A launch says the same
lines as the CLI (``resuming ... changed: ...``) and refuses the same way: mistakes raise the
typed errors of ``pipeline.errors`` (``ConfigError``, ``JobChanged``, ``NothingToTrain``,
``BrokerUnreachable``, ``UnknownVersion``, ``JobFailed``); nothing here calls ``sys.exit`` or
installs signal handlers.

What this is not: a second launcher or a config format of its own. It holds no state but the
job's settings: the job's state is in Kafka and its run dir, as for the CLI.
"""

from __future__ import annotations

import copy
import json
import threading
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


class Job:
    """A job: a job file, or its settings in code. Resolved (and checked) at once.

    ``path``: a job file (the config plus a ``[job]`` section, as for ``rlstream run``).
    ``config``: the same settings as a dict (``{"job": {...}, "trainer": {...}}``), instead of a
    file; layered like one: the dict < ``RLSTREAM_*`` environment < ``sets``.
    ``name``: the job's name (default ``job.name``, else the file's name).
    ``sets``: ``section.key=value`` overrides, as ``--set``.
    ``keep_broker``: leave a local broker a method started running (as ``--keep-broker``).
    """

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        config: Mapping[str, Any] | None = None,
        name: str | None = None,
        sets: Iterable[str] = (),
        keep_broker: bool = False,
    ):
        from pipeline.errors import ConfigError

        if path is not None and config is not None:
            raise ConfigError(
                "give Job a job file or a config dict, not both (override a file's values with sets=[...])"
            )
        if path is None and not name and not ((config or {}).get("job") or {}).get("name"):
            raise ConfigError('a job built in code needs a name: Job(config=..., name="...")')
        self.path = Path(path) if path is not None else None
        self.sets = list(sets)
        self.keep_broker = keep_broker
        self._preset = copy.deepcopy(dict(config or {}))
        self._name = name
        self._fork: tuple[str, int | None] | None = None
        """(parent's name, version) of a Job made by ``fork``: its ``run`` forks, then resumes."""
        self._bootstrap: str | None = None
        self._broker_stop = None
        self._config = self._resolve()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the local broker this object started (not one that was running, nor with
        ``keep_broker``). The object can still be used: the next call starts one again."""
        stop, self._broker_stop, self._bootstrap = self._broker_stop, None, None
        if stop is not None:
            stop()

    def _resolve(self, flags: dict | None = None):
        """The job's config as ``rlstream run`` resolves it (before the broker is known)."""
        from rlstream.config import record_job_dir
        from rlstream.job import resolve

        if self._fork is None:
            cfg = resolve(self.path, self.sets, self._preset, self._name, flags)
        else:  # a fork's settings, its base model not exported yet (its first run does that)
            from rlstream.job import plan

            base = (
                None if self._fork[1] == 0 else (lambda run_dir: {"type": "pretrained", "path": str(run_dir / "base")})
            )
            cfg = plan(self.path, self.sets, self._preset, self._name, flags, model=base)[0]
        record_job_dir(cfg, self.path)
        return cfg

    # -- what the job is ---------------------------------------------------------------------
    @property
    def config(self):
        """The validated ``rlstream.config.Config`` (the last ``run``'s, ``steps`` included)."""
        return self._config

    @property
    def name(self) -> str:
        return self._config.job.name

    @property
    def run_dir(self) -> Path:
        """``<run_dir>/<name>``: resolved config, logs, report.json, plots, checkpoints."""
        return Path(self._config.run_dir)

    @property
    def report(self) -> dict | None:
        """The newest run's report (``<run dir>/report.json``), None before the first run."""
        path = self.run_dir / "report.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def __repr__(self) -> str:
        return f"Job(name={self.name!r}, run_dir={str(self.run_dir)!r})"

    # -- what it does ------------------------------------------------------------------------
    def run(self, steps: int | None = None, *, live: bool | None = None, keep_broker: bool | None = None) -> dict:
        """Run the job until the trainer reaches ``steps`` (default ``trainer.max_steps``), as
        ``rlstream run``; running it again resumes it (a higher ``steps`` trains further). Returns
        the report (also ``<run dir>/report.json``). ``live``: the live view (default: on a
        terminal). JobFailed (with ``.report``) when a role failed; Ctrl-C stops every role, writes
        the report and raises KeyboardInterrupt."""
        return self._launch(steps, live, keep_broker)

    def restart(self, steps: int | None = None, *, live: bool | None = None) -> dict:
        """Start the job over, as ``rlstream run --restart``: its topics, consumer groups and run dir
        are deleted (said first; JobAlreadyRunning while it runs), then it runs from scratch."""
        return self._launch(steps, live, None, restart=True)

    def remove(self) -> None:
        """Delete the job's topics, consumer groups, run dir and checkpoint store, as ``rlstream jobs
        rm`` (JobAlreadyRunning while it runs)."""
        from rlstream.jobs import remove

        with self._kafka() as cfg:
            remove(cfg, _say)

    def fork(self, name: str, from_version: int | None = None, *, sets: Iterable[str] = ()) -> Job:
        """A new job ``name`` with this job's settings (and ``sets`` over them) whose base model is
        version ``from_version`` (default: the newest; 0: this job's base model) of this job, as
        ``rlstream run --fork NAME --from-version N``. Nothing runs until its ``run()``; running it
        again resumes the fork."""
        from pipeline.errors import ConfigError

        if not name or name == self.name:
            raise ConfigError(f"fork({name!r}): the fork needs a name of its own (this job is {self.name})")
        child = Job.__new__(Job)
        child.path, child.sets, child.keep_broker = self.path, [*self.sets, *sets], self.keep_broker
        child._preset, child._name = copy.deepcopy(self._preset), name
        child._fork = (self.name, from_version)
        child._bootstrap, child._broker_stop = None, None
        child._config = child._resolve()
        return child

    def _launch(self, steps, live, keep_broker, restart: bool = False) -> dict:
        from pipeline.errors import ConfigError, JobFailed
        from rlstream.job import launch

        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ConfigError(f"steps={steps!r}: give a positive whole number of trainer steps")
        flags = {"trainer.max_steps": steps} if steps else {}
        self._config = self._resolve(flags)
        keep = self.keep_broker if keep_broker is None else keep_broker
        self._ensure_broker(keep)
        fork = {} if self._fork is None else {"fork": self.name, "from_version": self._fork[1]}
        name = self._name if self._fork is None else self._fork[0]
        report = launch(self.path, self.sets, preset=self._preset, name=name, flags=flags, keep_broker=keep,
                        live=live, restart=restart, **fork)  # fmt: skip
        if report["status"] == "interrupted":
            raise KeyboardInterrupt(
                f"job {self.name}: interrupted; every role stopped; report {self.run_dir / 'report.json'}"
            )
        if report["status"] != "ok":
            raise JobFailed(
                f"job {self.name}: {report['status']} at step {report.get('steps_completed', 0)} of "
                f"{report.get('steps_requested')}; logs in {self.run_dir / 'logs'}",
                report,
            )
        return report

    def status(self, interval: float = 2.0) -> dict:
        """What ``rlstream status --json`` shows: lag per stage (records and versions), trainer and
        rollout versions, throughput over ``interval`` seconds, DLQ counts, eval, workers."""
        from rlstream.status import StatusReader

        with self._kafka() as cfg:
            reader = StatusReader(cfg)
            try:
                return reader.snapshot(interval)
            finally:
                reader.close()

    def export(self, version: int | None = None, dest: str | Path | None = None) -> Path:
        """Write a published version (default: the newest still in the store) as a Hugging Face
        model directory, as ``rlstream export``; ``dest`` defaults to ``<run dir>/export/v<N>``.
        UnknownVersion (listing the versions there are) when it is not there."""
        from pipeline.versions import find_update
        from rlstream.export import export

        with self._kafka() as cfg:
            if dest is None:
                version = find_update(cfg, version)["version"]
                dest = self.run_dir / "export" / f"v{version}"
            export(cfg, Path(dest), version)
        return Path(dest)

    def eval(self, version: int | None = None) -> dict:
        """Evaluate one version (default: the newest published; 0 is the base model) once on the
        held-out set (``eval.source``, or the job's ``dataset.held_out`` split), as ``rlstream eval
        --version N`` / ``--latest``: ``version``, ``eval_pass_at_1``, ``eval_reward_mean``, counts
        and ``answers_file``. It runs in this process (the model is loaded here)."""
        from consumers.eval.worker import Evaluator
        from pipeline.errors import ConfigError

        if self._config.eval.source is None:
            raise ConfigError(f"job {self.name} has no held-out set: set eval.source, or job.dataset.held_out > 0")
        from producers.envs import make_env

        with self._kafka() as cfg:
            results = _run_off_main_thread(Evaluator(cfg, version, latest=version is None, envs=make_env))
        return results[-1]

    def samples(self, n: int = 10, *, version: int | None = None, order: str = "newest") -> list[dict]:
        """What the model wrote, as ``rlstream samples`` prints it: the newest ``n`` scored samples
        (``order`` "worst" / "best": by reward; ``version``: generated by that version), each with
        its prompt, completion, reward, advantage, versions and staleness. Read-only: no consumer
        group, no commit; the job is not touched."""
        from rlstream.samples import read_samples

        with self._kafka() as cfg:
            return read_samples(cfg, n=n, version=version, order=order)

    # -- helpers -----------------------------------------------------------------------------
    def _copy(self):
        """A copy to connect: the bootstrap address found for one call is not the job's setting."""
        return self._config.model_copy(deep=True)

    def _kafka(self):
        from rlstream.job import connected

        cfg = self._copy()
        cfg.kafka.bootstrap_servers = self._ensure_broker(self.keep_broker)
        return connected(cfg, self.keep_broker, _say)

    def _ensure_broker(self, keep: bool) -> str:
        """The job's Kafka: the configured cluster, else the local broker, started once and kept
        until ``close()`` (unless it was running before, or ``keep``)."""
        if self._config.kafka.bootstrap_servers:
            return self._config.kafka.bootstrap_servers
        if self._bootstrap is not None:
            return self._bootstrap
        from rlstream.broker_cluster import local_broker

        broker = local_broker(self._config.broker)
        state = broker.state()
        if state is None:
            state = broker.start(progress=_say, owned=not keep)
            if not keep:
                self._broker_stop = weakref.finalize(self, broker.stop, progress=_say)
        self._bootstrap = state["bootstrap"]
        return self._bootstrap


def _say(line: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(line, highlight=False, soft_wrap=True)


def _run_off_main_thread(worker):
    """``worker.run()`` in a thread: a role's main-thread set-up (signal handlers; a watchdog that
    ends a hung process) is for a process of its own, not for a notebook's kernel. Ctrl-C asks it
    to stop, waits ``liveness.shutdown_timeout_s`` and is raised again."""
    stop = threading.Event()
    out: list = []

    def body():
        try:
            out.append(("ok", worker.run(stop)))
        except BaseException as exc:  # re-raised in the caller's thread
            out.append(("error", exc))

    t = threading.Thread(target=body, name=f"rlstream-{worker.role}", daemon=True)
    t.start()
    try:
        while t.is_alive():
            t.join(0.5)
    except KeyboardInterrupt:
        stop.set()
        t.join(worker.liveness.shutdown_timeout_s)
        raise
    kind, value = out[0]
    if kind == "error":
        raise value
    return value
