"""Experiment logging as a consumer of rl.metrics: TensorBoard event files, and Weights & Biases
(offline-capable) when configured.

``Tracker`` turns MetricEvents into scalars: the trainer's per-step figures (reward, loss, KL,
grad norm, lr, samples/s, the staleness histogram as ``staleness/lag_<d>``, the samples trained as
``trainer/step_samples``; a step whose samples were all stale has no reward or loss point) at the trainer step,
the eval curve (``eval/*``) at the policy version, and every other role's gauges and rates
(``rollout/<worker>/*``, ``reward/<worker>/*``) and the lags per stage (``lag/<stage>``, when the
caller knows them) on the trainer's axis too: each series gets one point per trainer step, its
latest value while that step was the trainer's newest (written when the next step arrives, or at
close), with the wall time it was reported at. So every series shares TensorBoard's step axis, and
no series repeats a step (TensorBoard would keep only its last point there).

Every ``tracking.samples_every`` trainer steps it also logs a table of the newest scored samples
(prompt, completion, reward, advantage, version) as ``samples/train``, and for each evaluated version
the eval role's held-out answers with their rewards as ``samples/eval``: a TensorBoard text
summary (a markdown table) and a W&B Table (``consumers.tracking.tables``). The training samples
come from a source the caller hands in (``samples``: the launcher and ``rlstream track`` hand
``rlstream.samples.TableSource``, a read-only, group-less, read_committed read of rl.scored's tail
with the trainer's advantage estimator), so this role needs no second Kafka stream of its own, and
reads no other role's code.

``rlstream demo`` (and job runs) feed their own metrics stream into a Tracker writing
``<run dir>/tensorboard``; ``rlstream track`` runs one as a process of its own for a pipeline
started some other way. ``tensorboard --logdir <run dir>`` shows the run.

The ``tensorboard`` package (the ``track`` extra; its event writer, not torch's) and wandb are
imported only here. What this is not: a metrics store; Kafka and Prometheus are.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

from pydantic import Field

from pipeline import codec
from pipeline.admin import Admin
from pipeline.config import StrictModel
from pipeline.errors import DecodeError
from pipeline.kafka import Consumer, TopicPartition, client_conf
from pipeline.log import kv
from pipeline.records import LAG_PREFIX, lag_counts, step_samples
from pipeline.topology import stage_lags
from pipeline.worker import Worker

from . import tables

log = logging.getLogger(__name__)
NO_SAMPLE_NO_VALUE = ("reward_mean", "loss")
"""Trainer gauges (and ``loss_*``) that are means over the step's trained samples: not written for
a step that trained none (``trainer/step_samples`` 0 marks it)."""


class TrackingConfig(StrictModel):
    tensorboard: bool = True
    """Write TensorBoard event files (needs the ``tensorboard`` package: ``rlstream[track]``)."""
    dir: Path | None = None
    """Where the event files go; None: ``<run dir>/tensorboard``."""
    wandb_project: str = ""
    """Also log to this Weights & Biases project ('' = off; needs ``wandb``)."""
    wandb_mode: str = Field("offline", pattern=r"^(online|offline|disabled)$")
    """W&B mode: ``offline`` writes a local run you can ``wandb sync`` later."""
    samples_every: int = Field(10, ge=0, le=1_000_000)
    """Log a table of the newest scored samples (``samples/train``) every this many trainer steps,
    and each evaluated version's held-out answers (``samples/eval``); 0 = off."""
    samples_rows: int = Field(8, ge=1, le=1000)
    """Rows of each sample table."""


class EventFiles:
    """TensorBoard event files through the ``tensorboard`` package's own writer, as torch's
    ``SummaryWriter(flush_secs=5, purge_step=0)`` writes them, without importing torch (1.4 s of a
    launcher's start on 2 cores, beside the fork server's imports). ``purge_step`` 0: a resumed run
    writes the whole history again; TensorBoard then drops the older files' copies instead of
    drawing every point twice."""

    def __init__(self, logdir: Path):
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        self._pending: dict[tuple[int, float], list] = {}
        self.dir = logdir
        logdir.mkdir(parents=True, exist_ok=True)
        self._w = EventFileWriter(str(logdir), flush_secs=5)
        self._w.add_event(Event(step=0, file_version="brain.Event:2"))
        self._w.add_event(Event(step=0, session_log=SessionLog(status=SessionLog.START)))

    def add_scalar(self, tag: str, value: float, step: int, walltime: float) -> None:
        """Buffered until ``write``: the scalars of one step and wall time go out as one event,
        which TensorBoard reads value by value (one event each, through the writer's queue, cost the
        launcher 5.6 ms of CPU per step of ~100 scalars on the 2-core machine; one per wall time 1.0)."""
        self._pending.setdefault((step, walltime), []).append(self._summary.Value(tag=tag, simple_value=float(value)))

    def add_text(self, tag: str, text: str, step: int, walltime: float) -> None:
        """A text summary (TensorBoard's text plugin renders it as markdown), written at once."""
        from tensorboard.compat.proto import types_pb2
        from tensorboard.compat.proto.summary_pb2 import SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        tensor = TensorProto(dtype=types_pb2.DT_STRING, string_val=[text.encode()], tensor_shape=TensorShapeProto())
        value = self._summary.Value(tag=tag, metadata=meta, tensor=tensor)
        self._w.add_event(self._event(summary=self._summary(value=[value]), wall_time=walltime, step=step))

    def write(self) -> None:
        for (step, wall), values in self._pending.items():
            self._w.add_event(self._event(summary=self._summary(value=values), wall_time=wall, step=step))
        self._pending.clear()

    def close(self) -> None:
        self.write()
        self._w.close()


class Tracker:
    """``samples``: a callable ``samples(k)`` returning the newest ``k`` scored samples as rows
    (``rlstream.samples``' dicts), with a ``close()``; None: no ``samples/train`` table."""

    def __init__(self, tc: TrackingConfig, run_dir: Path, name: str = "rlstream", samples=None):
        self.tc, self.run_dir, self.samples = tc, Path(run_dir), samples
        self._table_step = 0  # the trainer step of the last samples/train table
        self._eval_tables: set[int] = set()  # the versions whose samples/eval table is written
        self._last_step = -1
        self._pending: dict[str, tuple[float, float]] = {}  # tag -> latest (value, wall) at this step
        self.tb = self.wandb = None
        if tc.tensorboard:
            try:
                self.tb = EventFiles(Path(tc.dir or Path(run_dir) / "tensorboard"))
            except ImportError as exc:  # say so once, keep the run going: tracking is not the pipeline
                log.warning("TensorBoard logging off: %s (pip install 'rlstream[track]')", exc)
            else:
                self.dir = self.tb.dir
        if tc.wandb_project:
            import wandb

            self.wandb = wandb.init(project=tc.wandb_project, name=name, dir=str(run_dir), mode=tc.wandb_mode)
        if self.tb is not None:  # the run's name (a fork's says where it came from) on TensorBoard's text tab
            self.tb.add_text("run", name, 0, time.time())

    def _scalar(self, tag: str, value, step: int, wall: float) -> None:
        if not isinstance(value, int | float) or not math.isfinite(value):
            return
        if self.tb is not None:
            self.tb.add_scalar(tag, value, step, walltime=wall)
        if self.wandb is not None:
            self.wandb.log({tag: value, "step": step})

    def add(self, ev: dict) -> None:
        """One MetricEvent (decoded)."""
        m, wall, role = ev["metrics"], ev["timestamp_ms"] / 1000, ev["role"]
        if role == "trainer" and "step" in m and "reward_mean" in m:
            step = int(m["step"])
            if step <= self._last_step:
                return  # a periodic event repeating the last step's gauges
            self._flush()
            self._last_step = step
            trained = step_samples(m)
            self._scalar("trainer/step_samples", trained, step, wall)
            for lag, n in lag_counts(m).items():
                self._scalar(f"staleness/lag_{lag}", n, step, wall)
            for k, v in m.items():
                if k.startswith(LAG_PREFIX) or k.endswith("_rate"):
                    continue
                if trained or not k.startswith(NO_SAMPLE_NO_VALUE):  # else: a mean over nothing, not 0.0
                    self._scalar(f"trainer/{k}", v, step, wall)
            self._scalar("trainer/version", ev["version"], step, wall)
            if self.tc.samples_every and self.samples is not None and step >= self._table_step + self.tc.samples_every:
                self._table_step = step
                self._train_table(step, wall)
        elif role == "eval":
            for k, v in m.items():
                self._scalar(f"eval/{k.removeprefix('eval_')}", v, ev["version"], wall)
            if self.tc.samples_every and "eval_answers" in m and ev["version"] not in self._eval_tables:
                self._eval_table(ev["version"], wall)
        elif role != "trainer":
            for k, v in m.items():
                self._pending[f"{role}/{ev['worker_id']}/{k}"] = (v, wall)

    def _table(self, tag: str, columns, cells: list[list], step: int, wall: float) -> None:
        if self.tb is not None:
            self.tb.add_text(tag, tables.markdown(columns, cells), step, wall)
        if self.wandb is not None:
            import wandb

            self.wandb.log({tag: wandb.Table(columns=list(columns), data=cells), "step": step})

    def _train_table(self, step: int, wall: float) -> None:
        if self.tb is None and self.wandb is None:
            return
        try:
            rows = self.samples(self.tc.samples_rows)
        except Exception as exc:  # said, and the run goes on: a sample table is not the pipeline
            log.warning("no sample table at this step %s", kv(step=step, error=exc))
            return
        if rows:
            self._table("samples/train", tables.TRAIN_COLUMNS, tables.train_cells(rows), step, wall)

    def _eval_table(self, version: int, wall: float) -> None:
        path = tables.eval_answers_path(self.run_dir, version)
        if not path.is_file():
            return  # the evaluator writes it on its machine: a tracker elsewhere has no answers to show
        try:
            cells = tables.eval_cells(path, version, self.tc.samples_rows)
        except (OSError, ValueError) as exc:
            log.warning("no eval answers table %s", kv(version=version, path=path, error=exc))
            return
        self._eval_tables.add(version)
        self._table("samples/eval", tables.EVAL_COLUMNS, cells, version, wall)

    def lags(self, lags: dict[str, int]) -> None:
        now = time.time()
        for stage, n in lags.items():
            self._pending[f"lag/{stage}"] = (n, now)

    def _flush(self) -> None:
        """The pending role gauges and lags, at the trainer step they were the latest of."""
        step = max(self._last_step, 0)
        for tag, (value, wall) in self._pending.items():
            self._scalar(tag, value, step, wall)
        self._pending.clear()
        if self.tb is not None:
            self.tb.write()

    def close(self) -> None:
        self._flush()
        if self.tb is not None:
            self.tb.close()
            log.info("tensorboard event files written %s", kv(dir=self.dir))
        if self.wandb is not None:
            self.wandb.finish()
        if self.samples is not None:
            self.samples.close()


class TrackWorker(Worker):
    """``rlstream track``: a process that follows rl.metrics from its start and writes a Tracker,
    with the lag per stage every 10 s, until SIGTERM (the shared worker lifecycle)."""

    role, unit = "track", "batch of events"

    def __init__(self, cfg, samples=None):
        super().__init__(cfg, "track")
        self.samples = samples
        """The ``samples/train`` rows' source (``Tracker``)."""
        self.tracker = self.consumer = self.admin = None
        self._last_lag = 0.0

    def setup(self) -> None:
        cfg = self.cfg
        self.tracker = Tracker(cfg.tracking, Path(cfg.run_dir), samples=self.samples)
        self.consumer = Consumer(client_conf(cfg, "track", kind="consumer"))
        self.consumer.assign([TopicPartition(cfg.topics.name("metrics"), 0, 0)])
        self.admin = Admin(client_conf(cfg, "track"), cfg.kafka.request_timeout_s)

    def run_once(self) -> bool:
        for msg in self.consumer.consume(1000, 0.5):
            try:
                self.tracker.add(codec.decode_as(msg.value(), "MetricEvent"))
            except DecodeError:
                continue  # a foreign record on the metrics topic
        if time.monotonic() - self._last_lag > 10:
            self._last_lag = time.monotonic()
            self.tracker.lags(stage_lags(self.admin, self.cfg))
        return True

    def close(self) -> None:
        for c in (self.tracker, self.consumer, self.admin):
            if c is not None:
                c.close()
