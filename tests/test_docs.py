"""The docs run and stay current.

* The generated reference pages (``docs/reference/{cli,config,metrics}.md``) equal what
  ``python -m rlstream.dev.docgen`` makes from the code now.
* Every fenced shell block in README.md and docs/**/*.md says what it is: ```` ```bash run ````
  (each command is executed here, from the repository root, with this environment's ``rlstream``
  on PATH: only quick commands are marked so) or ```` ```bash example ```` (shown, not run). A
  plain ```` ```bash ````, ```` ```sh ````, ```` ```shell ```` or ```` ```console ```` block fails
  with its file and line.
* Every relative link and image path in those pages exists (anchors are not checked).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHELL_LANGS = {"bash", "sh", "shell", "console", "zsh", "shell-session", "shellsession"}
MARKS = {"run", "example"}
RUN_TIMEOUT_S = 600
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([^`]*)$")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_SRC = re.compile(r"""<(?:img|a)\b[^>]*?\b(?:src|href)=["']([^"']+)["']""", re.IGNORECASE)
INLINE_CODE = re.compile(r"`+[^`]*`+")


def pages() -> list[Path]:
    return [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))] if p.is_file()]


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


def blocks(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line of the opening fence, info string, lines) of every fenced block of a page."""
    out, open_at, fence, info, body = [], 0, "", "", []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = FENCE.match(line)
        if not open_at:
            if m:
                open_at, fence, info, body = n, m.group(1), m.group(2).strip(), []
        elif m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not m.group(2).strip():
            out.append((open_at, info, body))
            open_at = 0
        else:
            body.append(line)
    if open_at:
        out.append((open_at, info, body))
    return out


def shell_blocks() -> list[tuple[str, str, list[str]]]:
    """(file:line, mark, lines) of every fenced shell block."""
    out = []
    for path in pages():
        for n, info, body in blocks(path):
            words = info.split()
            if words and words[0].lower() in SHELL_LANGS:
                out.append((_where(path, n), " ".join(words[1:]), body))
    return out


def commands(body: list[str]) -> list[str]:
    """The command lines of a block: comments and blank lines dropped, ``\\`` continuations joined,
    a leading ``$ `` prompt removed."""
    out, pending = [], ""
    for raw in body:
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        line = line.removeprefix("$ ")
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        out.append(pending + line)
        pending = ""
    if pending.strip():
        out.append(pending.strip())
    return out


# ---- the generated reference ---------------------------------------------------------------------
def test_generated_reference_is_current():
    from rlstream.dev import docgen

    stale = [str(p.relative_to(ROOT)) for p in docgen.stale()]
    assert not stale, f"{', '.join(stale)} differ from the code: run `{docgen.COMMAND}` to refresh them"


# ---- fenced shell blocks -------------------------------------------------------------------------
def test_every_shell_block_is_marked():
    bad = [
        f"{where}: ```{'bash ' + mark if mark else 'bash'}" for where, mark, _ in shell_blocks() if mark not in MARKS
    ]
    assert not bad, (
        "fenced shell blocks must be ```bash run``` (executed by this test) or ```bash example``` "
        "(not executed):\n" + "\n".join(bad)
    )


RUN_BLOCKS = [(where, body) for where, mark, body in shell_blocks() if mark == "run"]


@pytest.mark.parametrize(("where", "body"), RUN_BLOCKS or [pytest.param("", [], marks=pytest.mark.skip("none"))])
def test_run_block(where, body, tmp_path):
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("RLSTREAM_HOME", str(tmp_path / "home"))
    for cmd in commands(body):
        try:
            done = subprocess.run(
                ["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"{where}: `{cmd}` ran past {RUN_TIMEOUT_S} s")
        assert done.returncode == 0, (
            f"{where}: `{cmd}` exited {done.returncode}\n--- stdout\n{done.stdout[-3000:]}\n"
            f"--- stderr\n{done.stderr[-3000:]}"
        )


def test_command_lines_are_read_as_a_shell_would():
    body = ["# a comment", "", "$ rlstream --help", "rlstream run job.toml \\", "  --steps 3"]
    assert commands(body) == ["rlstream --help", "rlstream run job.toml --steps 3"]
    assert shlex.split(commands(body)[1])[-1] == "3"


# ---- links ----------------------------------------------------------------------------------------
def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every link and image outside code."""
    fenced = {n for start, _, body in blocks(path) for n in range(start, start + len(body) + 2)}
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if n in fenced:
            continue
        text = INLINE_CODE.sub("", line)
        out += [(n, t) for t in LINK.findall(text) + HTML_SRC.findall(text)]
    return out


def test_relative_links_exist():
    bad = []
    for path in pages():
        for n, target in links(path):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
                continue  # a URL (https:, mailto:) or an anchor of the page itself
            rel = target.split("#", 1)[0].split("?", 1)[0]
            if rel and not (path.parent / rel).exists():
                bad.append(f"{_where(path, n)}: {target}")
    assert not bad, "links to missing files:\n" + "\n".join(bad)


def test_doc_paths_named_in_the_code_exist():
    """A docs page named in code, config or scripts (a docstring's "see docs/<page>.md") exists."""
    names = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True
    ).stdout.splitlines()
    bad = []
    for name in names:
        if Path(name).suffix not in {".py", ".toml", ".sh", ".yaml", ".yml", ".cfg"} or not (ROOT / name).is_file():
            continue
        for n, line in enumerate((ROOT / name).read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            bad += [f"{name}:{n}: {p}" for p in re.findall(r"\bdocs/[\w./-]+\.md\b", line) if not (ROOT / p).exists()]
    assert not bad, "pages named in the code that do not exist:\n" + "\n".join(bad)
