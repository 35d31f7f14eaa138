"""The repository speaks of the product alone: no references to the project's own issues or pull
requests, no work sessions, no people or process (who wrote what, in which turn). Checked over
every file git knows of (tracked or new, not ignored), text files only, except CHANGELOG.md (the
history belongs there) and this file.

What is flagged, case-insensitively:
* issues and pull requests: the word issue, PR or pull request followed by a number (with or without ``#``), and a bare
  ``#25``. A bare ``#N`` is allowed where it cites an upstream project's tracker on the same line or
  the line before (``librdkafka #5456``, ``confluent-kafka ... #374``, ``KIP-890``; the product's
  own ``Kafka`` does not count), and inside
  words, URLs and colors (``ipv4#127``, ``a#2``, ``"#999999"``).
* work sessions: "session" after this, that, earlier or an ordinal, "sessions of", "session's"
  followed by deadline or run, and "work session" (the patterns below).
  Allowed, because they are other sessions: Kafka's consumer session (``session timeout``,
  ``session.timeout.ms``, ``its session expired``), a POSIX process session (``its own session``,
  ``a new session``, ``start_new_session``), pytest's session (``the test session``,
  ``scope="session"``), and HTTP, W&B or TensorBoard sessions (``requests.Session``, ``SessionLog``)
  — none of these say "this/that/ordinal session".
* people and process: ``another engineer``, ``other engineers``, ``the lead engineer``,
  ``this turn``, ``the author``, ``<someone>'s author``.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = {"CHANGELOG.md", "tests/test_repo_words.py"}
BINARY = {".png", ".jpg", ".jpeg", ".gif", ".ico", ".pdf", ".gz", ".tgz", ".zip", ".whl", ".safetensors", ".bin"}

ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
    "fourteenth|fifteenth|sixteenth|\\d+(?:st|nd|rd|th)|last|previous|earlier|later|next|this|that|"
    "same|another|each|every|one|a|an"
)
ISSUE = re.compile(r"\b(?:issues?|pr|pull requests?)\s*#?\d+\b", re.IGNORECASE)
BARE_NUMBER = re.compile(r"(?<![\w&/#\"'=-])#\d+\b")
UPSTREAM_NAMES = r"librdkafka|confluent-kafka[\w-]*|KIP-\d+|KAFKA-\d+|vllm|transformers|pytorch|deepspeed|\btrl\b"
UPSTREAM = re.compile(UPSTREAM_NAMES, re.IGNORECASE)
UPSTREAM_ISSUE = re.compile(rf"(?:{UPSTREAM_NAMES})(?:'s)?\s+(?:issues?|pr)\s*#?\d+", re.IGNORECASE)
SESSION = re.compile(
    rf"\b(?:{ORDINALS})\s+(?:work\s+)?sessions?\b(?![\s._-]*(?:timeout|timed out|times out|expir))"
    r"|\bsessions\s+of\b|\bsession's\s+(?:deadline|run|rerun|measurement|figures|end|work)\b"
    r"|\bwork\s+sessions?\b|\bfit\s+a\s+session\b",
    re.IGNORECASE,
)
ALLOWED_SESSION = re.compile(
    r"\b(?:a|an|one|its|their)\s+new\s+session\b|\b(?:a|one)\s+session\s+timeout", re.IGNORECASE
)
PEOPLE = re.compile(
    r"\banother\s+engineer\b|\bother\s+engineers\b|\blead\s+engineer\b|\bthis\s+turn\b|\bthe\s+author\b"
    r"|\b[\w-]+'s\s+author\b",
    re.IGNORECASE,
)


def files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    return [f for f in out if f not in SKIP and Path(f).suffix.lower() not in BINARY and (ROOT / f).is_file()]


def hits_in(text: str) -> list[tuple[int, str]]:
    """(line number, the words) of every flagged phrase of a text."""
    out, before = [], ""
    for n, line in enumerate(text.splitlines(), 1):
        found = [m.group(0) for m in ISSUE.finditer(UPSTREAM_ISSUE.sub("", before[-40:] + "\n" + line).split("\n")[-1])]
        if not UPSTREAM.search(before + " " + line):
            found += [m.group(0) for m in BARE_NUMBER.finditer(line)]
        masked = ALLOWED_SESSION.sub("", line)
        found += [m.group(0) for m in SESSION.finditer(masked)]
        found += [m.group(0) for m in PEOPLE.finditer(line)]
        out += [(n, w) for w in found]
        before = line
    return out


def test_the_patterns():
    # the examples are put together here, so the file does not say them itself
    n, s_ = "25", "session"
    flagged = [
        f"(issue {n}'s bar)",
        f"Issue {n} point 7: one bogus notice",
        f"see #{n}",
        f"measured in the twelfth {s_}",
        f"this {s_}'s run",
        f"(2026-11-27, fourth {s_})",
        f"from an earlier {s_}",
        f"the {s_}s of the week",
        "another engineer's edits",
        "from the trainer's author",
        "in this turn",
        f"Kafka security (issue {n}, item 6)",
        "Kafka's fix #25",
    ]
    allowed = [
        "a restart within the session timeout keeps the partitions",
        "``session.timeout.ms`` of the prompt consumer",
        "after its session expired behind a broker fault",
        "one librdkafka never returns from (#5456, after a broker",
        "librdkafka does not implement KIP-890 (#5423)",
        "Connect to ipv4#127.0.0.1:1 failed",
        'color="#999999"',
        "in a new session (its own process group)",
        "Tests marked kafka get a real broker for the whole session.",
        "the test session starts and stops it",
        "SessionLog(status=SessionLog.START)",
        "its session times out",
        "one session timeout later",
        f"the confluent-kafka maintainers advise it; librdkafka\nissue {n}43 asks to keep the fetched data",
    ]
    for text in flagged:
        assert hits_in(text), text
    for text in allowed:
        assert not hits_in(text), (text, hits_in(text))


def test_the_repository_speaks_of_the_product():
    bad = []
    for name in files():
        try:
            text = (ROOT / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        bad += [f"{name}:{n}: {words}" for n, words in hits_in(text)]
    assert not bad, (
        f"{len(bad)} references to issues, work sessions or people (say what the product does):\n" + "\n".join(bad)
    )
