"""``module:function`` tools run in a tool-runner process (``libs.tools.runner``), not in the
worker's: a call that spins is stopped at its deadline, one that allocates without bound at its
memory limit, one that ends its process is a crash, the network is off unless allowed, and the
next call works. In a real rollout worker (a scripted engine, ``tests.script_engine``) a stopped
call is an error observation, the episode goes on, and rl.dlq gets a DeadLetter naming the call;
the trajectory's metadata lists the calls; turns end at EOS without ``rollout.env.stop = []``; and
the prompt-length limit counts the opening with the tools."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from libs.tools.runner import RunnerLimits, pool
from pipeline.models import build_char_tokenizer
from producers.envs import EnvContext, env_factory

TEMPLATE = (
    "{% if tools %}[system]Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
"""A chat template with a tools section whose messages end in EOS (as in ChatML)."""
REPO = str(Path(__file__).resolve().parents[1])
"""Where a runner finds ``tests.sandbox_tools`` (the worker passes where it found a tool's module)."""


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_a_runner_stops_a_spinning_a_hoarding_and_a_dying_tool_and_serves_the_next_call():
    runners = pool(RunnerLimits(memory_mb=256, dirs=(REPO,)))
    ok = runners.call("add", "tests.sandbox_tools:add", {"a": 2, "b": 3}, 30)
    assert (ok.status, ok.content) == ("ok", "5")  # the tool's print went to the runner's stderr
    where = runners.call("pid", "tests.sandbox_tools:pid", {"x": 0}, 30)
    assert where.ok and int(where.content) != os.getpid()
    t0 = time.monotonic()
    spun = runners.call("spin", "tests.sandbox_tools:spin", {"n": 0}, 1.0)
    assert spun.status == "timeout" and spun.content == "error: tool spin was stopped: timed out after 1 s"
    assert time.monotonic() - t0 < 15
    hog = runners.call("hog", "tests.sandbox_tools:hog", {"mb": 32}, 60)
    assert hog.status == "memory" and hog.content == "error: tool hog was stopped: exceeded 256 MB"
    died = runners.call("die", "tests.sandbox_tools:die", {"code": 3}, 30)
    assert died.status == "crash" and "exit code 3" in died.content
    bad = runners.call("add", "tests.sandbox_tools:add", {"a": 1}, 30)
    assert bad.status == "error" and "TypeError" in bad.content
    again = runners.call("add", "tests.sandbox_tools:add", {"a": 40, "b": 2}, 30)
    assert (again.status, again.content) == ("ok", "42")
    assert not [t for t in threading.enumerate() if t.name.startswith("tool-")]  # nothing ran here


def test_the_network_is_off_unless_the_options_allow_it():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        off = pool(RunnerLimits(memory_mb=256, dirs=(REPO,))).call(
            "connect", "tests.sandbox_tools:connect", {"port": port}, 30
        )
        assert off.status == "error" and "OSError" in off.content
        on = pool(RunnerLimits(memory_mb=256, network=True, dirs=(REPO,)))
        got = on.call("connect", "tests.sandbox_tools:connect", {"port": port}, 30)
        assert (got.status, got.content) == ("ok", "connected")
    finally:
        server.close()


def test_the_tools_environment_reports_a_stopped_call_and_goes_on():
    tok = build_char_tokenizer(chat_template=TEMPLATE)
    opts = {"tools": ["tests.sandbox_tools:hog", "tests.sandbox_tools:add"], "tool_memory_mb": 256}
    cls = env_factory("tools")
    cls.check_options(opts)
    env = cls(opts, EnvContext("arith", "w", tok))
    env.reset({"text": "What is 2 + 3?", "messages": "", "group_id": "g"}, 0)
    r = env.step(call("hog", mb=32) + "<eos>")
    assert not r.done and "[tool]error: tool hog was stopped: exceeded 256 MB<eos>" in r.observation
    assert (r.info["counts"]["tool_memory"], r.info["counts"]["tool_calls"]) == (1, 1)
    (dead,) = r.info["dead_letters"]
    assert dead["error_type"] == "tool_memory" and dead["headers"] == {"tool": b"hog"}
    assert json.loads(dead["value"]) == {"name": "hog", "arguments": {"mb": 32}} and "256 MB" in dead["reason"]
    r = env.step(call("add", a=2, b=3) + "<eos>")
    assert "[tool]5<eos>" in r.observation and "dead_letters" not in r.info
    log = json.loads(r.info["metadata"]["tools"])
    assert [(c["name"], c["ok"], c["error"]) for c in log] == [("hog", False, "memory"), ("add", True, "")]
    assert all(c["latency_ms"] > 0 for c in log) and len(r.info["observe"]["tool_latency_ms"]) == 1
    assert env.step("It is 5.<eos>").done


@pytest.mark.kafka
def test_a_rollout_worker_dead_letters_a_stopped_tool_call_and_the_episode_goes_on(make_config):
    from pipeline import codec
    from producers import feed
    from tests.rollout_helpers import read_topic
    from tests.test_rollout import run_until_idle, trajectories

    turns = [f"Let me count.\n{call('spin', n=1)}", f"Now add.\n{call('add', a=2, b=3)}", "It is 5."]
    cfg = make_config(
        "feed.source=tests/data/guess.jsonl", "rl.group_size=2", "rl.max_staleness=100",
        "rollout.max_new_tokens=400", "rollout.env.max_turns=4", "rollout.env.max_turn_tokens=120",
        "rollout.exit_when_idle_s=2", "rollout.env.workers=8", f"model.chat_template={json.dumps(TEMPLATE)}",
        f"rollout.engine={{type=\"tests.script_engine:ScriptEngine\", options={{turns={json.dumps(turns)}}}}}",
        'rollout.env.tasks={guess_number="tools"}',
        'rollout.env.options={guess_number={tools=["tests.sandbox_tools:spin", "tests.sandbox_tools:add"], '
        "call_timeout_s=1}}",
    )  # fmt: skip
    assert cfg.rollout.env.stop is None  # the default: tools turns end at EOS, not at the newline
    feed.run(cfg)
    w = run_until_idle(cfg)
    got = trajectories(cfg, 8)
    assert len(got) == 8
    tok = w.worker.tokenizer
    for t in got:
        assert (t["finish_reason"], t["num_turns"]) == ("env_done", 3)
        text = tok.decode(list(codec.unpack_i32(t["response_tokens"])))
        assert "[tool]error: tool spin was stopped: timed out after 1 s<eos>" in text and "[tool]5<eos>" in text
        log = json.loads(t["metadata"]["tools"])
        assert [(c["name"], c["ok"], c["error"]) for c in log] == [("spin", False, "timeout"), ("add", True, "")]
        assert log[0]["latency_ms"] >= 1000
    dead = [r for _, r in read_topic(cfg, "dlq", "DeadLetter", 8)]
    assert len(dead) == 8 and {d["error_type"] for d in dead} == {"tool_timeout"}
    assert {d["headers"]["trajectory_id"].decode() for d in dead} == {t["trajectory_id"] for t in got}
    for d in dead:
        assert d["headers"]["tool"] == b"spin" and json.loads(d["value"]) == {"name": "spin", "arguments": {"n": 1}}
        assert "timed out after 1 s" in d["reason"] and d["role"] == "rollout"
    counters = w.worker.metrics.counters
    assert counters["env.tool_timeouts"] == 8 and counters["env.tool_calls"] == 16
    assert counters["dead_letters.tool_timeout"] == 8


@pytest.mark.kafka
def test_the_prompt_limit_counts_the_tools_in_the_opening(make_config):
    from producers import feed
    from tests.rollout_helpers import read_topic
    from tests.test_rollout import run_until_idle

    cfg = make_config(
        "feed.source=tests/data/guess.jsonl", "rl.group_size=2", "rl.max_staleness=100",
        "rollout.max_prompt_tokens=60", "rollout.exit_when_idle_s=2", f"model.chat_template={json.dumps(TEMPLATE)}",
        'rollout.engine={type="tests.script_engine:ScriptEngine", options={turns=["It is 5."]}}',
        'rollout.env.tasks={guess_number="tools"}',
        'rollout.env.options={guess_number={tools=["calculator", "tests.sandbox_tools:add"]}}',
    )  # fmt: skip
    feed.run(cfg)
    run_until_idle(cfg)
    dead = [r for _, r in read_topic(cfg, "dlq", "DeadLetter", 4)]
    assert len(dead) == 4 and {d["error_type"] for d in dead} == {"too_long"}
    assert all("tools included" in d["reason"] for d in dead)
