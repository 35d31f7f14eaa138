"""docs/troubleshooting.md and the code agree: every typed error a command can print
(``error: Name: text``), every stall the live view names (``stalled: <stage>``) and every
dead-letter type has a section on the page, and the page has no section for one that no longer
exists. The names are read from the code: error classes and dead-letter types with ``ast``, the
stall stages from ``rlstream.stall``."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "troubleshooting.md"
CODE_DIRS = ("pipeline", "producers", "consumers", "rlstream", "libs")
DEAD_LETTER_CALLS = ("reject", "dead_letter", "_dead_letter", "_produce_dead", "InvalidRecord", "DecodeError")
"""Calls whose second positional argument is a dead letter's error type."""


def _sources():
    for top in CODE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "dev" not in path.relative_to(ROOT).parts:
                yield path, ast.parse(path.read_text(encoding="utf-8"))


def _text(node) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def error_classes() -> set[str]:
    """Every class deriving (through any chain of the project's classes) from RlstreamError."""
    bases: dict[str, set[str]] = {}
    for _, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                names = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                bases.setdefault(node.name, set()).update(names)
    found = {"RlstreamError"}
    while True:
        more = {c for c, bs in bases.items() if c not in found and bs & found}
        if not more:
            return found
        found |= more


def dead_letter_types() -> set[str]:
    """Every literal error type a dead letter can carry: ``error_type="x"`` arguments, defaults and
    assignments; the second argument of the dead-lettering calls; ``(type, reason)`` returned by a
    notice check (a function named ``*problem``)."""
    out: set[str] = set()
    for _, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                pos = a.posonlyargs + a.args
                pairs = [
                    *zip(pos[len(pos) - len(a.defaults) :], a.defaults, strict=True),
                    *zip(a.kwonlyargs, a.kw_defaults, strict=True),
                ]
                out |= {_text(d) for arg, d in pairs if arg.arg == "error_type" and d is not None}
                if node.name.endswith("problem"):
                    for r in ast.walk(node):
                        if isinstance(r, ast.Return) and isinstance(r.value, ast.Tuple) and len(r.value.elts) == 2:
                            out.add(_text(r.value.elts[0]))
            elif isinstance(node, ast.Call):
                out |= {_text(k.value) for k in node.keywords if k.arg == "error_type"}
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if name in DEAD_LETTER_CALLS and len(node.args) >= 2:
                    out.add(_text(node.args[1]))
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    multi = isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                    for t, v in zip(target.elts, node.value.elts, strict=False) if multi else [(target, node.value)]:
                        if (t.attr if isinstance(t, ast.Attribute) else getattr(t, "id", "")) == "error_type":
                            out.add(_text(v))
    out.discard(None)
    from rlstream.stall import DeadLetters

    return out | {DeadLetters.UNDECODABLE[1]}


def stall_names() -> set[str]:
    from rlstream import stall

    assert "stalled: no step" in inspect.getsource(stall.StallWatch.verdict)
    return {f"stalled: {stage}" for stage in stall.OUTPUT} | {"stalled: no step"}


def page_sections() -> dict[str, set[str]]:
    """``## Title`` -> the code-span headings (``### `Name` ``) under it."""
    out: dict[str, set[str]] = {}
    current = ""
    for line in PAGE.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            current = line[3:].strip()
            out[current] = set()
        elif m := re.match(r"^### `([^`]+)`\s*$", line):
            out.setdefault(current, set()).add(m.group(1))
    return out


def _agree(section: str, code: set[str]) -> None:
    page = page_sections().get(section, set())
    missing, gone = sorted(code - page), sorted(page - code)
    assert not missing, f"docs/troubleshooting.md, '## {section}': no section for {missing} (in the code)"
    assert not gone, f"docs/troubleshooting.md, '## {section}': {gone} no longer exist in the code"


def test_every_error_type_is_explained():
    found = error_classes()
    assert {"ConfigError", "JobChanged", "BrokerUnreachable"} <= found
    _agree("Errors", found)


def test_every_stall_is_explained():
    names = stall_names()
    assert "stalled: reward" in names
    _agree("Stalls", names)


def test_every_dead_letter_type_is_explained():
    types = dead_letter_types()
    assert {"decode", "invalid", "too_long", "reward_error", "env_timeout", "unsigned_notice"} <= types
    _agree("Dead letters", types)
