"""The supervised stage: demonstrations rendered as live episodes (only assistant tokens trained),
the ``sft`` loss (the masked token NLL), the staleness bound leaving demonstrations alone, and the
``tool_use`` generator's conversations read back by the tools environment's own parser."""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from consumers.trainer.batch import TrainSample, collate, informative, plan_step, sample_weights
from consumers.trainer.loss_config import advantage_config, loss_config
from consumers.trainer.losses import LossFn
from pipeline.models import build_char_tokenizer
from pipeline.records import InvalidRecord
from producers.config import EnvConfig
from producers.envs import EnvContext
from producers.sft import Demonstrations, as_turns, scored_record
from producers.tool_env import ToolEnv

TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "and 3+3?"},
    {"role": "assistant", "content": "6"},
]


def _cfg(tasks=None, options=None):
    env = EnvConfig(tasks=tasks or {}, options=options or {})
    return types.SimpleNamespace(rollout=types.SimpleNamespace(env=env))


def _trained(ids, mask, tok) -> list[str]:
    """The decoded runs of trained tokens."""
    runs, cur = [], []
    for t, m in zip(ids, mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return [tok.decode(r) for r in [*runs, *([cur] if cur else [])]]


def test_only_assistant_tokens_are_trained():
    tok = build_char_tokenizer(chat_template=TEMPLATE)
    prompt, p_ids, r_ids, mask, response = Demonstrations(_cfg(), tok).tokens(CHAT, "t")
    assert prompt == "<system>Be brief.<eos>\n<user>2+2?<eos>\n<assistant>"
    assert p_ids == tok(prompt, add_special_tokens=False).input_ids
    # the model writes its answer and the end-of-message token; headers and user turns are masked
    assert _trained(r_ids, mask, tok) == ["4<eos>", "6<eos>"]
    assert tok.decode(r_ids) == "4<eos>\n<user>and 3+3?<eos>\n<assistant>6<eos>"
    assert response.startswith("4<eos>")
    with pytest.raises(InvalidRecord, match="assistant"):
        Demonstrations(_cfg(), tok).tokens(CHAT[:2], "t")


def test_the_sft_loss_is_the_hand_computed_nll_of_the_trained_tokens():
    torch.manual_seed(0)
    vocab = 11
    a = TrainSample("a", "a", 0, 0, [1, 2], [3, 4, 5], [0.0] * 3, [1, 0, 1], 0.0, 0, 0, 1, demonstration=True)
    b = TrainSample("b", "b", 0, 1, [6], [7, 8], [0.0] * 2, [0, 1], 0.0, 0, 0, 1, demonstration=True)
    cfg = loss_config(type="sft")
    weights = sample_weights([a, b], cfg)
    mb = collate([a, b], weights, pad_id=0)
    logits = torch.randn(2, mb.input_ids.shape[1], vocab, requires_grad=True)
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1)
    loss, stats = LossFn(cfg)(logp, mb)
    # by hand: -log p(target | context) of each trained response token, averaged over the three
    lp = torch.log_softmax(logits.detach(), -1)
    hand = -(lp[0, 1, 3] + lp[0, 3, 5] + lp[1, 1, 8]) / 3  # a: positions 2 and 4 of 1 2|3 4 5; b: 8
    assert loss.item() == pytest.approx(hand.item(), rel=1e-6)
    assert stats["nll"][0] == pytest.approx(3 * hand.item(), rel=1e-6) and stats["nll"][1] == 3
    loss.backward()
    grad_rows = logits.grad.abs().sum(-1)
    # gradient only at the positions that predict trained tokens
    assert set(map(tuple, torch.nonzero(grad_rows).tolist())) == {(0, 1), (0, 3), (1, 1)}


def test_demonstrations_are_never_stale_and_count_at_lag_zero():
    adv = advantage_config(estimator="grpo")
    demo = TrainSample("d", "d", 0, 0, [1], [2], [0.0], [1], 0.0, 0, 0, 1, demonstration=True)
    policy = TrainSample("p", "p", 0, 1, [1], [2], [0.0], [1], 0.0, 0, 0, 1)
    groups = [types.SimpleNamespace(samples=[s], complete=True) for s in (demo, policy)]
    plan = plan_step(groups, version=50, k=1, incomplete_policy="drop", adv_cfg=adv)
    assert [s.trajectory_id for s in plan.train] == ["d"] and [s.trajectory_id for s in plan.stale] == ["p"]
    assert plan.version_lag_counts() == {0: 1} and plan.train[0].advantage == 0.0
    assert informative(groups[0], 50, 1, "drop")  # dynamic sampling keeps demonstrations


def test_a_demonstration_record_decodes_to_a_trainable_group_of_one():
    from consumers.trainer.batch import sample_from_record
    from pipeline import codec

    tok = build_char_tokenizer(chat_template=TEMPLATE)
    rendered = Demonstrations(_cfg(), tok).tokens(CHAT, "t")
    rec = scored_record({"prompt_id": "c1", "task": "t", "reference": "{}"}, 7, 2, rendered, "f")
    back = codec.decode_as(codec.encode("ScoredTrajectory", rec), "ScoredTrajectory")
    s = sample_from_record(back, 0, 0, vocab_size=len(tok))
    assert s.demonstration and s.group_size == 1 and s.group_seq == 7 and s.prompt_group == "c1@e2"
    assert list(s.mask) == rendered[3] and back["trajectory"]["num_turns"] == 2


def _live_episode(env: ToolEnv, turns: list[dict], head: list[dict], eos: str):
    """Play the conversation's assistant turns through the tools environment as a live episode:
    (prompt, [(text, trained)], parsed calls per turn, results per turn)."""
    prompt = env.reset({"messages": json.dumps(head), "text": ""}, 0)
    segments, calls, results = [], [], []
    for m in turns[len(head) :]:
        if m["role"] != "assistant":
            continue
        action = m["content"] + eos
        calls.append(env.parser.parse(action).calls)
        res = env.step(action)
        segments.append((action, 1))
        results.append([c for _, c in res.info.get("calls", [])])
        if res.done:
            break
        segments.append((res.observation, 0))
    return prompt, segments, calls, results


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_tool_use_conversations_render_as_live_episodes_of_the_tools_environment(model):
    pytest.importorskip("reasoning_gym")  # installed by scripts/setup.sh --real-model
    from rlstream.tasks import tool_use

    if model == "tiny":
        tok = build_char_tokenizer(chat_template=TEMPLATE)
    else:
        from pipeline.models import load_tokenizer, resolve_model_path

        try:
            tok = load_tokenizer(resolve_model_path("smollm2-135m-instruct"))
        except Exception as exc:  # the real model is installed by scripts/setup.sh --real-model
            pytest.skip(f"smollm2-135m-instruct not installed: {exc}")
    data = tool_use(size=40, eval_size=20, two_calls=0.5)
    train, held = data["train"], data["eval"]
    assert len(train) >= 30 and len(held) == 20
    questions = {r["messages"][-1]["content"] for r in held}
    assert all(r["messages"][1]["content"] not in questions for r in train)  # no held-out question trained
    assert all(r["messages"][-1]["role"] == "user" for r in held)  # held-out: prompts only
    assert any(sum(m.get("tool_calls") is not None for m in r["messages"]) == 2 for r in train)

    opts = {"tools": ["calculator"]}
    cfg = _cfg({"reasoning_gym": "tools"}, {"reasoning_gym": opts})
    demos = Demonstrations(cfg, tok)
    for r in train:
        msgs = r["messages"]
        prompt, p_ids, r_ids, mask, _ = demos.tokens(msgs, "reasoning_gym")
        turns = as_turns(msgs)
        env = ToolEnv(opts, EnvContext("reasoning_gym", "test", tok))
        live_prompt, segments, calls, results = _live_episode(env, turns, turns[:2], tok.eos_token)
        # the calls the environment's own parser reads are the conversation's calls, with its results
        want = [
            [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m["tool_calls"]]
            for m in msgs
            if m["role"] == "assistant" and m.get("tool_calls")
        ]
        assert [[(c.name, c.arguments) for c in turn] for turn in calls[:-1]] == want and calls[-1] == []
        assert [x for x in results if x] == [[m["content"]] for m in msgs if m["role"] == "tool"]
        assert r["reference"]["answer"] in msgs[-1]["content"]
        # and the demonstration is token for token that episode, its model turns the trained tokens
        assert prompt == live_prompt and p_ids == tok(live_prompt, add_special_tokens=False).input_ids
        ids, live_mask = [], []
        for text, m in segments:
            seg = tok(text, add_special_tokens=False).input_ids
            ids += seg
            live_mask += [m] * len(seg)
        assert r_ids == ids and mask == live_mask


def test_a_conversation_the_feed_cannot_render_stops_it_with_one_line(tmp_path):
    from pipeline.errors import ConfigError
    from pipeline.models import TinyModelConfig
    from producers.config import FeedConfig
    from producers.sft import load_sft

    data = tmp_path / "d.jsonl"
    rows = [{"id": "ok", "messages": CHAT}, {"id": "x", "messages": [{"role": "user", "content": "hi"}]}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = TinyModelConfig(chat_template=TEMPLATE, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=1)
    cfg = types.SimpleNamespace(feed=FeedConfig(source=data, mode="sft"), model=model, rollout=_cfg().rollout)
    with pytest.raises(ConfigError, match=r"record 1 \(x\): .*assistant"):
        load_sft(cfg)
    data.write_text(json.dumps(rows[0]) + "\n")
    (rec,) = load_sft(cfg)
    assert rec["prompt_id"] == "ok" and rec["_rendered"][0].endswith("<assistant>")


def _sft_job(tmp_path, steps: int) -> Path:
    rows = []
    for i in range(8):
        a, b = i, (3 * i) % 7
        rows.append({"id": f"c{i}", "task": "sum", "messages": [
            {"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": f"{a + b}"},
            {"role": "user", "content": "twice?"}, {"role": "assistant", "content": f"{2 * (a + b)}"}]})  # fmt: skip
    data = tmp_path / "demos.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = tmp_path / "sft-tiny.toml"
    job.write_text(f"""
[job]
name = "sft-tiny"
[topics]
scored = {{ partitions = 2 }}
[rl]
groups_per_step = 4
[model]
type = "tiny"
hidden_size = 32
intermediate_size = 64
num_layers = 1
num_heads = 2
max_position_embeddings = 128
chat_template = {json.dumps(TEMPLATE)}
[feed]
mode = "sft"
source = "{data}"
epochs = 1000
limit = {steps * 4}
[trainer]
lr = 0.01
max_steps = {steps}
group_timeout_s = 60
metrics_interval_s = 1
loss = {{ type = "sft" }}
""")
    return job


@pytest.mark.kafka
@pytest.mark.slow
def test_an_sft_job_lowers_the_nll_publishes_versions_and_resumes_exactly(cli_env, tmp_path):
    import signal
    import subprocess
    import time

    from consumers.trainer.state import read_steps_log
    from tests.conftest import rlstream_cmd

    steps = 14
    job = _sft_job(tmp_path, steps)
    run_dir = Path(cli_env["RLSTREAM_RUN_DIR"]) / "sft-tiny"
    out = open(tmp_path / "run.out", "w")
    # a second of sleep a step (the torch engine wrapped): the kill below lands mid-job however fast the machine
    slow = 'trainer.engine={type = "tests.sleepy_engine:SleepyEngine", options = {sleep_s = 1}}'
    proc = subprocess.Popen([*rlstream_cmd(), "run", str(job), "--no-live", "--set", slow], env=cli_env, stdout=out,
                            stderr=out)  # fmt: skip
    killed = None
    try:
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            done = read_steps_log(run_dir / "trainer")
            if killed is None and len(done) >= 4:  # kill the trainer mid-job: the launcher restarts it
                events = [json.loads(x) for x in (run_dir / "logs" / "events.jsonl").read_text().splitlines()]
                killed = next(e["pid"] for e in reversed(events) if e["event"] == "start" and e["name"] == "trainer")
                os.kill(killed, signal.SIGKILL)
            time.sleep(0.2)
        assert proc.poll() == 0, (tmp_path / "run.out").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    assert killed is not None, "the job finished before the trainer could be killed"
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "ok" and report["steps_completed"] == steps, report
    log = read_steps_log(run_dir / "trainer")
    assert [e["step"] for e in log] == list(range(1, steps + 1))
    used = [t for e in log for t in e["used"]]
    assert len(used) == len(set(used)) == steps * 4  # every demonstration trained exactly once
    assert all(e["stale"] == [] for e in log) and log[-1]["version"] == steps - 1
    first, last = np.mean([e["loss"] for e in log[:3]]), np.mean([e["loss"] for e in log[-3:]])
    assert last < 0.7 * first, [round(e["loss"], 3) for e in log]
    assert set(report["exit_codes"]) == {"feed", "trainer"}  # no rollout or reward workers
    assert report["restarts"] == {"trainer": 1} and report["export"]["final"]["version"] == steps
    # the versions went out as weight notices on rl.control, as in an RL job
    from pipeline.control import ControlFollower
    from rlstream.config import load_config

    follower = ControlFollower(load_config(run_dir / "trainer.resolved.toml", environ={}), "test")
    try:
        assert follower.catch_up(timeout=60)["version"] == steps and follower.dead_lettered == 0
    finally:
        follower.close()
    # the audit proves it from the topics: demonstrations carry no policy version, so no staleness
    audit = subprocess.run([*rlstream_cmd(), "audit", str(job)], env=cli_env, capture_output=True, text=True,
                           timeout=300)  # fmt: skip
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert "PASS (stopped)" in audit.stdout and f"trained={steps * 4} " in audit.stdout, audit.stdout


@pytest.mark.kafka
def test_the_sft_feed_resumes_without_writing_a_demonstration_twice(make_config, tmp_path):
    from pipeline.kafka import Consumer, client_conf, decode_message
    from producers import feed

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": f"c{i}", "messages": CHAT}) + "\n" for i in range(3)))
    base = ["feed.mode=sft", f"feed.source={data}", "feed.epochs=10", f"model.chat_template={json.dumps(TEMPLATE)}",
            "model.max_position_embeddings=128", "feed.checkpoint_every=2"]  # fmt: skip
    cfg = make_config(*base, "feed.limit=5")
    assert feed.run(cfg)["messages"] == 5
    assert feed.run(make_config(*base, "feed.limit=8"))["messages"] == 3  # the rest, from group 5 on
    with Consumer(client_conf(cfg, "test-read", kind="consumer")) as c:
        msgs = list(c.read_to_end(cfg.topics.name("scored"), {}, 30))
    recs = [decode_message(m, "ScoredTrajectory")["trajectory"] for m in msgs]
    assert sorted(t["group_seq"] for t in recs) == list(range(8))
    assert all(m.key().decode() == t["group_id"] and t["group_size"] == 1 for m, t in zip(msgs, recs, strict=True))


def test_a_bad_demonstration_refuses_the_job_in_one_line_creating_nothing(cli_env, tmp_path):
    import subprocess

    from tests.conftest import rlstream_cmd

    job = _sft_job(tmp_path, 2)
    data = tmp_path / "demos.jsonl"
    data.write_text(
        data.read_text() + json.dumps({"id": "bad", "messages": [{"role": "user", "content": "hi"}]}) + "\n"
    )
    proc = subprocess.run([*rlstream_cmd(), "run", str(job), "--no-live"], env=cli_env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0
    assert "record 8 (bad): a demonstration needs a user turn and then an assistant turn" in proc.stderr, proc.stderr
    assert not (Path(cli_env["RLSTREAM_RUN_DIR"]) / "sft-tiny").exists()


def test_too_few_demonstrations_for_max_steps_refuse_the_job_in_one_line(cli_env, tmp_path):
    import subprocess

    from tests.conftest import rlstream_cmd

    job = _sft_job(tmp_path, 5)
    job.write_text(job.read_text().replace("epochs = 1000\nlimit = 20", "epochs = 2\nlimit = 0"))  # 16: 4 steps of 4
    proc = subprocess.run([*rlstream_cmd(), "run", str(job), "--no-live"], env=cli_env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0
    assert "8 demonstrations x 2 epoch(s) fill 4 steps of rl.groups_per_step = 4, but trainer.max_steps = 5" in (
        proc.stderr
    ), proc.stderr
    assert not (Path(cli_env["RLSTREAM_RUN_DIR"]) / "sft-tiny").exists()
