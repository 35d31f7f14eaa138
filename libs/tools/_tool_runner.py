"""Tool runner: the process a ``module:function`` tool's calls run in (``libs.tools.runner``).

Started through the sandbox launcher (``libs.rewards._sandbox_launch``: its own network namespace,
RLIMIT_AS and the other resource limits, a parent-death signal), as
``python _tool_runner.py <spec-json>`` where the spec holds the directories ``module:function`` tools
are looked up in (``PYTHONPATH`` names where rlstream itself is). It reads one request per line on stdin,
``{"tool": "module:function", "arguments": {...}}``, imports the tool once, calls it and writes one
reply per line on its stdout: ``{"status": "ok", "content": text}``, ``{"status": "error",
"content": "TypeError: ..."}`` (the tool raised) or ``{"status": "memory", ...}`` (MemoryError: the
address-space limit; the parent then replaces this process). What the tool prints goes to
stderr, never into the replies.

What this is not: a deadline (the parent kills this process at the call's deadline) nor a
sandbox by itself.
"""

import json
import os
import sys


def _text(value) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def main() -> None:
    spec = json.loads(sys.argv[1])
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the tool's own prints (Python's and C's) go to stderr
    sys.stdout = sys.stderr
    from pipeline.plugins import load_object

    tools: dict = {}
    for line in sys.stdin:
        req = json.loads(line)
        try:
            fn = tools.get(req["tool"])
            if fn is None:
                fn = tools[req["tool"]] = load_object(req["tool"], spec["dirs"])
            if "arguments" not in req:  # a load: import the tool before its first call's deadline starts
                reply = {"status": "ok", "content": ""}
            else:
                text, cap = _text(fn(**req["arguments"])), req.get("max_chars") or 0
                if cap and len(text) > cap:  # cut here: a huge result never crosses the pipe
                    text = text[:cap] + f"... [{len(text) - cap} more characters]"
                reply = {"status": "ok", "content": text}
        except MemoryError:
            reply = {"status": "memory", "content": "MemoryError"}
        except (Exception, SystemExit) as exc:  # the tool's failure is the model's observation
            reply = {"status": "error", "content": f"{type(exc).__name__}: {exc}"}
        try:
            replies.write(json.dumps(reply) + "\n")
        except MemoryError:
            replies.write('{"status": "memory", "content": "MemoryError"}\n')


if __name__ == "__main__":
    main()
