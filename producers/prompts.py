"""What a rollout worker accepts from rl.prompts: a Prompt record that decodes and makes sense.

``parse_prompt`` decodes one message and checks it before any sample is generated; a message that
fails raises ``BadPrompt`` with a typed reason, and the worker dead-letters it (the message is
acknowledged through rl.dlq, so its neighbours and the commit order are unaffected).

What this is not: the feed's dataset checks (``producers.datasets``), which refuse a bad
dataset before anything is published.
"""

from __future__ import annotations

from pipeline.errors import DecodeError
from pipeline.kafka import decode_message

MAX_TEXT_CHARS = 1 << 20
"""Longest prompt text accepted (characters); longer ones are dead-lettered as too_long."""


class BadPrompt(Exception):
    """A prompt message the worker cannot generate for. ``error_type`` names the DLQ reason."""

    def __init__(self, error_type: str, reason: str):
        super().__init__(reason)
        self.error_type, self.reason = error_type, reason


def parse_prompt(msg, tokenize, max_prompt_tokens: int, max_len: int) -> dict:
    """The decoded, checked Prompt of ``msg`` with its token ids in ``_tokens``; BadPrompt if not."""
    try:
        prompt = decode_message(msg, "Prompt")
    except DecodeError as exc:
        raise BadPrompt(exc.error_type, str(exc)) from exc
    check_prompt(prompt)
    toks = tokenize(prompt["text"])
    if len(toks) > max_prompt_tokens or len(toks) >= max_len:
        limit = min(max_prompt_tokens, max_len - 1)
        raise BadPrompt("too_long", f"prompt has {len(toks)} tokens, more than the limit {limit}")
    prompt["_tokens"] = toks
    return prompt


def check_prompt(p: dict) -> None:
    """Semantic checks of a decoded Prompt (the schema already fixed the types)."""
    n, start, count = p["group_size"], p["sample_start"], p["sample_count"]
    if n < 1:
        raise BadPrompt("invalid", f"group_size {n} < 1")
    if count < 1 or start < 0 or start + count > n:
        raise BadPrompt("invalid", f"samples [{start}, {start + count}) do not fit group_size {n}")
    if p["group_seq"] < -1:
        raise BadPrompt("invalid", f"group_seq {p['group_seq']} is negative (only -1, unnumbered, is allowed)")
    if p["max_new_tokens"] is not None and p["max_new_tokens"] <= 0:
        raise BadPrompt("invalid", f"max_new_tokens {p['max_new_tokens']} <= 0")
    if not p["text"]:
        raise BadPrompt("invalid", "empty prompt text")
    if len(p["text"]) > MAX_TEXT_CHARS:
        raise BadPrompt("too_long", f"prompt text has {len(p['text'])} characters, more than {MAX_TEXT_CHARS}")
    if not p["group_id"] or not p["task"]:
        raise BadPrompt("invalid", "empty group_id or task")
