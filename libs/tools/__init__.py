"""Tools a model may call in a multi-turn episode (``producers.tool_env``): the ``Tool`` spec and
its JSON schema, calls run with a deadline (``libs.tools.base``), ``module:function`` tools run in
a tool-runner process with a memory limit and no network (``libs.tools.runner``), the tool-call parsers
(``libs.tools.parsers``) and the built-in tools (``libs.tools.builtin``: ``calculator``, ``python``).

What this is not: an environment or a conversation; the tool environment owns those.
"""

from libs.tools.base import TOOLS, HttpTool, Tool, ToolResult, call_with_timeout, load_tool
from libs.tools.parsers import TOOL_PARSERS, ParsedTurn, ToolCall, ToolCallParser

__all__ = [
    "TOOLS",
    "TOOL_PARSERS",
    "HttpTool",
    "ParsedTurn",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolResult",
    "call_with_timeout",
    "load_tool",
]
