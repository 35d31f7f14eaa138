"""Chat prompts: render a Prompt's ``messages`` (or its text, as one user message) with the
tokenizer's chat template, with an optional system prompt and the generation prompt.

``prompt_tokens`` gives the token ids a rollout starts from (rendered or plain, within the limits).

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


def prompt_tokens(prompt: dict, tokenizer, rc, max_len: int) -> list[int]:
    """The token ids the engine starts from, under ``rc`` (the rollout section): the chat template
    applied if it should be (the rendered text replaces ``prompt["text"]``), else the plain text.
    InvalidRecord if there are none or more than ``rollout.max_prompt_tokens`` (or ``max_len - 1``)."""
    if uses_template(prompt, rc.chat_template):
        prompt["_plain_text"] = prompt["text"]  # what a chat environment renders itself (producers.tool_env)
        prompt["text"] = render(prompt, tokenizer, rc.system_prompt, rc.add_generation_prompt)
        toks = tokenizer(prompt["text"], add_special_tokens=False).input_ids  # the template has them
    else:
        toks = tokenizer(prompt["text"]).input_ids
    if not toks:  # an engine cannot start from nothing (the hf engine raised on it)
        why = " (chat messages are rendered only by a chat template)" if prompt.get("messages") else ""
        raise InvalidRecord(f"prompt has no tokens: empty text under rollout.chat_template = {rc.chat_template!r}{why}")
    limit = min(rc.max_prompt_tokens, max_len - 1)
    if len(toks) > limit:
        raise InvalidRecord(f"prompt has {len(toks)} tokens, more than the limit {limit}", "too_long")
    return toks
