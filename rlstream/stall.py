"""No silent stall: what the dead-letter topic says and which stage stopped moving.

``DeadLetters`` folds rl.dlq's DeadLetter records into counts by (stage, reason) with the first
error message of each (one line); ``rlstream status`` and the launcher both read the topic through
it. ``StallWatch`` adds the per-stage progress counters of rl.metrics (rollout: ``trajectories``,
reward: ``scored``, trainer: its step) and decides two things for the launcher:

* ``stalled(now, lags)``: the stage to name on screen. A stage has work when records wait for it
  (its lag) or it dead-lettered records since it last made progress; it is stalled when it has
  work and made no progress for ``name_after_s`` (60 s, or half of ``liveness.stall_s`` if that is
  shorter; for the trainer at least three of its recent step intervals, so a slow model's normal
  step is not called a stall). A stage that dead-letters is named; so is a quiet stage with work
  when no stage downstream of it has work (a busy trainer holds the rollout workers back through
  admission: the trainer is the one to name, if anyone, not them).
* ``verdict(now)``: the run's failure, when no trainer step has been made for ``liveness.stall_s``
  (since the start or the last step) and dead letters arrived in that window. A slow job without
  dead letters is never stopped here.
* ``busy(now)``: a trainer inside a long step, e.g. ``busy in step 1 for 80 s (forward-backward,
  micro-batch 3/8)``, from its in-step progress events (``busy_step``, ``busy_since_ms``,
  ``micro_batch``/``micro_batches``, ``minibatch``/``minibatches`` and the label ``phase``:
  ``consumers.trainer.heartbeat``). Such an event counts as the trainer's progress for both
  decisions above (the first step too): a trainer is named only when neither a step nor one of
  them came for the threshold.

Pure folding: every time is wall-clock seconds passed in or read from the records' own timestamps
(``timestamp_ms``, ``failed_at_ms``), so replayed records of an earlier run of the same job count
as old. No Kafka here. Not the hang check (a role whose MetricEvents stop is restarted by the
launcher) nor the crash-loop check (the supervisor).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.topology import PIPELINE

STAGES = PIPELINE
"""Pipeline order (``pipeline.topology``); the keys of the launcher's lags."""
OUTPUT = {
    "rollout": ("trajectories", "no trajectory"),
    "reward": ("scored", "nothing scored"),
    "trainer": ("step", "no step"),
}
"""stage -> (the MetricEvent counter that says it made progress, how its absence is said)."""
NAME_AFTER_S = 60.0
"""A stage with work and no progress for this long is named (shorter when ``stall_s`` is)."""
MESSAGE_CHARS = 200


def first_line(text: str, limit: int = MESSAGE_CHARS) -> str:
    """The first non-empty line of ``text``, cut to ``limit`` characters."""
    line = next((x.strip() for x in str(text).splitlines() if x.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


@dataclass
class Reason:
    count: int = 0
    first: str = ""
    """The message of the earliest dead letter (by ``failed_at_ms``), one line."""
    first_at: float = float("inf")
    last_at: float = float("-inf")

    def add(self, t: float, message: str) -> None:
        self.count += 1
        if t < self.first_at:
            self.first_at, self.first = t, message
        self.last_at = max(self.last_at, t)


class DeadLetters:
    """Counts of dead letters by (stage, reason), each with its first message."""

    UNDECODABLE = ("?", "undecodable_dead_letter")

    def __init__(self):
        self.by_key: dict[tuple[str, str], Reason] = {}

    def add(self, rec: dict) -> tuple[str, str, float, str]:
        """Fold one DeadLetter record; returns (stage, reason, failed at in s, message)."""
        key = (rec.get("role") or "?", rec.get("error_type") or "?")
        t, message = rec.get("failed_at_ms", 0) / 1000, first_line(rec.get("reason", ""))
        self.by_key.setdefault(key, Reason()).add(t, message)
        return key[0], key[1], t, message

    def add_undecodable(self) -> None:
        """A record on the DLQ topic that is not a DeadLetter (counted, with no message)."""
        self.by_key.setdefault(self.UNDECODABLE, Reason()).add(0.0, "")

    def total(self) -> int:
        return sum(r.count for r in self.by_key.values())

    def by_reason(self) -> dict[str, Reason]:
        """reason -> its count over every stage and the earliest message."""
        out: dict[str, Reason] = {}
        for (_, reason), r in sorted(self.by_key.items()):
            o = out.setdefault(reason, Reason())
            o.count += r.count
            if r.first_at < o.first_at:
                o.first_at, o.first = r.first_at, r.first
        return out

    def labels(self) -> dict[str, Reason]:
        """Display label -> counts: the reason alone, ``stage/reason`` where a reason comes from
        several stages; most frequent first."""
        reasons = [reason for _, reason in self.by_key]
        items = sorted(self.by_key.items(), key=lambda kv: -kv[1].count)
        return {(reason if reasons.count(reason) == 1 else f"{stage}/{reason}"): r for (stage, reason), r in items}

    def summary(self) -> str:
        """``reward_error 192 (ZeroDivisionError: division by zero); ...``, '' when there are none."""
        return "; ".join(
            f"{label} {r.count}" + (f" ({r.first})" if r.first else "") for label, r in self.labels().items()
        )


class StallWatch:
    """The launcher's view of progress per stage and of the DLQ (see the module docstring)."""

    def __init__(self, started: float, stall_s: float, name_after_s: float = NAME_AFTER_S):
        self.started, self.stall_s = started, stall_s
        self.name_after_s = min(name_after_s, stall_s / 2) if stall_s else name_after_s
        self.dead = DeadLetters()
        self.progress_at = dict.fromkeys(STAGES, started)
        """stage -> when it last made progress (the start until it does)."""
        self._counters: dict[str, float] = {}  # role/worker -> its output counter, last seen
        self._last_step = 0
        self._step_times: list[float] = []
        self._stage_dead: dict[str, Reason] = {}  # stage -> its dead letters since its last progress
        self._window: dict[tuple[str, str], Reason] = {}  # dead letters of this run since the last step
        self._busy: dict | None = None  # the trainer's newest in-step progress event (busy_step > its step)

    @property
    def step_at(self) -> float:
        """The start, or the trainer's last step if later."""
        return max([self.started, *self._step_times[-1:]])

    # -- folding ---------------------------------------------------------------------------------
    @property
    def busy_at(self) -> float:
        """When the trainer last said it was busy inside a step (-inf if it is not in one)."""
        return self._busy["at"] if self._busy else float("-inf")

    def add_metric(self, ev: dict) -> None:
        role, m, t = ev["role"], ev["metrics"], ev["timestamp_ms"] / 1000
        if role == "trainer" and "busy_step" in m:
            self._add_busy(ev, m, t)
        counter = OUTPUT.get(role, (None,))[0]
        if counter is None or counter not in m:
            return
        if role == "trainer":
            step = int(m["step"])
            if step > self._last_step:  # (periodic events repeat the last step)
                self._last_step = step
                self._step_times = [*self._step_times[-5:], t]
                self._progressed("trainer", t)
                if self._busy and self._busy["step"] <= step:
                    self._busy = None
                self._window = {k: r for k, r in self._window.items() if r.last_at >= t}
            return
        key, value = f"{role}/{ev['worker_id']}", float(m[counter])
        prev = self._counters.get(key, 0.0)
        self._counters[key] = value
        if value > prev or 0 < value < prev:  # grew, or a restarted worker (counters from 0) made some
            self._progressed(role, t)

    def _add_busy(self, ev: dict, m: dict, t: float) -> None:
        step = int(m["busy_step"])
        if step <= self._last_step or (self._busy and t < self._busy["at"]):
            return  # (a step's last in-step event may arrive after the step itself)
        self._busy = {
            "at": t, "step": step, "since": float(m.get("busy_since_ms", t * 1000)) / 1000,
            "phase": (ev.get("labels") or {}).get("phase", ""),
            "micro": (int(m.get("micro_batch", 0)), int(m.get("micro_batches", 0))),
            "mini": (int(m.get("minibatch", 0)), int(m.get("minibatches", 0))),
        }  # fmt: skip

    def _progressed(self, stage: str, t: float) -> None:
        self.progress_at[stage] = max(self.progress_at[stage], t)
        dead = self._stage_dead.get(stage)
        if dead is not None and dead.last_at <= t:
            del self._stage_dead[stage]

    def add_dead_letter(self, rec: dict) -> None:
        stage, reason, t, message = self.dead.add(rec)
        if t < self.started:  # an earlier run's (the topic is read from its start): counted, not judged
            return
        if t >= self.progress_at.get(stage, t):
            self._stage_dead.setdefault(stage, Reason()).add(t, message)
        if t >= self.step_at:
            self._window.setdefault((stage, reason), Reason()).add(t, message)

    # -- decisions -------------------------------------------------------------------------------
    def _after_s(self, stage: str) -> float:
        times = self._step_times
        if stage != "trainer" or len(times) < 2:
            return self.name_after_s
        return max(self.name_after_s, 3 * (times[-1] - times[0]) / (len(times) - 1))

    def stalled(self, now: float, lags: dict[str, int]) -> list[str]:
        """The stage(s) to name, e.g. ``reward (192 dead letters, nothing scored for 95 s)``."""
        found, busy_below = [], False  # busy_below: a stage downstream of this one has work
        for stage in reversed(STAGES):
            last = max(self.progress_at[stage], self.busy_at) if stage == "trainer" else self.progress_at[stage]
            quiet, lag = now - last, int(lags.get(stage, 0) or 0)
            dead = self._stage_dead.get(stage)
            if quiet >= self._after_s(stage) and (lag > 0 or dead) and (dead or not busy_below):
                what = [*([f"lag {lag}"] if lag > 0 else []), *([f"{dead.count} dead letters"] if dead else [])]
                since = now - self.progress_at[stage]  # (the trainer: since its last step, not its last event)
                found.append((bool(dead), f"{stage} ({', '.join(what)}, {OUTPUT[stage][1]} for {since:.0f} s)"))
            busy_below = busy_below or lag > 0 or bool(dead)
        named = [text for dead, text in found if dead]
        return named or [text for _, text in found]

    def busy(self, now: float) -> str | None:
        """``busy in step 1 for 80 s (forward-backward, micro-batch 3/8)`` while the trainer's
        in-step events keep coming (the newest within the naming threshold), else None."""
        b = self._busy
        if b is None or now - b["at"] >= self._after_s("trainer"):
            return None
        what = [b["phase"]] if b["phase"] else []
        if b["mini"][1] > 1:
            what.append(f"minibatch {b['mini'][0]}/{b['mini'][1]}")
        if b["micro"][1]:
            what.append(f"micro-batch {b['micro'][0]}/{b['micro'][1]}")
        said = f" ({', '.join(what)})" if what else ""
        return f"busy in step {b['step']} for {max(0.0, now - b['since']):.0f} s{said}"

    def verdict(self, now: float) -> str | None:
        """The run's failure status (without ``failed: ``), or None while it may go on (also while
        the trainer says it is busy inside a step)."""
        quiet = now - self.step_at
        if self.busy(now) is not None:
            return None
        if not self.stall_s or quiet < self.stall_s or not self._window:
            return None
        n = sum(r.count for r in self._window.values())
        reasons = sorted(self._window.items(), key=lambda kv: -kv[1].count)
        said = ", ".join(f"{reason}: {r.first}" if r.first else reason for (_, reason), r in reasons)
        return f"stalled: no step for {quiet:.0f} s; {n} dead letters ({said})"
