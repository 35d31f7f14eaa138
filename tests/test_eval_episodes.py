"""`rlstream eval` on a job whose held-out tasks run in an environment: whole episodes through the
job's own environment classes (``consumers.eval.episodes``), the tool-use figures from the
environment's counts in the eval MetricEvent, and each episode's transcript and counts in
``eval/v<N>.jsonl``. The tools environment is the real one (the calculator runs); its model turns
come from a scripted engine (``tests.script_engine``) so the counts are known, and from the tiny
real model for the driver's multi-turn loop."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.test_tools import CALL, TOOLS_TEMPLATE

SCRIPT = [CALL, "<tool_call>{oops</tool_call>", "The answer is 3."]
"""A well-formed calculator call, a malformed call, a final answer (each ends with EOS)."""
MODEL = ["model.hidden_size=32", "model.num_heads=2", "model.num_layers=1", "model.intermediate_size=64",
         "model.max_position_embeddings=256"]  # fmt: skip


def test_the_episode_driver_plays_tool_calls_through_the_tools_environment_and_counts_them():
    from consumers.eval.episodes import play, start, tool_metrics
    from libs.engines import EngineContext
    from pipeline.models import build_char_tokenizer
    from producers.envs import make_env
    from tests.script_engine import ScriptEngine

    tok = build_char_tokenizer(chat_template=TOOLS_TEMPLATE)
    engine = ScriptEngine(SimpleNamespace(options={"turns": SCRIPT}), EngineContext(Path("."), tok, "eval"))
    prompt = {"text": "What is 8 - 2 * 3?", "messages": "", "group_id": "eval0", "task": "arith"}
    ctx = {"task": "arith", "worker_id": "eval", "tokenizer": tok}
    eps = [start(make_env("tools", {"tools": ["calculator"]}, ctx, check=True), prompt, j, tok, f"eval0/{j}", 400, 8192)
           for j in range(2)]  # fmt: skip
    play(eps, engine, tok, temperature=0.0, max_turns=5, max_turn_tokens=200, stop_ids=frozenset(),
         chat_eos_only=True, step_timeout_s=30, gen_timeout_s=30)  # fmt: skip
    for ep in eps:
        assert (ep.finish, ep.turns) == ("env_done", 3)  # EOS closes each message; the final answer ends it
        roles = [m["role"] for m in ep.transcript]
        assert roles == ["env", "model", "env", "model", "env", "model"]
        assert ep.transcript[0]["text"].startswith("[system]Tools: calculator\n[user]What is 8 - 2 * 3?")
        assert ep.transcript[2]["text"] == "\n[tool]2<eos>\n[assistant]"  # the calculator's result
        assert "[tool]error: the tool call could not be read" in ep.transcript[4]["text"]
        c = ep.counts
        assert (c["tool_calls"], c["malformed_tool_calls"], c["tool_errors"], c["final_answers"]) == (1, 1, 0, 1)
        assert "[tool]2" in tok.decode(ep.tokens, skip_special_tokens=True)
    assert tool_metrics(eps) == {
        "eval_episodes": 2, "eval_tool_call_rate": 1.0, "eval_tool_call_success": 1.0,
        "eval_malformed_call_rate": 0.5, "eval_turns_mean": 3.0,
    }  # fmt: skip


def test_tool_metrics_from_known_counts():
    from consumers.eval.episodes import Episode, tool_metrics

    def ep(turns, **counts):
        return Episode("e", None, [], 10, turns=turns, counts=counts)

    eps = [ep(1, final_answers=1), ep(4, tool_calls=3, tool_errors=1, tool_timeouts=1, malformed_tool_calls=1),
           ep(2, tool_calls=1), ep(1, malformed_tool_calls=2)]  # fmt: skip
    m = tool_metrics(eps)
    assert m["eval_tool_call_rate"] == 0.5  # 2 of 4 episodes made a well-formed call
    assert m["eval_tool_call_success"] == 0.5  # 2 of 4 well-formed calls returned a result
    assert m["eval_malformed_call_rate"] == pytest.approx(3 / 7)
    assert m["eval_turns_mean"] == 2.0
    assert tool_metrics([])["eval_tool_call_rate"] == 0.0


def test_an_environment_that_raises_ends_only_its_own_episode():
    from consumers.eval.episodes import play, start
    from libs.engines import EngineContext
    from pipeline.models import build_char_tokenizer
    from producers.envs import GuessNumberEnv
    from tests.script_engine import ScriptEngine

    class Flaky(GuessNumberEnv):
        def step(self, action):
            if self.secret == 3:
                raise RuntimeError("flaky")
            return super().step(action)

    tok = build_char_tokenizer()
    engine = ScriptEngine(SimpleNamespace(options={"turns": ["5\n", "3\n"]}), EngineContext(Path("."), tok, "eval"))
    eps = [start(Flaky({}), {"text": "Guess.\n", "group_id": "g", "reference": json.dumps({"secret": s})}, 0, tok,
                 f"e{s}", 100, 8192) for s in (3, 4)]  # fmt: skip
    play(eps, engine, tok, temperature=0.0, max_turns=4, max_turn_tokens=8, stop_ids=frozenset(tok("\n").input_ids),
         chat_eos_only=True, step_timeout_s=30, gen_timeout_s=30)  # fmt: skip
    assert (eps[0].finish, eps[0].turns) == ("env_error", 1) and "flaky" in eps[0].error
    assert eps[1].finish == "max_turns" and eps[1].turns == 4  # "5" lower, "3" higher, ... never 4
    assert [m["text"] for m in eps[1].transcript if m["role"] == "env"][1:3] == ["lower\n", "higher\n"]


@pytest.mark.kafka
def test_eval_plays_tool_episodes_and_publishes_the_tool_figures(make_config, tmp_path):
    """The evaluator following a run, on a held-out set whose task runs in the tools environment:
    version 0's MetricEvent carries the tool figures and every answer's row its transcript."""
    from consumers.eval.worker import Evaluator
    from producers.envs import make_env
    from tests.rollout_helpers import read_topic
    from tests.test_eval import evaluating
    from tests.test_rollout import wait_for

    cfg = make_config(
        *MODEL, "eval.source=tests/data/guess.jsonl", "eval.max_prompts=3", "eval.samples=2",
        "rollout.max_new_tokens=400", "rollout.env.max_turns=5", "rollout.env.max_turn_tokens=120",
        f"model.chat_template={json.dumps(TOOLS_TEMPLATE)}", "reward.executor=thread",
        f"rollout.engine={{type=\"tests.script_engine:ScriptEngine\", options={{turns={json.dumps(SCRIPT)}}}}}",
        'rollout.env.tasks={guess_number="tools"}', 'rollout.env.options={guess_number={tools=["calculator"]}}',
        'reward.tasks={guess_number=[{name = "exact_match", kwargs = {reference_key = "secret", extract_regex = "answer is (\\\\d)"}}]}',
    )  # fmt: skip
    with evaluating(Evaluator(cfg, envs=make_env)) as ev:
        wait_for(lambda: len(ev.results) >= 1, timeout=180, what="version 0 evaluated")
    events = [r for _, r in read_topic(cfg, "metrics", "MetricEvent") if r["role"] == "eval"]
    m = next(e["metrics"] for e in events if "eval_tool_call_rate" in e["metrics"])
    assert m["eval_answers"] == 6 and m["eval_episodes"] == 6 and m["eval_unscored"] == 0
    assert (m["eval_tool_call_rate"], m["eval_tool_call_success"]) == (1.0, 1.0)
    assert (m["eval_malformed_call_rate"], m["eval_turns_mean"]) == (0.5, 3.0)
    assert m["eval_pass_at_1"] == pytest.approx(1 / 3)  # "The answer is 3.": right for guess-0 (secret 3) only
    rows = [json.loads(line) for line in (Path(cfg.run_dir) / "eval" / "v0.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    for row in rows:
        assert row["finish_reason"] == "env_done" and row["turns"] == 3 and row["reward"] is not None
        assert [t["role"] for t in row["transcript"]] == ["env", "model", "env", "model", "env", "model"]
        assert "[tool]2<eos>" in row["transcript"][2]["text"]
        assert row["counts"]["tool_calls"] == 1 and row["counts"]["malformed_tool_calls"] == 1


@pytest.mark.kafka
def test_eval_of_one_version_plays_episodes_with_the_tiny_model(make_config, cli_env):
    """``rlstream eval --version 0`` with the tiny real model on the guess-the-number environment:
    turns end at the newline, each guess gets an answer, up to ``rollout.env.max_turns``."""
    from tests.conftest import run_cli

    settings = [
        *MODEL, f"eval.source={Path('tests/data/guess.jsonl').resolve()}", "eval.max_prompts=4", "eval.samples=2",
        "eval.temperature=1.0", "rollout.max_new_tokens=60", "rollout.env.max_turns=3",
        "rollout.env.max_turn_tokens=4", "reward.executor=thread",
        'reward.tasks={guess_number=[{name = "exact_match", kwargs = {reference_key = "secret"}}]}',
    ]  # fmt: skip
    make_config(*settings)  # the topics
    p = run_cli(["eval", "--version", "0", *(a for kv in settings for a in ("--set", kv))], cli_env, timeout=300)
    res = json.loads(p.stdout.splitlines()[-1])
    assert res["version"] == 0 and res["episodes"] == 8 and 1.0 <= res["turns_mean"] <= 3.0
    assert res["tool_call_rate"] == 0.0  # no tools in this environment
    rows = [json.loads(line) for line in Path(res["answers_file"]).read_text().splitlines()]
    assert len(rows) == 8
    for row in rows:
        models = [t for t in row["transcript"] if t["role"] == "model"]
        assert len(models) == row["turns"] and row["finish_reason"] in ("stop", "length", "env_done", "max_turns")
        answers = [t["text"] for t in row["transcript"][1:] if t["role"] == "env"]
        assert set(answers) <= {"higher\n", "lower\n", "correct\n", "invalid\n"}
        assert len(answers) in (row["turns"], row["turns"] - 1)  # the last turn may end the episode itself
    assert any(row["turns"] > 1 for row in rows)  # a turn ends at the newline or 4 tokens, rarely at EOS


def test_an_eval_set_with_environment_tasks_needs_the_environments(tmp_path):
    """Built without ``envs`` (a programming mistake, not a user's), the evaluator says so at setup."""
    from consumers.eval.worker import Evaluator
    from pipeline.errors import ConfigError
    from rlstream.config import load_config

    cfg = load_config(None, [f"run_dir={tmp_path}", "eval.source=tests/data/guess.jsonl", *MODEL], environ={})
    with pytest.raises(ConfigError, match="run in environments"):
        Evaluator(cfg).setup()


def test_the_run_report_plots_the_tool_curve_by_version(tmp_path):
    """The launcher's progress keeps the tool figures of each eval event; the report draws tools.png."""
    pytest.importorskip("matplotlib")
    from rlstream.progress import Progress
    from rlstream.report import plot_report

    p = Progress()
    for v, rate in ((0, 0.25), (2, 0.75)):
        p.add({"role": "eval", "worker_id": "eval", "version": v, "timestamp_ms": 0, "metrics": {
            "eval_reward_mean": 0.5, "eval_pass_at_1": rate / 2, "eval_answers": 8, "eval_tool_call_rate": rate,
            "eval_tool_call_success": 1.0, "eval_malformed_call_rate": 0.0, "eval_turns_mean": 2.5}})  # fmt: skip
    p.add({"role": "eval", "worker_id": "eval", "version": 3, "timestamp_ms": 0,
           "metrics": {"eval_reward_mean": 0.5, "eval_pass_at_1": 0.5}})  # fmt: skip
    assert p.tool_curve() == [[0, 0.25, 1.0, 0.0, 2.5, 0.125], [2, 0.75, 1.0, 0.0, 2.5, 0.375]]
    assert len(p.eval_curve()) == 3  # the eval curve is unchanged
    paths = plot_report(tmp_path, {"eval_curve": p.eval_curve(), "tool_curve": p.tool_curve()})
    assert {x.name for x in paths} == {"eval.png", "tools.png"} and (tmp_path / "tools.png").stat().st_size > 0
