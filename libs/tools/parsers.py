"""Tool-call parsers: the text of one model turn -> the tool calls in it, and the ones that could
not be read. One registry (``TOOL_PARSERS``), a ``module:Class`` plug-in like every other kind.

Built-in: ``hermes``, the Hermes / Qwen format ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
one or more per turn; a tag may also hold a JSON list of calls, which is how SmolLM2's instruct
models write them (``<tool_call>[{...}, {...}]</tool_call>``). ``arguments`` may be an object or
a string of JSON (as OpenAI's API sends it).

What this is not: a tool runner (``libs.tools.base``) nor a judge of the arguments' types.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from pipeline.plugins import Registry


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedTurn:
    calls: list[ToolCall] = field(default_factory=list)
    """Well-formed calls, in the order written."""
    malformed: list[str] = field(default_factory=list)
    """Why each call that could not be read was refused (one entry per call)."""


class ToolCallParser(ABC):
    """Reads the tool calls of one model turn. Subclasses take ``(config: dict, ctx)`` (``ctx``
    is unused today: None)."""

    def __init__(self, config: dict | None = None, ctx: Any = None):
        self.config = dict(config or {})

    @abstractmethod
    def parse(self, text: str) -> ParsedTurn:
        """The calls in ``text`` (a model turn, special tokens included)."""


def read_call(obj: Any) -> ToolCall | str:
    """A ``{"name": str, "arguments": object | JSON string}`` object as a ToolCall, else why not."""
    if not isinstance(obj, dict):
        return f"a tool call must be a JSON object, not {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return 'a tool call needs a "name" string'
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return f"{name}: arguments are not valid JSON: {exc}"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f'{name}: "arguments" must be a JSON object'
    return ToolCall(name, args)


class HermesParser(ToolCallParser):
    """``<tool_call>...</tool_call>`` tags holding a JSON call or a JSON list of calls. A tag left
    open at the end of the turn (the turn was cut) is one malformed call."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        out = ParsedTurn()
        pattern = re.compile(re.escape(self.OPEN) + r"(.*?)(" + re.escape(self.CLOSE) + r"|$)", re.DOTALL)
        for m in pattern.finditer(text):
            body, closed = m.group(1).strip(), bool(m.group(2))
            if not closed:
                out.malformed.append(f"{self.OPEN} without {self.CLOSE}")
                continue
            try:
                obj = json.loads(body)
            except json.JSONDecodeError as exc:
                out.malformed.append(f"not valid JSON: {exc}")
                continue
            for item in obj if isinstance(obj, list) else [obj]:
                got = read_call(item)
                (out.calls if isinstance(got, ToolCall) else out.malformed).append(got)
        return out


TOOL_PARSERS = Registry("tool-call parser", {"hermes": "libs.tools.parsers:HermesParser"}, base=ToolCallParser)
