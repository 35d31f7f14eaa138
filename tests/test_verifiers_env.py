"""The ``verifiers`` environment: the tasksets of PrimeIntellect's verifiers library (0.4,
``verifiers.v1``) played as one-turn episodes scored by the task's own rewards. Its options are
checked at start (the package missing, neither or both sources, a taskset that is infinite, empty,
unscored or needs a sandbox runtime, a bad argument), an episode picks the task the prompt's
reference names and renders it in plain text or through a chat template, and the weighted sum of
the task's rewards ends the episode. Through the real pipeline (real broker, tiny random-init
model): rollout, reward (``env_reward``) and the trainer taking a step on a taskset of 8 tasks
(``tests/verifiers_tasks.py``); and a rubric that raises for half the tasks: those episodes are
dead letters with the reason, the others are published, every prompt is committed."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from pipeline.errors import ConfigError
from pipeline.models import build_char_tokenizer
from producers.envs import EnvContext, env_factory

needs_verifiers = pytest.mark.skipif(
    importlib.util.find_spec("verifiers") is None,
    reason="verifiers is not installed: pip install 'rlstream[verifiers]' (scripts/setup.sh installs it)",
)
DIGITS = {"taskset": "tests.verifiers_tasks:digits"}
TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}<eos>\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"


def env(tok=None, **options):
    cls = env_factory("verifiers")
    opts = {**DIGITS, **options}
    cls.check_options(opts)
    return cls(opts, EnvContext("vf", "w", tok or build_char_tokenizer()))


def prompt(reference=None, text="x") -> dict:
    return {"group_id": "g@e0", "text": text, "reference": json.dumps(reference) if reference is not None else ""}


# -- options ---------------------------------------------------------------------------------------
def test_without_the_package_the_options_are_refused_with_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)  # what an environment without it imports
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(ConfigError, match=r"pip install 'rlstream\[verifiers\]'"):
        env_factory("verifiers").check_options(DIGITS)


@needs_verifiers
def test_bad_options_and_unplayable_tasksets_are_refused_at_start_in_one_line():
    cls = env_factory("verifiers")
    for opts, match in (
        ({}, "exactly one of taskset"),
        ({"taskset": "a:b", "id": "c"}, "exactly one of taskset"),
        ({"taskset": "nope"}, "'nope' is not a module:function reference"),
        ({**DIGITS, "render": "html"}, "render: Input should be"),
        ({**DIGITS, "nope": 1}, "nope: Extra inputs are not permitted"),
        ({**DIGITS, "args": {"bad": 1}}, "unexpected keyword argument 'bad'"),
        ({"taskset": "tests.verifiers_tasks:endless"}, "is infinite"),
        ({"taskset": "tests.verifiers_tasks:empty"}, "has no tasks"),
        ({"taskset": "tests.verifiers_tasks:unscored"}, r"have no @vf.reward"),
        ({"taskset": "tests.verifiers_tasks:boxed"}, "rewards tests_pass need a runtime"),
        ({"taskset": "tests.verifiers_tasks:not_a_taskset"}, "returned a list, not a vf.Taskset"),
        ({"taskset": "tests.verifiers_tasks:nothing_here"}, "has no attribute nothing_here"),
        ({"id": "no-such-taskset"}, "taskset 'no-such-taskset' not found"),
    ):
        with pytest.raises(ConfigError, match=match) as info:
            cls.check_options(opts)
        assert "\n" not in str(info.value), str(info.value)
    cls.check_options({"taskset": "tests.verifiers_tasks:DigitTaskset"})  # a Taskset class, default config


# -- an episode ------------------------------------------------------------------------------------
@needs_verifiers
def test_an_episode_is_the_named_task_for_one_turn_scored_by_its_weighted_rewards():
    e = env()
    assert not e.renders_chat and not e.eos_ends_episode
    assert e.reset(prompt({"idx": 3}), 0) == "3>"
    r = e.step("4\n")
    assert (r.observation, r.done) == ("", True)
    assert r.reward == pytest.approx(1.1) and r.info["rewards"] == {"correct": 1.0, "brief": 1.0}
    assert r.info["counts"] == {"tasks_scored": 1}
    assert e.reset(prompt({"id": "d7"}), 1) == "7>"
    assert e.step("8<eos>").reward == pytest.approx(1.1)  # the EOS is not part of the reply
    assert e.reset(prompt(text="5>"), 0) == "5>"  # no reference: the task whose prompt is the text
    assert e.step("12").reward == pytest.approx(0.0)
    for ref, match in (({"idx": 8}, "idx 8 is not a task"), ({"id": "zz"}, "id 'zz' is not a task id"),
                       (None, "names no task")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            e.reset(prompt(ref), 0)
    plain = env(system_prompt="Next digit.")
    assert plain.reset(prompt({"idx": 1}), 0) == "Next digit.\n1>"
    own = env(args={"system_prompt": "The task's own."}, system_prompt="Next digit.")
    assert own.reset(prompt({"idx": 1}), 0) == "The task's own.\n1>"


@needs_verifiers
def test_a_chat_episode_is_the_templates_rendering_of_the_task():
    tok = build_char_tokenizer(chat_template=TEMPLATE)
    e = env(tok, system_prompt="Next digit.")
    assert e.renders_chat
    assert e.reset(prompt({"idx": 2}), 0) == "[system]Next digit.<eos>\n[user]2><eos>\n[assistant]"
    assert e.step("3<eos>").reward == pytest.approx(1.1)
    with pytest.raises(ConfigError, match="chat template"):
        env(render="chat").reset(prompt({"idx": 2}), 0)


@needs_verifiers
def test_a_rubric_that_raises_fails_the_step_with_the_reason():
    e = env(taskset="tests.verifiers_tasks:flaky")
    e.reset(prompt({"idx": 0}), 0)
    assert e.step("1").reward == pytest.approx(1.1)
    e.reset(prompt({"idx": 1}), 0)
    with pytest.raises(Exception, match="KeyError: 'no grader for d1'"):
        e.step("2")


# -- through the pipeline --------------------------------------------------------------------------
def task_file(path: Path) -> Path:
    """The 8 tasks of ``tests.verifiers_tasks:digits`` as prompt records naming each by its idx."""
    recs = [{"id": f"vf{k}", "prompt": f"{k}>", "task": "vf", "reference": {"idx": k}} for k in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def env_settings(taskset: str) -> list[str]:
    """One-turn episodes of ``taskset``. The sample's token budget is above the turn's: a turn that
    spends the whole budget ends the sample (``length``) before the environment scores it."""
    return [
        'rollout.env.tasks={vf="verifiers"}', f'rollout.env.options={{vf={{taskset="{taskset}"}}}}',
        "rollout.env.max_turns=1", "rollout.env.max_turn_tokens=2", "rollout.max_new_tokens=4",
    ]  # fmt: skip


@needs_verifiers
@pytest.mark.kafka
def test_a_verifiers_taskset_runs_through_rollout_reward_and_a_training_step(make_config, topic_prefix, tmp_path):
    from consumers.trainer.state import read_steps_log
    from pipeline.kafka import decode_message
    from tests import rl_pipeline
    from tests.test_reward_worker import read_all

    task = task_file(tmp_path / "vf.jsonl")
    cfg = make_config(
        *rl_pipeline.settings(task, topic_prefix, steps=1, G=2, n=4, k=1), *env_settings(DIGITS["taskset"]),
        'reward.tasks={vf=[{name="env_reward"}]}', "reward.default=[]",
    )  # fmt: skip
    rl_pipeline.run(cfg, 1, rollout_workers=1, timeout=600)
    log = read_steps_log(Path(cfg.run_dir) / "trainer")
    assert [e["step"] for e in log] == [1] and len(log[0]["groups"]) == 2
    scored = [decode_message(m, "ScoredTrajectory") for m in read_all(cfg, "scored", 8, timeout=180)]
    assert len(scored) >= 8
    for s in scored:
        t = s["trajectory"]
        assert t["num_turns"] == 1 and t["finish_reason"] == "env_done"
        assert s["reward"] == pytest.approx(float(t["metadata"]["env_reward"]))
        assert s["reward"] in (pytest.approx(0.0), pytest.approx(0.1), pytest.approx(1.0), pytest.approx(1.1))


@needs_verifiers
@pytest.mark.kafka
def test_episodes_whose_rubric_raises_are_dead_letters_and_the_others_are_published(make_config, tmp_path):
    from pipeline import codec
    from producers import feed
    from rlstream.demo import model_settings
    from tests.rollout_helpers import end_offsets, read_topic
    from tests.test_rollout import committed, run_until_idle, trajectories

    cfg = make_config(
        f"feed.source={json.dumps(str(task_file(tmp_path / 'vf.jsonl')))}", "rl.group_size=2",
        "rl.max_staleness=100", "rollout.exit_when_idle_s=30", "model.type=tiny",
        *(f"{k}={json.dumps(v)}" for k, v in model_settings().items()), *env_settings("tests.verifiers_tasks:flaky"),
    )  # fmt: skip
    feed.run(cfg)
    w = run_until_idle(cfg, timeout=300)
    assert w.worker is not None
    dead = [r for _, r in read_topic(cfg, "dlq", "DeadLetter", 8)]
    got = trajectories(cfg, 8)
    assert len(dead) == 8 and len(got) == 8, (len(dead), len(got), w.worker.metrics.counters)
    for d in dead:
        assert d["error_type"] == "env_error" and d["role"] == "rollout"
        assert "KeyError: 'no grader for d" in d["reason"]
        episode = codec.decode_as(d["value"], "Trajectory")  # the episode so far: the odd task's one turn
        assert json.loads(episode["reference"])["idx"] % 2 == 1 and episode["num_turns"] == 1
    assert {json.loads(t["reference"])["idx"] % 2 for t in got} == {0}
    ends = end_offsets(cfg, cfg.topics.name("prompts"))
    done = committed(cfg)
    assert all(done[p] == end for p, end in ends.items() if end)  # every prompt committed
