"""``rlstream eval``: evaluation while training, without pausing it.

A process of its own (a ``pipeline.worker.Worker``) that follows rl.control and, for version 0,
then every ``eval.every_versions`` published versions, and always the run's final version (the
notice whose ``step`` reaches ``trainer.max_steps``), loads those weights into its own rollout
engine, generates ``eval.samples`` answers for each prompt of a held-out dataset, scores them with
the reward workers' functions (``reward.tasks``/``reward.default``, in the same timed pool), and
writes the answers with their rewards to ``<run_dir>/eval/v<N>.jsonl`` (the tracking role's
``samples/eval`` table shows them), and publishes one MetricEvent (role ``eval``, its
``version``) with ``eval_reward_mean``,
``eval_pass_at_1`` (the share of answers whose reward reaches ``eval.pass_threshold``), the mean
answer length in tokens and the share cut at the token budget, and counts.
The launcher's live view, ``rlstream status``, the run report and its plots show the curve. The
final version's event also carries ``eval_final = 1``: the launcher waits for it before it stops a
job whose trainer has finished.

A held-out prompt whose task maps to an environment (``rollout.env.tasks``, e.g. a ``tools``
task) is played as whole episodes through that environment (``consumers.eval.episodes``): the
environment's opening, a model turn, its observation, and so on to the end of the episode, whose
text is then scored as a trajectory's would be. The event then also carries the tool-use figures
from the environment's counts: ``eval_tool_call_rate``, ``eval_tool_call_success``,
``eval_malformed_call_rate``, ``eval_turns_mean`` and ``eval_episodes``; each answer's row in
``eval/v<N>.jsonl`` carries its transcript, turns and counts. The environment classes are
handed in by the application layer (``envs``: ``producers.envs.make_env``), as roles do not
import each other.

``rlstream eval --version N`` / ``--latest`` (``Evaluator(cfg, version=N)`` / ``latest=True``)
evaluates that one version once, publishes nothing, writes its answers to
``<run_dir>/eval/v<N>.jsonl`` and returns the figures.

It is a role of its own: it uses the libraries (a rollout engine, reward functions), never
another role's package (the environments are handed in, above). It writes nothing but metrics
and, in the checkpoint store, the best version by ``eval.best_metric`` (``pipeline.best``), whose
weights the trainer then never deletes. It is not a benchmark harness.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Literal

from pydantic import Field

from consumers.eval.episodes import play, start, tool_metrics
from pipeline.best import note_score, pin_evaluating
from pipeline.config import StrictModel
from pipeline.control import ControlFollower, now_ms
from pipeline.errors import ConfigError
from pipeline.kafka import Producer, client_conf
from pipeline.log import kv
from pipeline.metrics import WorkerMetrics
from pipeline.worker import Worker

log = logging.getLogger(__name__)


class EvalConfig(StrictModel):
    source: Path | None = None
    """Held-out dataset (the feed's formats and field names); required to run ``rlstream eval``."""
    every_versions: int = Field(1, ge=1, le=1_000_000)
    """Evaluate version 0, then each published version that is at least this many past the last one."""
    samples: int = Field(1, ge=1, le=1024)
    """Answers per prompt; pass@1 is the share of all answers that pass."""
    max_prompts: int = Field(0, ge=0)
    """Use the first this many prompts of the dataset (0 = all)."""
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    """Sampling temperature of the eval answers (0 = greedy)."""
    max_new_tokens: int = Field(0, ge=0, le=1_000_000)
    """Answer budget; 0 = rollout.max_new_tokens."""
    pass_threshold: float = 1.0
    """An answer passes when its reward is at least this."""
    worker_id: str = Field("eval", pattern=r"^[A-Za-z0-9._-]+$")
    """Id in metrics and client ids."""
    prometheus_port: int = Field(0, ge=0, le=65535)
    """Serve Prometheus /metrics on this port; 0 = off."""
    heartbeat_s: float = Field(10.0, gt=0, le=3600)
    """How often the evaluator publishes its gauges while waiting or generating (a sign of life)."""
    best_metric: Literal["", "pass_at_1", "reward_mean", "response_tokens_mean", "truncated_fraction"] = "pass_at_1"
    """Keep the best version by this eval metric beside the trainer's rolling window
    (``trainer.keep_weight_versions``): its weights are never deleted from the store, and a job run
    exports it to ``<run dir>/export/best`` (``pipeline.best``). '' = off."""
    best_mode: Literal["max", "min"] = "max"
    """Whether a higher (``max``) or lower (``min``) ``best_metric`` is better; of equal scores the
    newer version is kept."""


def eval_feed(cfg):
    """How ``eval.source`` is read: as the feed reads its dataset (its field names, default task)."""
    from libs.datasets import DatasetFields

    fields = {k: getattr(cfg.feed, k) for k in DatasetFields.model_fields if k not in ("source", "format")}
    return DatasetFields(**fields, source=cfg.eval.source)


class Evaluator(Worker):
    role = "eval"
    unit = "evaluation"

    def __init__(self, cfg, version: int | None = None, latest: bool = False, envs=None):
        super().__init__(cfg, cfg.eval.worker_id)
        self.make_env = envs
        """``producers.envs.make_env`` (spec, options, ctx, dirs, check) -> a new Environment; None:
        a held-out set with an environment task is refused."""
        self.env_tasks: dict[str, str] = {}
        """Held-out tasks played as episodes -> their environment spec."""
        self.ec = cfg.eval
        self.engine = self.pool = self.control = self.producer = self.metrics = None
        self.evaluated: int | None = None
        self.results: list[dict] = []
        self.once = latest or version is not None
        """Evaluate one version (``version``, or the newest with ``latest``) and stop."""
        self.asked = version
        self.update: dict | None = None
        """The WeightUpdate evaluated once (None: version 0, the base model)."""

    def setup(self) -> None:
        from libs.datasets import load_dataset
        from libs.engines import EngineContext, build_engine
        from libs.rewards.pool import make_pool
        from pipeline.models import load_tokenizer, materialize

        if self.ec.source is None:
            raise ConfigError("eval.source is not set: give a held-out dataset (rlstream eval FILE)")
        if not Path(self.ec.source).exists():
            raise ConfigError(f"eval.source {self.ec.source} does not exist")
        if self.once:  # before the model loads: a version that is not there is said at once
            from pipeline.versions import find_update

            self.update = find_update(self.cfg, self.asked, base=True)
        records = load_dataset(eval_feed(self.cfg))
        self.records = records[: self.ec.max_prompts] if self.ec.max_prompts else records
        env = self.cfg.rollout.env
        self.env_tasks = {r["task"]: env.tasks[r["task"]] for r in self.records if r["task"] in env.tasks}
        if self.env_tasks and self.make_env is None:
            raise ConfigError(f"held-out tasks {sorted(self.env_tasks)} run in environments, but this evaluator was "
                              "built without them (pass envs=producers.envs.make_env)")  # fmt: skip
        for task, spec in self.env_tasks.items():  # bad options are said now, before the model loads
            self.make_env(spec, env.options.get(task, {}), {"task": task, "worker_id": self.worker_id}, env.import_dirs,
                          check=True)  # fmt: skip
        model_dir = materialize(self.cfg.model)
        self.tokenizer = load_tokenizer(model_dir)
        self.engine = build_engine(self.cfg.rollout.engine, EngineContext(model_dir, self.tokenizer, self.worker_id))
        self.pool = make_pool(self.cfg.reward, self.cfg.log_level)
        if self.once:
            return
        self.control = ControlFollower(self.cfg, "eval", self.worker_id)
        self.producer = Producer(client_conf(self.cfg, "eval", self.worker_id, kind="producer"))
        self.metrics = WorkerMetrics(
            "eval", self.worker_id, self.producer, self.cfg.topics.name("metrics"), self.ec.heartbeat_s,
            self.ec.prometheus_port,
        )  # fmt: skip
        self.control.catch_up(self.liveness.startup_timeout_s)
        log.info(
            "evaluator started %s", kv(prompts=len(self.records), samples=self.ec.samples, every=self.ec.every_versions)
        )

    def run_once(self) -> bool:
        if self.once:
            if self.update is not None:
                with self.section("weight load"):
                    self.engine.load_weights(self.update, self.engine.prepare_weights(self.update))
            with self.section("evaluation"):
                self._evaluate()
            return False
        self.metrics.maybe_publish()
        self.control.poll(0.5)
        self.control.commands.clear()
        upd = self.control.latest_update
        target = upd["version"] if upd else 0
        final = is_final(upd, self.cfg.trainer.max_steps)
        if due(self.evaluated, target, self.ec.every_versions, final):
            if target > self.engine.version:
                with self.section("weight load"):
                    if not self._load(upd):
                        return True
            with self.section("evaluation"):
                self._evaluate(final)
        return True

    def _load(self, upd: dict) -> bool:
        """Load ``upd``'s weights; a checkpoint that cannot be fetched or verified is dead-lettered and
        skipped (False): the evaluator waits for the next notice (``pipeline.control``)."""
        from libs.engines.adapters import BaseModelMismatch

        if self.ec.best_metric:  # the trainer's gc keeps it while it is scored (pipeline.best)
            pin_evaluating(self.cfg.store, upd)
        try:
            prepared = self.engine.prepare_weights(upd)
        except BaseModelMismatch:
            raise
        except Exception as exc:
            reason = f"weights v{upd['version']} at {upd['uri']!r} could not be fetched or verified: {exc!r}"
            self.control.reject(upd, "unverifiable_checkpoint", reason)
            return False
        self.engine.load_weights(upd, prepared)
        return True

    def _evaluate(self, final: bool = False) -> None:
        from libs.chat import render, uses_template
        from libs.engines import GenRequest

        rc, ec, t0 = self.cfg.rollout, self.ec, time.monotonic()
        budget = ec.max_new_tokens or rc.max_new_tokens
        reqs, meta, episodes, ep_meta = [], [], [], []
        for i, r in enumerate(self.records):
            if uses_template(r, rc.chat_template):
                text = render(r, self.tokenizer, rc.system_prompt, rc.add_generation_prompt)
                toks = self.tokenizer(text, add_special_tokens=False).input_ids
            else:
                text, toks = r["text"], self.tokenizer(r["text"]).input_ids
            if r["task"] in self.env_tasks:
                episodes += self._episodes(i, r, text, budget)
                ep_meta += [(r, text)] * ec.samples
                continue
            n = min(budget, self.engine.max_model_len - len(toks))
            for j in range(ec.samples):
                reqs.append(
                    GenRequest(
                        f"eval{i}/{j}", toks, max(1, n), ec.temperature, frozenset({self.tokenizer.eos_token_id})
                    )
                )
                meta.append((r, text))
        outs = []
        for i in range(0, len(reqs), 64):  # in chunks, with a sign of life between them
            outs += self.engine.generate(reqs[i : i + 64], timeout=self.liveness.slow_op_s)
            self._tick()
        answers = [
            (r, text, req.rid, self.tokenizer.decode(out.tokens, skip_special_tokens=True), out.finish_reason,
             len(out.tokens), None)
            for req, out, (r, text) in zip(reqs, outs, meta, strict=True)
        ]  # fmt: skip
        if episodes:
            self._play(episodes)
        decode = self.tokenizer.decode
        answers += [
            (r, text, ep.rid, decode(ep.tokens, skip_special_tokens=True), ep.finish, ep.model_tokens, ep)
            for ep, (r, text) in zip(episodes, ep_meta, strict=True)
        ]
        trajs = [
            {
                "trajectory_id": rid,
                "group_id": rid,
                "task": r["task"],
                "prompt_text": text,
                "response_text": response,
                "reference": r["reference"],
                "finish_reason": finish,
                "num_turns": max(1, ep.turns) if ep is not None else 1,
                "metadata": {},
            }
            for r, text, rid, response, finish, _, ep in answers
        ]
        outcomes = self.pool.score(trajs)
        # an episode its environment ended (env_error / env_timeout) is not scored: it counts as failed
        failed = [a[6] is not None and a[6].finish in ("env_error", "env_timeout") for a in answers]
        scored = [o for o, f in zip(outcomes, failed, strict=True) if o.ok and not f]
        rewards = [o.reward for o in scored]
        lengths = [a[5] for a in answers]
        res = {
            "version": self.engine.version,
            "eval_reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "eval_pass_at_1": sum(r >= ec.pass_threshold for r in rewards) / len(trajs) if trajs else 0.0,
            "eval_answers": len(trajs),
            "eval_unscored": len(trajs) - len(scored),
            # response length: what a length-biased rule (rollout.overprovision) would move first
            "eval_response_tokens_mean": sum(lengths) / len(lengths) if lengths else 0.0,
            "eval_truncated_fraction": sum(t["finish_reason"] == "length" for t in trajs) / max(1, len(trajs)),
            "eval_s": time.monotonic() - t0,
        }
        tools = tool_metrics(episodes) if episodes else {}
        res.update(tools)
        self.results.append(res)
        self.evaluated = self.engine.version
        log.info("evaluated %s", kv(**{k: round(v, 4) if isinstance(v, float) else v for k, v in res.items()}))
        # before the figures: the tracker's eval table reads it
        answers_file = self._write_answers(trajs, outcomes, failed, [a[6] for a in answers])
        if self.once:
            res["answers_file"] = str(answers_file)
            return
        if self.ec.best_metric:  # before the figures go out: the launcher stops the run on the final one
            upd = self.control.latest_update
            upd = upd if upd and upd["version"] == res["version"] else None
            note_score(self.cfg.store, self.ec.best_metric, self.ec.best_mode, res, upd)
        self.metrics.version = self.engine.version
        for k, v in res.items():
            if k != "version" and k not in tools:
                self.metrics.set(k, v)
        if tools:  # by name, so the metrics reference lists them
            self.metrics.set("eval_episodes", tools["eval_episodes"])
            self.metrics.set("eval_tool_call_rate", tools["eval_tool_call_rate"])
            self.metrics.set("eval_tool_call_success", tools["eval_tool_call_success"])
            self.metrics.set("eval_malformed_call_rate", tools["eval_malformed_call_rate"])
            self.metrics.set("eval_turns_mean", tools["eval_turns_mean"])
        if final:
            self.metrics.set("eval_final", 1.0)
        self.metrics.set("eval_at_ms", now_ms())
        self.metrics.publish()
        self.producer.flush_patiently(self.liveness.outage_s, "eval metrics")

    def _episodes(self, i: int, r: dict, text: str, budget: int) -> list:
        """The ``eval.samples`` episodes of held-out record ``r`` (its rendered prompt ``text``), reset."""
        env, task = self.cfg.rollout.env, r["task"]
        prompt = {**r, "group_id": f"eval{i}", "text": text, "_plain_text": r["text"]}  # as a Prompt record reads
        ctx = {"task": task, "worker_id": self.worker_id, "tokenizer": self.tokenizer}
        spec, opts, n = self.env_tasks[task], env.options.get(task, {}), self.engine.max_model_len
        return [
            start(self.make_env(spec, opts, ctx, env.import_dirs), prompt, j, self.tokenizer, f"eval{i}/{j}", budget, n)
            for j in range(self.ec.samples)
        ]

    def _play(self, episodes: list) -> None:
        env = self.cfg.rollout.env
        stops = set()
        for s in ["\n"] if env.stop is None else env.stop:
            ids = self.tokenizer(s, add_special_tokens=False).input_ids
            if len(ids) != 1:
                raise ConfigError(f"rollout.env.stop {s!r} must be exactly one token, it is {ids}")
            stops.add(ids[0])
        play(episodes, self.engine, self.tokenizer, temperature=self.ec.temperature, max_turns=env.max_turns,
             max_turn_tokens=env.max_turn_tokens, stop_ids=frozenset(stops), chat_eos_only=env.stop is None,
             step_timeout_s=env.step_timeout_s, gen_timeout_s=self.liveness.slow_op_s, tick=self._tick)  # fmt: skip

    def _tick(self) -> None:
        if self.metrics is not None:
            self.metrics.maybe_publish()

    def _write_answers(self, trajs: list[dict], outcomes: list, failed: list[bool], episodes: list) -> Path:
        """``<run_dir>/eval/v<N>.jsonl``: each prompt, answer, reference and reward of the
        evaluation of version N (the tracking role logs its first rows as a sample table); an
        episode's row also has its ``turns``, ``transcript`` (``{role: model | env, text}``), the
        environment's ``counts`` and, when the environment failed, its ``error``; an answer the reward
        functions could not score has its ``reward_error``."""
        import json

        path = Path(self.cfg.run_dir) / "eval" / f"v{self.engine.version}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for t, o, bad, ep in zip(trajs, outcomes, failed, episodes, strict=True):
                row = {k: t[k] for k in ("prompt_text", "response_text", "reference", "finish_reason")}
                row["reward"] = o.reward if o.ok and not bad else None
                if not o.ok:
                    row["reward_error"] = f"{o.error_type}: {o.reason}"
                if ep is not None:
                    row.update(turns=ep.turns, transcript=ep.transcript, counts=ep.counts)
                    if ep.error:
                        row["error"] = ep.error
                f.write(json.dumps(row) + "\n")
        return path

    def close(self) -> None:
        for c in (self.control, self.pool, self.engine):
            if c is not None:
                c.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.producer is not None:
            self.producer.close(self.cfg.kafka.request_timeout_s)

    def result(self) -> list[dict]:
        return self.results


def is_final(update: dict | None, max_steps: int) -> bool:
    """Whether ``update`` is the run's last version: the trainer publishes at ``trainer.max_steps``
    whatever ``publish_every`` says, and stops there."""
    return bool(update and max_steps and (update.get("step") or 0) >= max_steps)


def due(evaluated: int | None, target: int, every: int, final: bool) -> bool:
    """Whether the newest version ``target`` is to be evaluated now: the first one seen, each one
    ``every`` past the last evaluated, and the final one always."""
    return evaluated is None or target >= evaluated + every or (final and target > evaluated)


def run(cfg, stop=None, version: int | None = None, latest: bool = False, envs=None) -> list[dict]:
    """Follow the run (default), or evaluate one version once (``version``, or the newest with
    ``latest``); ``envs``: ``producers.envs.make_env`` when held-out tasks run in environments."""
    return Evaluator(cfg, version, latest, envs).run(stop)
