"""The verifiers environment (``verifiers``): the tasks of a taskset written for PrimeIntellect's
``verifiers`` library (``verifiers==0.4.0``, its ``verifiers.v1`` API; ``pip install
'rlstream[verifiers]'``) played as episodes, the task's own weighted rewards as the episode's
``env_reward``.

Options (``[rollout.env.options.<task>]``, ``VerifiersOptions``): ``taskset`` (``module:function``
returning a ``vf.Taskset``, or ``module:Class``, a Taskset subclass built with its default config)
or ``id`` (a taskset package installed beside rlstream, loaded with ``vf.load_taskset``), ``args``
(the function's keyword arguments, or the taskset config's fields for ``id``), ``system_prompt``
and ``render``.

An episode is one task of the taskset for one model turn: ``reset`` picks the task the prompt's
``reference`` names (``{"idx": N}``, its position in the taskset, or ``{"id": "..."}``, its
``TaskData.id``; a reference naming neither picks the task whose prompt text is the prompt's text)
and returns the task's system prompt and prompt, through the tokenizer's chat template (``render``
``auto``/``chat``) or as plain lines (``plain``: joined by newlines, none after the last, so a
completion-style prompt such as ``3>`` is continued by the model); ``step(action)`` records the model's reply (less
the EOS that ended it) as the assistant message of a verifiers ``Trace`` and runs the task's
scoring (``Task.score``: every ``@vf.reward`` method and plugged reward function, weighted); the
sum is the step's reward, which ends the episode. Each reward's score is in the step's ``info``.
A reward that raises (verifiers wraps it in a ``TaskError``) fails the step: the episode goes to
rl.dlq (``env_error``) with the reason, and the worker and the other episodes go on.

The taskset is loaded once per worker process (per options) and every task kept in memory:
infinite tasksets (``INFINITE``) are refused at start. Refused at start as well (a ConfigError in
one line): the package missing, options naming neither or both of ``taskset`` and ``id``, a
taskset that fails to load or is empty, tasks without rewards, and tasks whose scoring verifiers
cannot run here: rewards that need a runtime (a sandbox box) and LLM judges (a model client).

What this is not: verifiers' rollout machinery. verifiers 0.4 runs an episode through an ``Env``
coroutine that drives agent harness programs (launched with ``uv``, in containers or sandboxes)
against a model server through an OpenAI-compatible client, multi-turn conversations and tool
servers included; none of that runs here. rlstream's rollout worker is the agent: it plays the
taskset's data and scores with the taskset's rewards, one turn per task, the form of verifiers'
default single-agent environment with a tool-less harness. Nor is it a reward function: the reward
role scores the trajectory (the built-in ``env_reward`` reads the task's reward).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import threading
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from pipeline.config import StrictModel
from pipeline.errors import ConfigError
from pipeline.plugins import is_dotted, load_object
from producers.envs import Environment, StepResult

INSTALL = "pip install 'rlstream[verifiers]'"


class VerifiersOptions(StrictModel):
    taskset: str = ""
    """``module:function`` returning a ``vf.Taskset`` (called with ``args``), or ``module:Class``, a
    ``vf.Taskset`` subclass built with its config type (``args`` as its fields); the module is looked
    up in ``rollout.env.import_dirs`` first. Exactly one of ``taskset`` and ``id``."""
    id: str = ""
    """An installed verifiers taskset package (``vf.load_taskset``; ``args`` as its config's fields).
    Exactly one of ``taskset`` and ``id``."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the ``taskset`` function, or the taskset config's fields."""
    system_prompt: str = ""
    """System message for tasks that have none (``TaskData.system_prompt``)."""
    render: Literal["auto", "chat", "plain"] = "auto"
    """``chat``: through the tokenizer's chat template; ``plain``: text lines; ``auto``: chat if the
    tokenizer has a template."""

    @model_validator(mode="after")
    def _one_source(self):
        if bool(self.taskset) == bool(self.id):
            raise ValueError("name the verifiers taskset with exactly one of taskset (module:function) and id")
        if self.taskset and not is_dotted(self.taskset):
            raise ValueError(f"taskset {self.taskset!r} is not a module:function reference")
        return self


def verifiers():
    """The ``verifiers.v1`` module, or a ConfigError saying how to install it."""
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ConfigError(f"the verifiers environment needs the verifiers package (0.4): {INSTALL}") from exc
    return vf


class LoadedTaskset:
    """A taskset's tasks in memory, indexed by position, id and prompt text."""

    def __init__(self, name: str, tasks: list):
        self.name = name
        self.tasks = tasks
        self.by_id = {t.data.id: t for t in tasks if t.data.id is not None}
        self.by_text: dict[str, Any] = {}
        for t in tasks:
            self.by_text.setdefault(t.data.prompt_text, t)

    def task(self, reference: Any, text: str):
        """The task a prompt names (see the module docstring); ValueError if none."""
        if isinstance(reference, dict) and "idx" in reference:
            idx = reference["idx"]
            if not isinstance(idx, int) or not 0 <= idx < len(self.tasks):
                raise ValueError(f"reference idx {idx!r} is not a task of {self.name} (0..{len(self.tasks) - 1})")
            return self.tasks[idx]
        if isinstance(reference, dict) and "id" in reference:
            task = self.by_id.get(str(reference["id"]))
            if task is None:
                raise ValueError(f"reference id {reference['id']!r} is not a task id of {self.name}")
            return task
        task = self.by_text.get(text)
        if task is None:
            raise ValueError(f"the prompt names no task of {self.name}: give its reference an idx or an id")
        return task


_LOADED: dict[str, LoadedTaskset] = {}
_LOAD_LOCK = threading.Lock()


def _build(opts: VerifiersOptions, import_dirs) -> Any:
    vf = verifiers()
    if opts.id:
        try:
            config = vf.taskset_config_type(opts.id)(id=opts.id, **opts.args)
            return vf.load_taskset(config)
        except Exception as exc:
            raise ConfigError(f"verifiers taskset id {opts.id!r}: {type(exc).__name__}: {exc}") from exc
    obj = load_object(opts.taskset, import_dirs)
    try:
        if inspect.isclass(obj) and issubclass(obj, vf.Taskset):
            from verifiers.v1.utils.generic import concrete_type

            return obj((concrete_type(obj, vf.TasksetConfig) or vf.TasksetConfig)(**opts.args))
        if callable(obj):
            return obj(**opts.args)
    except Exception as exc:
        raise ConfigError(f"verifiers taskset {opts.taskset}: {type(exc).__name__}: {exc}") from exc
    raise ConfigError(f"verifiers taskset {opts.taskset} is neither a function nor a vf.Taskset subclass")


def _requires_runtime(fn) -> bool:
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def load_taskset(opts: VerifiersOptions, import_dirs=()) -> LoadedTaskset:
    """The taskset the options name, loaded once per process; ConfigError for one that cannot be
    played here (see the module docstring)."""
    key = json.dumps([opts.taskset, opts.id, opts.args, [str(d) for d in import_dirs]], sort_keys=True, default=str)
    with _LOAD_LOCK:
        if key in _LOADED:
            return _LOADED[key]
        vf = verifiers()
        name = opts.taskset or opts.id
        taskset = _build(opts, import_dirs)
        if not isinstance(taskset, vf.Taskset):
            raise ConfigError(f"verifiers taskset {name} returned a {type(taskset).__name__}, not a vf.Taskset")
        if not taskset.bounded:
            raise ConfigError(f"verifiers taskset {name} is infinite: the environment keeps every task in memory")
        try:
            tasks = list(taskset)
        except Exception as exc:
            raise ConfigError(f"verifiers taskset {name}: loading its tasks: {type(exc).__name__}: {exc}") from exc
        if not tasks:
            raise ConfigError(f"verifiers taskset {name} has no tasks")
        first = tasks[0]
        rewards = first.hooks("reward")
        if not rewards:
            raise ConfigError(f"verifiers taskset {name}: its tasks ({type(first).__name__}) have no @vf.reward")
        needs = [fn.__name__ for fn in rewards if _requires_runtime(fn)]
        if needs:
            raise ConfigError(
                f"verifiers taskset {name}: rewards {', '.join(needs)} need a runtime (a sandbox box), "
                "which the verifiers environment does not provide"
            )
        if first.config.judges:
            raise ConfigError(f"verifiers taskset {name}: LLM judges need a model client; the environment runs none")
        loaded = _LOADED[key] = LoadedTaskset(name, tasks)
        return loaded


class VerifiersEnv(Environment):
    eos_ends_episode = False
    """The task's rewards score every reply, one that ends in EOS included."""
    renders_chat = False
    """Set per instance from ``render`` (chat when the tokenizer's template renders the task)."""

    def __init__(self, config: dict[str, Any] | None = None, ctx=None):
        super().__init__(config, ctx)
        self.opts = VerifiersOptions.model_validate(self.config)
        self.tok = self.ctx.tokenizer
        self.has_template = bool(getattr(self.tok, "chat_template", None))
        self.renders_chat = self.opts.render == "chat" or (self.opts.render == "auto" and self.has_template)

    @classmethod
    def check_options(cls, options: dict[str, Any], import_dirs=()) -> None:
        try:
            opts = VerifiersOptions.model_validate(options)
        except ValidationError as exc:
            why = "; ".join(
                f"{'.'.join(map(str, e['loc'])) + ': ' if e['loc'] else ''}{e['msg'].removeprefix('Value error, ')}"
                for e in exc.errors()
            )
            raise ConfigError(f"verifiers environment options: {why}") from exc
        load_taskset(opts, import_dirs)

    def messages(self, task) -> list[dict]:
        """The task's opening as chat messages (its system prompt, else the option's, first)."""
        verifiers()
        from verifiers.v1.types import content_text

        data = task.data
        system = data.system_prompt or self.opts.system_prompt
        out = [{"role": "system", "content": system}] if system else []
        if isinstance(data.prompt, str):
            out.append({"role": "user", "content": data.prompt})
        else:
            out += [{"role": m.role, "content": content_text(m.content)} for m in data.prompt or []]
        return out

    def reset(self, prompt: dict, sample_index: int) -> str:
        if self.renders_chat and not self.has_template:
            raise ConfigError("verifiers: render = 'chat' needs a tokenizer with a chat template")
        loaded = load_taskset(self.opts, self.ctx.import_dirs)
        ref = prompt.get("reference") or ""
        ref = json.loads(ref) if isinstance(ref, str) and ref.strip().startswith("{") else ref
        self.task = loaded.task(ref, prompt.get("text", ""))
        self.opening = self.messages(self.task)
        if self.renders_chat:
            return self.tok.apply_chat_template(self.opening, tokenize=False, add_generation_prompt=True)
        return "\n".join(m["content"] for m in self.opening)

    def reply(self, action: str) -> str:
        """The model's reply as the rewards read it: without the EOS that ended it, stripped."""
        eos = getattr(self.tok, "eos_token", None)
        if eos and action.endswith(eos):
            action = action[: -len(eos)]
        return action.strip()

    def trace(self, reply: str):
        """A verifiers Trace of the episode: the opening, then the model's reply (sampled)."""
        vf = verifiers()
        from verifiers.v1.graph import MessageNode

        kinds = {"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}
        msgs = [kinds[m["role"]](content=m["content"]) for m in self.opening if m["role"] in kinds]
        msgs.append(vf.AssistantMessage(content=reply))
        nodes = [
            MessageNode(parent=i - 1 if i else None, message=m, sampled=i == len(msgs) - 1) for i, m in enumerate(msgs)
        ]
        task = vf.TraceTask(type=type(self.task).__name__, data=self.task.data, key=self.task.key, hash=self.task.hash)
        return vf.Trace(task=task, agent=vf.AgentInfo(config=vf.AgentConfig()), nodes=nodes)

    def step(self, action: str) -> StepResult:
        trace = self.trace(self.reply(action))
        asyncio.run(self.task.score(trace))  # a step runs on a worker thread: no event loop is running
        rewards = {k: r.score for k, r in trace.rewards.items() if r is not None}
        unscored = [k for k, r in trace.rewards.items() if r is None]
        if unscored:
            raise ValueError(f"verifiers task {type(self.task).__name__}: rewards {unscored} gave no score")
        reward = float(trace.reward)
        if not math.isfinite(reward):
            raise ValueError(f"verifiers task {type(self.task).__name__}: reward {reward} is not finite ({rewards})")
        info = {"counts": {"tasks_scored": 1}, "rewards": rewards, "reward": reward}
        return StepResult("", reward, True, info)
