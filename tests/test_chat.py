"""Chat datasets: records with OpenAI-format ``messages`` (or plain text) are rendered with the
tokenizer's chat template, with the generation prompt and an optional system prompt; malformed
conversations are refused by the feed (dataset) or dead-lettered by the rollout worker."""

from __future__ import annotations

import json

import pytest

from libs.chat import render, uses_template
from libs.datasets import normalize
from pipeline.errors import ConfigError
from pipeline.models import build_char_tokenizer
from pipeline.records import InvalidRecord
from producers.config import FeedConfig

TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
CHAT = [{"role": "user", "content": "2+2?"}]


def test_messages_render_with_the_template_the_generation_prompt_and_a_system_prompt():
    tok = build_char_tokenizer(chat_template=TEMPLATE)
    p = {"text": "", "messages": json.dumps(CHAT)}
    assert render(p, tok) == "[user]2+2?\n[assistant]"
    assert render(p, tok, system_prompt="Be brief.") == "[system]Be brief.\n[user]2+2?\n[assistant]"
    assert render(p, tok, add_generation_prompt=False) == "[user]2+2?\n"
    assert render({"text": "hi", "messages": ""}, tok) == "[user]hi\n[assistant]"  # always: text as a user turn
    assert uses_template(p, "auto") and not uses_template({"text": "hi", "messages": ""}, "auto")
    assert uses_template({"text": "hi"}, "always") and not uses_template(p, "never")
    with pytest.raises(InvalidRecord, match="no chat template"):
        render(p, build_char_tokenizer())
    with pytest.raises(InvalidRecord, match="JSON"):
        render({"text": "", "messages": "[{"}, tok)


def test_datasets_carry_messages_or_text_and_refuse_malformed_ones():
    fc = FeedConfig()
    plain, chat = normalize([{"id": "a", "prompt": "hi"}, {"id": "b", "messages": CHAT, "answer": "4"}], fc)
    assert "messages" not in plain and plain["text"] == "hi"  # a plain dataset keeps its hash
    assert (
        json.loads(chat["messages"]) == CHAT and chat["text"] == "" and json.loads(chat["reference"]) == {"answer": "4"}
    )
    for bad in ([], [{"role": "robot", "content": "x"}], [{"role": "user"}], "hello"):
        with pytest.raises(ConfigError, match="messages"):
            normalize([{"id": "c", "messages": bad}], fc)


@pytest.mark.kafka
def test_a_rollout_worker_renders_chat_prompts(make_config, tmp_path):
    from producers import feed
    from tests.test_rollout import WorkerThread, trajectories, wait_for

    data = tmp_path / "chat.jsonl"
    rows = [
        {"id": "c1", "messages": CHAT, "task": "t"},
        {"id": "c2", "messages": [{"role": "system", "content": "Own."}, *CHAT], "task": "t"},
        {"id": "c3", "prompt": "plain", "task": "t"},
        {"id": "c4", "messages": CHAT, "task": "t"},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = make_config(
        f"feed.source={data}", "rl.group_size=2", "rollout.max_new_tokens=3", 'rollout.system_prompt="Sys."',
        f"model.chat_template={json.dumps(TEMPLATE)}", "model.max_position_embeddings=128",
    )  # fmt: skip
    feed.run(cfg)
    w = WorkerThread(cfg)
    try:
        got = wait_for(lambda: (t := trajectories(cfg, 8, 0)) and len(t) >= 8 and t, what="8 trajectories", worker=w)
    finally:
        w.join()
    by_prompt = {t["prompt_id"]: t["prompt_text"] for t in got}
    assert by_prompt["c1"] == "[system]Sys.\n[user]2+2?\n[assistant]"
    assert by_prompt["c2"] == "[system]Own.\n[user]2+2?\n[assistant]"  # a system message of its own wins
    assert by_prompt["c3"] == "plain"  # auto: plain text stays as it is
    tok = w.worker.tokenizer
    t1 = next(t for t in got if t["prompt_id"] == "c1")
    from pipeline import codec

    assert list(codec.unpack_i32(t1["prompt_tokens"])) == tok(by_prompt["c1"], add_special_tokens=False).input_ids


@pytest.mark.kafka
def test_a_chat_prompt_under_never_has_no_tokens_and_goes_to_the_dlq(make_config, tmp_path):
    """``rollout.chat_template = "never"`` leaves a messages-only record without text: the worker
    dead-letters it with the reason (it used to hand the engine an empty context, which raised) and
    goes on with the plain record. ``rlstream run`` refuses such a job before start (test_preflight)."""
    from producers import feed
    from tests.rollout_helpers import read_topic
    from tests.test_rollout import run_until_idle, trajectories

    data = tmp_path / "chat.jsonl"
    rows = [{"id": "c1", "messages": CHAT, "task": "t"}, {"id": "p1", "prompt": "plain", "task": "t"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = make_config(
        f"feed.source={data}", "rl.group_size=2", "rl.max_staleness=100", "rollout.max_new_tokens=3",
        'rollout.chat_template="never"', "rollout.exit_when_idle_s=2",
    )  # fmt: skip
    feed.run(cfg)
    run_until_idle(cfg)
    dlq = [r for _, r in read_topic(cfg, "dlq", "DeadLetter", 1)]
    assert [d["error_type"] for d in dlq] == ["invalid"], dlq
    assert "prompt has no tokens" in dlq[0]["reason"] and "chat template" in dlq[0]["reason"]
    assert sorted(t["trajectory_id"] for t in trajectories(cfg, 2)) == ["p1@e0/0", "p1@e0/1"]
