"""`rlstream eval`: evaluation while training, from rl.control, without pausing anything: version 0
and every published version are scored on a held-out set, and the figures (mean reward, pass@1
per version) go to the metrics topic, where the live view, status and the report read them."""

from __future__ import annotations

import contextlib
import json
import threading

import pytest

from rlstream.demo import CHARSET, TASK, write_task

pytestmark = pytest.mark.kafka
MODEL = [f"model.charset={json.dumps(CHARSET)}", "model.hidden_size=32", "model.num_heads=2", "model.num_layers=1",
         "model.intermediate_size=64", "model.max_position_embeddings=64"]  # fmt: skip


@contextlib.contextmanager
def evaluating(ev):
    """``ev`` (an Evaluator) running in a thread until the block ends; it must stop within 60 s."""
    stop = threading.Event()
    t = threading.Thread(target=ev.run, args=(stop,), daemon=True)
    t.start()
    try:
        yield ev
    finally:
        stop.set()
        t.join(60)
    assert not t.is_alive(), "the evaluator did not stop within 60 s of its stop event"


def test_eval_scores_version_zero_and_every_published_version(make_config, tmp_path):
    from consumers.eval.worker import Evaluator
    from tests.rollout_helpers import forcing_state_dict, publish_version, read_topic
    from tests.test_rollout import base_state, wait_for

    held_out = write_task(tmp_path / "heldout.jsonl")
    cfg = make_config(
        *MODEL, f"eval.source={held_out}", "eval.samples=2", "rollout.max_new_tokens=1", "reward.executor=thread",
        f'reward.tasks={{{TASK} = [{{name = "exact_match", kwargs = {{extract_regex = "^(.)"}}}}]}}',
    )  # fmt: skip
    with evaluating(Evaluator(cfg)) as ev:
        wait_for(lambda: len(ev.results) >= 1, timeout=180, what="version 0 evaluated")
        tok = ev.tokenizer
        publish_version(cfg, 1, forcing_state_dict(base_state(cfg), tok.convert_tokens_to_ids("1")))
        wait_for(lambda: len(ev.results) >= 2, timeout=180, what="version 1 evaluated")
    events = [r for _, r in read_topic(cfg, "metrics", "MetricEvent") if r["role"] == "eval"]
    by_version = {e["version"]: e["metrics"] for e in events}
    assert sorted(by_version) == [0, 1]
    # version 1 always answers "1": right only for the prompt "0>" (1 of 10), both samples of it
    assert by_version[1]["eval_pass_at_1"] == pytest.approx(0.1) and by_version[1]["eval_reward_mean"] == pytest.approx(
        0.1
    )
    assert by_version[1]["eval_answers"] == 20 and by_version[1]["eval_unscored"] == 0
    # one token each, never EOS: every answer is cut at the budget of 1
    assert by_version[1]["eval_response_tokens_mean"] == 1.0 and by_version[1]["eval_truncated_fraction"] == 1.0


def eval_config(make_config, tmp_path, *extra):
    held_out = write_task(tmp_path / "heldout.jsonl")
    return make_config(
        *MODEL, f"eval.source={held_out}", "eval.samples=2", "rollout.max_new_tokens=1", "reward.executor=thread",
        f'reward.tasks={{{TASK} = [{{name = "exact_match", kwargs = {{extract_regex = "^(.)"}}}}]}}', *extra,
    )  # fmt: skip


def answers_one(cfg) -> dict:
    """Weights that always answer "1": right for the prompt "0>" only (1 of 10)."""
    from pipeline.models import load_tokenizer, materialize
    from tests.rollout_helpers import forcing_state_dict
    from tests.test_rollout import base_state

    tok = load_tokenizer(materialize(cfg.model))
    return forcing_state_dict(base_state(cfg), tok.convert_tokens_to_ids("1"))


def test_the_final_version_is_evaluated_whatever_every_versions_says(make_config, tmp_path):
    """trainer.max_steps = 3, eval.every_versions = 5: versions 1 and 2 are skipped, version 3 (the run's
    last, not a multiple of 5) is evaluated, and its event says it is the final one."""
    import time

    from consumers.eval.worker import Evaluator
    from tests.rollout_helpers import publish_version, read_topic
    from tests.test_rollout import wait_for

    cfg = eval_config(make_config, tmp_path, "eval.every_versions=5", "trainer.max_steps=3")
    weights = answers_one(cfg)
    with evaluating(Evaluator(cfg)) as ev:
        wait_for(lambda: len(ev.results) >= 1, timeout=180, what="version 0 evaluated")
        publish_version(cfg, 1, weights)
        publish_version(cfg, 2, weights)  # versions follow each other (a gap is an implausible notice)
        time.sleep(3)  # six polls of rl.control: versions 1 and 2 are seen and not due
        assert [r["version"] for r in ev.results] == [0]
        publish_version(cfg, 3, weights)
        wait_for(lambda: len(ev.results) >= 2, timeout=180, what="the final version evaluated")
    assert [r["version"] for r in ev.results] == [0, 3]
    events = [r for _, r in read_topic(cfg, "metrics", "MetricEvent") if r["role"] == "eval"]
    finals = {e["version"] for e in events if e["metrics"].get("eval_final")}
    assert finals == {3} and ev.results[1]["eval_pass_at_1"] == pytest.approx(0.1)


def test_eval_version_and_latest_evaluate_one_version_once_and_print_it(make_config, cli_env, tmp_path):
    """`rlstream eval --version N` / `--latest`: that version once, the result printed, exit 0,
    nothing published; a version that is not there: one line listing those that are."""
    from pipeline.config import dump_toml
    from tests.conftest import run_cli
    from tests.rollout_helpers import publish_version, read_topic

    cfg = eval_config(make_config, tmp_path)
    publish_version(cfg, 1, answers_one(cfg))
    conf = tmp_path / "eval.toml"
    conf.write_text(dump_toml(cfg))
    for how in (["--version", "1"], ["--latest"]):
        p = run_cli(["-c", str(conf), "eval", *how], cli_env, timeout=300)
        got = json.loads(p.stdout.strip().splitlines()[-1])
        assert got["version"] == 1 and got["pass_at_1"] == pytest.approx(0.1) and got["answers"] == 20, got
        assert "v1: pass@1 0.100, mean reward 0.100 over 20 answers" in p.stderr
        rows = [json.loads(line) for line in open(got["answers_file"])]
        assert len(rows) == 20 and {r["response_text"][:1] for r in rows} == {"1"}
    base = json.loads(
        run_cli(["-c", str(conf), "eval", "--version", "0"], cli_env, timeout=300).stdout.splitlines()[-1]
    )
    assert base["version"] == 0
    bad = run_cli(["-c", str(conf), "eval", "--version", "4"], cli_env, check=False)
    lines = [line for line in (bad.stdout + bad.stderr).splitlines() if line.strip()]
    assert bad.returncode == 2 and lines == [
        "error: UnknownVersion: version 4 does not exist: the versions there are 0 (the base model), 1 (newest 1)"
    ], lines
    assert not [r for _, r in read_topic(cfg, "metrics", "MetricEvent") if r["role"] == "eval"]  # nothing published
