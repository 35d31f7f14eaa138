"""Supervised demonstrations as scored trajectories: a chat conversation (OpenAI ``messages``, with
``tool_calls`` on assistant turns and ``tool`` turns) becomes one ScoredTrajectory that the
trainer trains with the ``sft`` loss, with no rollout and no reward.

The conversation is rendered as a live episode of the same task would be: a task the job runs
in the ``tools`` environment (``rollout.env.tasks.<task> = "tools"``) is rendered by that
environment (its system prompt, its tool schemas or their plain-text description, its chat
template calls); any other task by the chat template alone. The prompt is everything before the
first assistant turn, with the assistant opening (``add_generation_prompt``), exactly the tokens a
rollout worker would start from. The response is the rest: each assistant turn's text up to and
including the end-of-message token (the tokens a model writes, ``loss_mask`` 1) and everything
else, the template's role headers, tool results and later user turns (``loss_mask`` 0), tokenized
segment by segment as a live episode tokenizes turns and observations. An assistant turn's
``tool_calls`` are written as the text a model writes in a live episode: the content, then one
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` per call (the ``hermes`` parser's
format), so the tools environment's parser reads back exactly those calls.

The record is a group of one (``group_size`` 1), reward 0, version 0, behaviour logprobs 0 and
``metadata["demonstration"] = "1"`` (``pipeline.records.DEMO_KEY``): no policy generated it, so
the trainer's staleness bound does not apply to it (``consumers.trainer.staleness``).

What this is not: a data loader for the trainer (the feed writes these records to rl.scored,
``producers.feed``), nor a check that the demonstrations are right.
"""

from __future__ import annotations

import json

from libs.datasets import normalize, read_raw
from libs.tools.parsers import HermesParser
from pipeline.codec import pack_f32, pack_i32
from pipeline.control import now_ms
from pipeline.errors import ConfigError
from pipeline.records import DEMO_KEY, InvalidRecord
from producers.envs import EnvContext, env_factory
from producers.tool_env import ToolEnv


def call_text(calls: list[dict]) -> str:
    """OpenAI ``tool_calls`` as the text a model writes for them (one hermes tag per call)."""
    out = []
    for c in calls:
        fn = c.get("function", c) if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRecord(f"a tool call needs a function name: {json.dumps(c)[:120]}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as exc:
                raise InvalidRecord(f"tool call {fn['name']}: arguments are not JSON: {exc}") from None
        body = json.dumps({"name": fn["name"], "arguments": args})
        out.append(f"{HermesParser.OPEN}{body}{HermesParser.CLOSE}")
    return "\n".join(out)


def as_turns(messages: list[dict]) -> list[dict]:
    """The conversation as plain-content messages, as a live episode renders them: assistant
    ``tool_calls`` become call text, a ``tool`` turn is named after the call it answers."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRecord("messages must be a non-empty list")
    names: dict[str, str] = {}
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise InvalidRecord(f"a message needs a role system|user|assistant|tool: {json.dumps(m)[:120]}")
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise InvalidRecord(f"{m['role']} message content must be a string")
        if m["role"] == "assistant" and m.get("tool_calls"):
            for c in m["tool_calls"]:
                if isinstance(c, dict) and c.get("id"):
                    names[c["id"]] = (c.get("function") or {}).get("name", "")
            content = "\n".join(p for p in (content, call_text(m["tool_calls"])) if p)
        msg = {"role": m["role"], "content": content}
        if m["role"] == "tool":
            msg["name"] = m.get("name") or names.get(m.get("tool_call_id", ""), "") or "tool"
        out.append(msg)
    return out


class Demonstrations:
    """Renders conversations into (prompt tokens, response tokens, loss mask) for one job: its
    tokenizer and the environments of its tasks (``rollout.env``)."""

    def __init__(self, cfg, tokenizer):
        self.tok = tokenizer
        self.env_cfg = cfg.rollout.env
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("feed.mode = 'sft' needs a model with a chat template (model.chat_template)")
        self.eos = tokenizer.eos_token or ""

    def _renderer(self, task: str, head: list[dict]):
        """(prompt text, render(messages, generation) -> text, the conversation head as rendered)."""
        spec = self.env_cfg.tasks.get(task)
        if spec is not None and issubclass(env_factory(spec, self.env_cfg.import_dirs), ToolEnv):
            ctx = EnvContext(task, "feed", self.tok, tuple(self.env_cfg.import_dirs))
            env = ToolEnv(self.env_cfg.options.get(task, {}), ctx)
            prompt = env.reset({"messages": json.dumps(head), "text": ""}, 0)
            return prompt, lambda msgs, gen: env._render(msgs, env.native, gen), env.messages

        def render(msgs, gen):
            return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

        return render(head, True), render, head

    def tokens(self, messages: list[dict], task: str) -> tuple[str, list[int], list[int], list[int], str]:
        """(prompt text, prompt ids, response ids, loss mask, response text); InvalidRecord if the
        conversation has no assistant turn or the template does not render it turn by turn."""
        turns = as_turns(messages)
        first = next((i for i, m in enumerate(turns) if m["role"] == "assistant"), None)
        if first is None or first == 0:
            raise InvalidRecord("a demonstration needs a user turn and then an assistant turn")
        prompt, render, head = self._renderer(task, turns[:first])
        convo = [*head, *turns[first:]]
        full = render(convo, False)
        if not full.startswith(prompt):
            raise InvalidRecord("the chat template does not render the prompt as the start of the conversation")
        offset = len(head) - first
        segments: list[tuple[str, int]] = []
        pos = len(prompt)
        for i, m in enumerate(turns):
            if m["role"] != "assistant" or i < first:
                continue
            j = i + offset
            start, end = len(render(convo[:j], True)), len(render(convo[: j + 1], False))
            if not (pos <= start <= end) or not full.startswith(render(convo[: j + 1], False)):
                raise InvalidRecord("the chat template does not render the conversation turn by turn")
            span = full[start:end]
            if self.eos and self.eos in span:  # the model's turn ends at its end-of-message token
                end = start + span.rindex(self.eos) + len(self.eos)
            segments += [(full[pos:start], 0), (full[start:end], 1)]
            pos = end
        segments.append((full[pos:], 0))
        ids, mask = [], []
        for text, m in segments:
            if text:
                seg = self.tok(text, add_special_tokens=False).input_ids
                ids += seg
                mask += [m] * len(seg)
        while mask and mask[-1] == 0:  # nothing after the last assistant turn is trained or needed
            mask.pop()
            ids.pop()
        p_ids = self.tok(prompt, add_special_tokens=False).input_ids
        if not ids or not p_ids:
            raise InvalidRecord("the demonstration renders to no prompt or no assistant tokens")
        return prompt, p_ids, ids, mask, full[len(prompt) :]


def scored_record(record: dict, g: int, epoch: int, rendered, feed_name: str) -> dict:
    """The ScoredTrajectory of demonstration ``record`` (a raw dataset row with ``messages``), the
    ``g``-th group of the feed: a group of one keyed by its group id."""
    prompt_text, p_ids, r_ids, mask, response_text = rendered
    group_id = f"{record['prompt_id']}@e{epoch}"
    traj = {
        "trajectory_id": f"{group_id}/0",
        "group_id": group_id,
        "group_seq": g,
        "prompt_id": record["prompt_id"],
        "sample_index": 0,
        "group_size": 1,
        "task": record["task"],
        "prompt_text": prompt_text,
        "response_text": response_text,
        "prompt_tokens": pack_i32(p_ids),
        "response_tokens": pack_i32(r_ids),
        "logprobs": pack_f32([0.0] * len(r_ids)),
        "loss_mask": bytes(mask),
        "finish_reason": "stop",
        "version_min": 0,
        "version_max": 0,
        "reference": record.get("reference", ""),
        "worker_id": f"feed/{feed_name}",
        "engine": "demonstration",
        "num_turns": sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])),
        "metadata": {DEMO_KEY: "1", "feed": feed_name, "epoch": str(epoch)},
    }
    return {
        "trajectory": traj,
        "reward": 0.0,
        "reward_details": {},
        "scorer_id": f"feed/{feed_name}",
        "scored_at_ms": now_ms(),
    }


def render_all(cfg, rows: list[dict], tokenizer, where: str) -> list[dict]:
    """The normalized records of raw dataset ``rows`` (id, task, reference, the conversation as
    given), each with its rendering in ``_rendered``; ConfigError naming the first record that
    cannot be rendered (the feed's start and ``rlstream run``'s checks call it)."""
    fc = cfg.feed
    plain = []
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or not isinstance(r.get(fc.messages_field), list):
            raise ConfigError(f"{where}: record {i} has no {fc.messages_field!r} list (feed.mode = 'sft')")
        msgs = [{**m, "content": m.get("content") or ""} if isinstance(m, dict) else m for m in r[fc.messages_field]]
        plain.append({**r, fc.messages_field: msgs})
    records = normalize(plain, fc, where)
    demos = Demonstrations(cfg, tokenizer)
    for i, (row, rec) in enumerate(zip(rows, records, strict=True)):
        rec["messages"] = json.dumps(row[fc.messages_field], sort_keys=True)
        try:
            rec["_rendered"] = demos.tokens(row[fc.messages_field], rec["task"])
        except InvalidRecord as exc:
            raise ConfigError(f"{where}: record {i} ({rec['prompt_id']}): {exc}") from None
    return records


def load_sft(cfg) -> list[dict]:
    """The feed's demonstrations (``feed.source``), rendered (``render_all``)."""
    from pipeline.models import load_tokenizer, materialize

    rows = read_raw(cfg.feed.source, cfg.feed.format)
    return render_all(cfg, rows, load_tokenizer(materialize(cfg.model)), str(cfg.feed.source))
