"""A tool the model may call: its name, its JSON schema (what the chat template shows the model)
and the function that runs it; a call runs with a deadline and never raises.

A tool is a Python callable named by a built-in name (``TOOLS``: ``calculator``, ``python``) or
``package.module:function``, or an HTTP endpoint (``HttpTool``: the arguments are POSTed as a JSON
object, the response body is the result). A callable's schema is its ``tool_schema`` attribute
(an OpenAI function schema: ``{"type": "function", "function": {...}}``) if it has one, else it is
built from its signature and Google-style docstring (``transformers.utils.get_json_schema``, what
``apply_chat_template(tools=[fn])`` does too: every argument needs a type hint and an ``Args:``
line).

Calls run on a daemon thread joined with a deadline: a tool that hangs is abandoned (its thread
is left to finish on its own and never blocks the process's exit) and the call reports a timeout.
A Python thread cannot be killed, so only built-in and HTTP tools run this way; a user's
``module:function`` tool runs in a tool-runner process with a memory limit and no network, killed
at its deadline (``libs.tools.runner``), and the ``python`` tool runs in the reward sandbox
(``libs.rewards.sandbox``).

What this is not: a parser of the model's calls (``libs.tools.parsers``) nor a sandbox.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from pipeline.config import StrictModel
from pipeline.errors import ConfigError
from pipeline.plugins import Registry

TOOLS = Registry(
    "tool", {"calculator": "libs.tools.builtin:calculator", "python": "libs.tools.builtin:python"},
    hint="module:function",
)  # fmt: skip


@dataclass(frozen=True)
class Tool:
    name: str
    schema: dict
    """OpenAI function schema: ``{"type": "function", "function": {"name", "description", "parameters"}}``."""
    fn: Callable[..., Any]
    """Called with the call's arguments as keywords; its result is turned into text."""
    ref: str = ""
    """``module:function`` of a user's tool (its calls run in a tool runner, ``libs.tools.runner``);
    empty for built-in and HTTP tools."""


@dataclass
class ToolResult:
    content: str
    """What the model is shown (the tool message's content)."""
    status: str = "ok"
    """ok | error (the tool raised, or its arguments do not fit it) | timeout | memory (past the
    runner's memory limit) | crash (its runner ended during the call)"""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def schema_of(fn: Callable) -> dict:
    """The tool schema of ``fn``: its ``tool_schema`` attribute, else from signature and docstring."""
    schema = getattr(fn, "tool_schema", None)
    if schema is None:
        from transformers.utils import get_json_schema

        try:
            schema = get_json_schema(fn)
        except Exception as exc:  # a missing type hint or Args: line; say which tool
            raise ConfigError(
                f"tool {getattr(fn, '__name__', fn)!r}: no schema from its signature and docstring "
                f"({exc}); give it a tool_schema attribute or a Google-style docstring with Args:"
            ) from exc
    if not isinstance(schema, dict) or not isinstance(schema.get("function", {}).get("name"), str):
        raise ConfigError(f"tool {getattr(fn, '__name__', fn)!r}: tool_schema must be {{'type': 'function', "
                          "'function': {'name': ..., 'parameters': ...}}")  # fmt: skip
    return schema


def load_tool(spec: str | dict, dirs: list[str | Path] | tuple = ()) -> Tool:
    """A Tool from its config entry: a built-in name, ``module:function``, or an HTTP tool table
    (``HttpTool``'s fields)."""
    if isinstance(spec, dict | HttpTool):
        return HttpTool.model_validate(spec).tool()
    fn = TOOLS.get(spec, dirs)
    if not callable(fn):
        raise ConfigError(f"tool {spec!r} is not callable")
    schema = schema_of(fn)
    return Tool(schema["function"]["name"], schema, fn, "" if spec in TOOLS.names() else spec)


class HttpTool(StrictModel):
    """A tool served over HTTP: each call POSTs its arguments as a JSON object to ``url``; the
    response body (text) is the result, a non-2xx status is a tool error."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z_][\w.-]*$")
    url: str = Field(pattern=r"^https?://")
    description: str = ""
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    """JSON schema of the arguments object."""
    headers: dict[str, str] = Field(default_factory=dict)

    def tool(self) -> Tool:
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return Tool(self.name, {"type": "function", "function": fn}, self._call)

    def _call(self, **arguments) -> str:
        req = urllib.request.Request(
            self.url, json.dumps(arguments).encode(), {"Content-Type": "application/json", **self.headers}
        )
        with urllib.request.urlopen(req) as resp:  # the call's deadline bounds it (call_with_timeout)
            return resp.read().decode("utf-8", "replace")


def as_text(value: Any) -> str:
    """A tool's return value as the text the model sees (JSON for anything but a string)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def call_with_timeout(tool: Tool, arguments: dict, timeout_s: float, max_chars: int = 0) -> ToolResult:
    """Run one call on a daemon thread for at most ``timeout_s``; never raises. The result is cut
    to ``max_chars`` (0 = no limit)."""
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = tool.fn(**arguments)
        except BaseException as exc:  # a tool's failure (wrong arguments included) is an observation
            box["error"] = exc

    t = threading.Thread(target=target, name=f"tool-{tool.name}", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        return ToolResult(f"error: {tool.name} timed out after {timeout_s:g}s", "timeout")
    if "error" in box:
        exc = box["error"]
        return ToolResult(f"error: {type(exc).__name__}: {exc}", "error")
    return ToolResult(cut(as_text(box.get("value")), max_chars))


def cut(text: str, max_chars: int) -> str:
    """``text`` cut to ``max_chars`` (0 = no limit), saying how much was left out."""
    if max_chars and len(text) > max_chars:
        return text[:max_chars] + f"... [{len(text) - max_chars} more characters]"
    return text
