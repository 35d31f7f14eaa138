"""Chat prompts: render a Prompt's ``messages`` (or its text, as one user message) with the
tokenizer's chat template, with an optional system prompt and the generation prompt.

What this is not: a conversation manager for multi-turn environments (``producers.envs``); it only
renders the opening prompt.
"""

from __future__ import annotations

import json

from pipeline.records import InvalidRecord


def uses_template(prompt: dict, mode: str) -> bool:
    """Whether ``rollout.chat_template`` (auto | always | never) applies to this prompt."""
    return mode == "always" or (mode == "auto" and bool(prompt.get("messages")))


def render(prompt: dict, tokenizer, system_prompt: str = "", add_generation_prompt: bool = True) -> str:
    """The prompt text the model sees; InvalidRecord if the messages are malformed or the tokenizer
    has no chat template."""
    try:
        messages = (
            json.loads(prompt["messages"]) if prompt.get("messages") else [{"role": "user", "content": prompt["text"]}]
        )
    except json.JSONDecodeError as exc:
        raise InvalidRecord(f"messages are not valid JSON: {exc}") from exc
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in messages
    ):
        raise InvalidRecord("messages must be a list of {role, content}")
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": system_prompt}, *messages]
    if not getattr(tokenizer, "chat_template", None):
        fix = ("a chat-messages prompt needs a model with one" if prompt.get("messages")
               else 'set rollout.chat_template = "auto" or "never"')  # fmt: skip
        raise InvalidRecord(f"the tokenizer has no chat template: {fix}")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # a template error is about this prompt's messages: dead-letter it
        raise InvalidRecord(f"chat template failed: {type(exc).__name__}: {exc}") from exc
