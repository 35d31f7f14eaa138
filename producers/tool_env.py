"""The tool-calling environment (``tools``): the model is shown the job's tools through its chat
template, its tool calls are read by a parser and run with a deadline, and their results come
back as the template's tool messages (observation tokens, loss_mask 0). An episode ends on the
first model turn without a tool call: the final answer, which the reward role scores.

Options (``[rollout.env.options.<task>]``, ``ToolEnvOptions``): ``tools``, each a built-in name
(``calculator``, ``python``), a ``module:function`` (schema from its signature and docstring, or
its ``tool_schema`` attribute) or an HTTP tool table (``libs.tools.base.HttpTool``); ``parser``
(``hermes`` or ``module:Class``); ``call_timeout_s``; ``max_calls_per_turn``; ``result_max_chars``;
``system_prompt``.

The opening prompt is the prompt's chat ``messages`` (or its text as one user message) rendered
with ``apply_chat_template(messages, tools=schemas, add_generation_prompt=True)`` when the
template shows tools; a template that ignores them (SmolLM2-Instruct's has no tools section) gets
a plain-text description of the tools and of the call format in the system message instead, and
a tokenizer without a template gets the same description before the prompt text. An observation
is what the template writes after the assistant's message: its end-of-message marker (less the
part the model wrote itself, e.g. ``<|im_end|>``), the tool messages and the next assistant
opening. Per-turn logprobs and policy versions are the sample's (``producers.sample``), as for
any environment.

Every step reports ``info["counts"]``: ``tool_calls`` (well-formed), ``malformed_tool_calls``,
``tool_errors``, ``tool_timeouts``, ``tool_turns``, ``final_answers``; the worker adds them to its
metrics as ``env.<name>``, so the share of well-formed calls is
``tool_calls / (tool_calls + malformed_tool_calls)``.

What this is not: a reward (the reward role scores the final text) nor a sandbox (``python`` runs
in ``libs.rewards.sandbox``; a ``module:function`` tool runs in the worker's process).
"""

from __future__ import annotations

import functools
import json
from typing import Any

from pydantic import Field

from libs.tools import TOOL_PARSERS, HttpTool, Tool, call_with_timeout, load_tool
from pipeline.config import StrictModel
from producers.envs import Environment, StepResult

TURN_MARK = "\u2063rlstream-turn\u2063"
"""Stands for the model's turn when the template renders the observation: what follows it is the
observation."""


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


@functools.lru_cache(maxsize=64)
def _tools(specs: str, dirs: tuple[str, ...]) -> tuple[Tool, ...]:
    return tuple(load_tool(s, dirs) for s in json.loads(specs))


def tools_of(opts: ToolEnvOptions, dirs=()) -> tuple[Tool, ...]:
    """The options' tools (loaded once per process and option set)."""
    specs = json.dumps([s if isinstance(s, str) else s.model_dump() for s in opts.tools])
    return _tools(specs, tuple(map(str, dirs)))


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
        self.tok = self.ctx.tokenizer

    @classmethod
    def check_options(cls, options: dict[str, Any], import_dirs=()) -> None:
        opts = ToolEnvOptions.model_validate(options)
        tools_of(opts, import_dirs)
        TOOL_PARSERS.get(opts.parser, import_dirs)

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
    def step(self, action: str) -> StepResult:
        parsed = self.parser.parse(action)
        counts = dict.fromkeys(
            ("tool_calls", "malformed_tool_calls", "tool_errors", "tool_timeouts", "tool_turns", "final_answers"), 0
        )
        counts["tool_calls"], counts["malformed_tool_calls"] = len(parsed.calls), len(parsed.malformed)
        if not parsed.calls and not parsed.malformed:
            counts["final_answers"] = 1
            return StepResult("", 0.0, True, {"counts": counts})
        counts["tool_turns"] = 1
        results: list[tuple[str, str]] = []
        for i, call in enumerate(parsed.calls):
            tool = self.tools.get(call.name)
            if i >= self.opts.max_calls_per_turn:
                results.append((call.name, f"error: more than {self.opts.max_calls_per_turn} calls in one turn"))
                counts["tool_errors"] += 1
            elif tool is None:
                results.append((call.name, f"error: no tool {call.name!r}; tools: {', '.join(self.tools)}"))
                counts["tool_errors"] += 1
            else:
                res = call_with_timeout(tool, call.arguments, self.opts.call_timeout_s, self.opts.result_max_chars)
                results.append((call.name, res.content))
                counts["tool_errors"] += res.status == "error"
                counts["tool_timeouts"] += res.status == "timeout"
        results += [("error", f"error: the tool call could not be read: {why}") for why in parsed.malformed]
        return StepResult(self.observation(action, results), 0.0, False, {"counts": counts, "calls": results})
