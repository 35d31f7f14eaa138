"""The tool-calling environment (``tools``): the model is shown the job's tools through its chat
template, its tool calls are read by a parser and run with a deadline, and their results come
back as the template's tool messages (observation tokens, loss_mask 0). An episode ends on the
first model turn without a tool call: the final answer, which the reward role scores.

Options (``[rollout.env.options.<task>]``, ``ToolEnvOptions``): ``tools``, each a built-in name
(``calculator``, ``python``), a ``module:function`` (schema from its signature and docstring, or
its ``tool_schema`` attribute) or an HTTP tool table (``libs.tools.base.HttpTool``); ``parser``
(``hermes`` or ``module:Class``); ``call_timeout_s``; ``max_calls_per_turn``; ``result_max_chars``;
``system_prompt``; ``tool_memory_mb``, ``tool_network`` and ``in_process`` (where a
``module:function`` tool runs).

Where calls run: a ``module:function`` tool runs in a tool-runner process (``libs.tools.runner``:
a memory limit, no network, killed at its deadline), not in the worker's process; its module is
imported in the worker only to read its schema. ``calculator`` runs in the worker (bounded
arithmetic), ``python`` in the code sandbox (``libs.rewards.sandbox``), an HTTP tool in the worker
on a thread joined with the deadline. A call stopped at its deadline or memory limit, or whose
runner died, answers the model with an error observation ("tool f was stopped: timed out after
10 s") and the episode goes on; the worker also writes a DeadLetter for it to rl.dlq
(error_type ``tool_timeout``, ``tool_memory`` or ``tool_crash``; its value is the call as JSON).

The opening prompt is the prompt's chat ``messages`` (or its text as one user message) rendered
with ``apply_chat_template(messages, tools=schemas, add_generation_prompt=True)`` when the
template shows tools; a template that ignores them (SmolLM2-Instruct's has no tools section) gets
a plain-text description of the tools and of the call format in the system message instead, and
a tokenizer without a template gets the same description before the prompt text. That rendered
opening, tools included, is what ``rollout.max_prompt_tokens`` is checked against. Model turns
end at EOS (the template's end-of-message) unless ``rollout.env.stop`` is set. An observation is
what the template writes after the assistant's message: its end-of-message marker (less the
part the model wrote itself, e.g. ``<|im_end|>``), the tool messages and the next assistant
opening. Per-turn logprobs and policy versions are the sample's (``producers.sample``), as for
any environment.

Every step reports ``info["counts"]``: ``tool_calls`` (well-formed), ``malformed_tool_calls``,
``tool_errors``, ``tool_timeouts``, ``tool_memory``, ``tool_crashes``, ``tool_turns``,
``final_answers``; the worker adds them to its metrics as ``env.<name>``, so the share of
well-formed calls is ``tool_calls / (tool_calls + malformed_tool_calls)``. ``info["observe"]``
holds each call's latency (``env.tool_latency_ms``: p50, p90, max in the worker metrics) and
``info["metadata"]["tools"]`` the episode's calls so far, a JSON list of ``{name, ok, error,
latency_ms}`` that the trajectory carries in its metadata.

What this is not: a reward (the reward role scores the final text) nor a sandbox itself.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any

from pydantic import Field

from libs.tools import TOOL_PARSERS, HttpTool, Tool, ToolResult, call_with_timeout, load_tool
from libs.tools.runner import Runner, RunnerDied, RunnerLimits, module_root, pool
from pipeline.config import StrictModel
from pipeline.errors import ConfigError
from producers.envs import Environment, StepResult

TURN_MARK = "\u2063rlstream-turn\u2063"
"""Stands for the model's turn when the template renders the observation: what follows it is the
observation."""


COUNTS = ("tool_calls", "malformed_tool_calls", "tool_errors", "tool_timeouts", "tool_memory", "tool_crashes",
          "tool_turns", "final_answers")  # fmt: skip
STATUS_COUNT = {"timeout": "tool_timeouts", "memory": "tool_memory", "crash": "tool_crashes"}
"""ToolResult.status -> the count a failed call adds to (any other failure: ``tool_errors``)."""
STOPPED = {"timeout": "tool_timeout", "memory": "tool_memory", "crash": "tool_crash"}
"""ToolResult.status of a stopped call -> the error_type of its DeadLetter."""


class ToolEnvOptions(StrictModel):
    tools: list[str | HttpTool] = Field(min_length=1, max_length=64)
    """Built-in name, ``module:function``, or ``{name, url, description, parameters}`` (HTTP POST)."""
    parser: str = "hermes"
    """How tool calls are read from a turn: ``hermes`` (``<tool_call>{json}</tool_call>``) or ``module:Class``."""
    call_timeout_s: float = Field(10.0, gt=0, le=3600)
    """Longest one tool call may run; past it the model is told the call timed out."""
    max_calls_per_turn: int = Field(8, ge=1, le=100)
    """Calls run per turn; the rest are answered with an error."""
    result_max_chars: int = Field(2000, ge=0)
    """A tool result longer than this is cut (0 = no limit)."""
    system_prompt: str = ""
    """System message put first when the conversation has none."""
    tool_memory_mb: int = Field(1024, ge=64, le=1_048_576)
    """Address-space limit (MB) of the process a ``module:function`` tool runs in; a call past it
    is stopped (``tool_memory``). Built-in ``calculator`` (bounded arithmetic) runs in the worker,
    ``python`` in the code sandbox with its own limits."""
    tool_network: bool = False
    """Let ``module:function`` tools reach the network; by default their process has its own
    network namespace with no interface up. HTTP tools are called by the worker and always can."""
    in_process: bool = False
    """Run ``module:function`` tools in the worker's own process on a thread (no memory limit, no
    network isolation, a call past its deadline is abandoned rather than stopped). Only for tools
    you trust that cannot run in a child process."""


@functools.lru_cache(maxsize=64)
def _tools(specs: str, dirs: tuple[str, ...]) -> tuple[Tool, ...]:
    return tuple(load_tool(s, dirs) for s in json.loads(specs))


def tools_of(opts: ToolEnvOptions, dirs=()) -> tuple[Tool, ...]:
    """The options' tools (loaded once per process and option set)."""
    specs = json.dumps([s if isinstance(s, str) else s.model_dump() for s in opts.tools])
    return _tools(specs, tuple(map(str, dirs)))


def runner_limits(opts: ToolEnvOptions, tools: tuple[Tool, ...], dirs=()) -> RunnerLimits:
    """Where the options' ``module:function`` tools run (``libs.tools.runner``): their modules are
    looked up in ``dirs``, then where the worker found them."""
    roots = [r for t in tools if t.ref and (r := module_root(t.ref))]
    return RunnerLimits(opts.tool_memory_mb, opts.tool_network, tuple(dict.fromkeys([*map(str, dirs), *roots])))


def describe_tools(schemas: list[dict]) -> str:
    """Plain-text tools section for a template that has none (Hermes' wording and call format)."""
    lines = "\n".join(json.dumps(s) for s in schemas)
    return (
        "You may call one or more functions to help with the question. The functions are:\n"
        f"<tools>\n{lines}\n</tools>\n"
        "To call a function, write a JSON object with its name and arguments inside tags:\n"
        '<tool_call>{"name": <function-name>, "arguments": <args-object>}</tool_call>\n'
        "The results come back in a tool message. When you have the answer, reply without a tool call."
    )


def overlap(done: str, text: str) -> int:
    """Length of the longest start of ``text`` that ``done`` ends with."""
    for k in range(min(len(done), len(text)), 0, -1):
        if done.endswith(text[:k]):
            return k
    return 0


class ToolEnv(Environment):
    eos_ends_episode = False
    renders_chat = True

    def __init__(self, config: dict[str, Any] | None = None, ctx=None):
        super().__init__(config, ctx)
        self.opts = ToolEnvOptions.model_validate(self.config)
        self.tools = {t.name: t for t in tools_of(self.opts, self.ctx.import_dirs)}
        self.schemas = [t.schema for t in self.tools.values()]
        self.parser = TOOL_PARSERS.build(self.opts.parser, {}, None)
        self.runners = runner_limits(self.opts, tuple(self.tools.values()), self.ctx.import_dirs)
        self.tok = self.ctx.tokenizer
        self.call_log: list[dict] = []
        """The episode's calls: ``{name, ok, error, latency_ms}`` (``metadata["tools"]``)."""

    @classmethod
    def check_options(cls, options: dict[str, Any], import_dirs=()) -> None:
        opts = ToolEnvOptions.model_validate(options)
        tools = tools_of(opts, import_dirs)
        TOOL_PARSERS.get(opts.parser, import_dirs)
        if not opts.in_process and any(t.ref for t in tools):  # the runner starts here (a bad machine: say so now)
            try:
                Runner(runner_limits(opts, tools, import_dirs)).kill()
            except RunnerDied as exc:
                raise ConfigError(str(exc)) from exc

    # -- rendering --------------------------------------------------------------------------------
    def _template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    def _render(self, messages: list[dict], tools: bool, generation: bool) -> str:
        return self.tok.apply_chat_template(
            messages, tools=self.schemas if tools else None, tokenize=False, add_generation_prompt=generation
        )

    def reset(self, prompt: dict, sample_index: int) -> str:
        if prompt.get("messages"):
            messages = json.loads(prompt["messages"])
        else:
            messages = [{"role": "user", "content": prompt.get("_plain_text", prompt["text"])}]
        if self.opts.system_prompt and not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": self.opts.system_prompt}, *messages]
        if self.tok is None or not self._template():
            self.native, self.messages = False, messages
            return describe_tools(self.schemas) + "\n\n" + "\n".join(m["content"] for m in messages) + "\n"
        self.native = self._render(messages, True, True) != self._render(messages, False, True)
        if not self.native:  # the template ignores tools: describe them in the system message
            desc = describe_tools(self.schemas)
            if messages[0].get("role") == "system":
                messages = [{**messages[0], "content": messages[0]["content"] + "\n\n" + desc}, *messages[1:]]
            else:
                messages = [{"role": "system", "content": desc}, *messages]
        self.messages = messages
        return self._render(messages, self.native, True)

    def observation(self, action: str, results: list[tuple[str, str]]) -> str:
        """The text after the model's turn ``action``: the template's tool messages for
        ``results`` ((tool name, content) pairs) and the next assistant opening."""
        tail = None
        if self.tok is not None and self._template():
            msgs = [*self.messages, {"role": "assistant", "content": TURN_MARK}]
            msgs += [{"role": "tool", "name": n, "content": c} for n, c in results]
            try:
                text = self._render(msgs, self.native, True)
            except Exception:  # a template without a tool role: the plain form below
                text = ""
            if text.count(TURN_MARK) == 1:
                tail = text.split(TURN_MARK, 1)[1]
        if tail is None:
            tail = "\n" + "".join(f"<tool_response>\n{c}\n</tool_response>\n" for _, c in results)
        return tail[overlap(action, tail) :]

    # -- a turn -----------------------------------------------------------------------------------
    def call(self, tool: Tool, arguments: dict) -> ToolResult:
        """One call of ``tool``, where it runs (see the module docstring); never raises."""
        o = self.opts
        if tool.ref and not o.in_process:
            return pool(self.runners).call(tool.name, tool.ref, arguments, o.call_timeout_s, o.result_max_chars)
        return call_with_timeout(tool, arguments, o.call_timeout_s, o.result_max_chars)

    def step(self, action: str) -> StepResult:
        parsed = self.parser.parse(action)
        counts = dict.fromkeys(COUNTS, 0)
        counts["tool_calls"], counts["malformed_tool_calls"] = len(parsed.calls), len(parsed.malformed)
        if not parsed.calls and not parsed.malformed:
            counts["final_answers"] = 1
            return StepResult("", 0.0, True, {"counts": counts, **self._log_info()})
        counts["tool_turns"] = 1
        results: list[tuple[str, str]] = []
        latencies, dead = [], []
        for i, call in enumerate(parsed.calls):
            tool, ms = self.tools.get(call.name), 0.0
            if i >= self.opts.max_calls_per_turn:
                res = ToolResult(f"error: more than {self.opts.max_calls_per_turn} calls in one turn", "error")
            elif tool is None:
                res = ToolResult(f"error: no tool {call.name!r}; tools: {', '.join(self.tools)}", "error")
            else:
                t0 = time.monotonic()
                res = self.call(tool, call.arguments)
                ms = round((time.monotonic() - t0) * 1000, 1)
                latencies.append(ms)
                if res.status in STOPPED:
                    dead.append(self._dead_letter(call.name, call.arguments, res))
            results.append((call.name, res.content))
            counts[STATUS_COUNT.get(res.status, "tool_errors")] += not res.ok
            self.call_log.append({"name": call.name, "ok": res.ok, "error": "" if res.ok else res.status,
                                  "latency_ms": ms})  # fmt: skip
        results += [("error", f"error: the tool call could not be read: {why}") for why in parsed.malformed]
        info = {"counts": counts, "calls": results, "observe": {"tool_latency_ms": latencies}, **self._log_info()}
        if dead:
            info["dead_letters"] = dead
        return StepResult(self.observation(action, results), 0.0, False, info)

    def _log_info(self) -> dict:
        return {"metadata": {"tools": json.dumps(self.call_log, separators=(",", ":"))}} if self.call_log else {}

    @staticmethod
    def _dead_letter(name: str, arguments: dict, res: ToolResult) -> dict:
        """What the worker's DeadLetter of a stopped call holds (it adds where the episode came from)."""
        call = {"name": name, "arguments": arguments}
        return {
            "error_type": STOPPED[res.status],
            "reason": f"tool {name}: {res.content.removeprefix('error: ')}",
            "value": json.dumps(call, default=str).encode(),
            "headers": {"tool": name.encode()},
        }
