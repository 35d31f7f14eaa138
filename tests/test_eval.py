"""`rlstream eval`: evaluation while training, from rl.control, without pausing anything: version 0
and every published version are scored on a held-out set, and the figures (mean reward, pass@1
per version) go to the metrics topic, where the live view, status and the report read them."""

from __future__ import annotations

import json
import threading

import pytest

from rlstream.demo import CHARSET, TASK, write_task

pytestmark = pytest.mark.kafka
MODEL = [f"model.charset={json.dumps(CHARSET)}", "model.hidden_size=32", "model.num_heads=2", "model.num_layers=1",
         "model.intermediate_size=64", "model.max_position_embeddings=64"]  # fmt: skip


def test_eval_scores_version_zero_and_every_published_version(make_config, tmp_path):
    from producers.testing import forcing_state_dict, publish_version, read_topic
    from rlstream.eval import Evaluator
    from tests.test_rollout import base_state, wait_for

    held_out = write_task(tmp_path / "heldout.jsonl")
    cfg = make_config(
        *MODEL, f"eval.source={held_out}", "eval.samples=2", "rollout.max_new_tokens=1", "reward.executor=thread",
        f'reward.tasks={{{TASK} = [{{name = "exact_match", kwargs = {{extract_regex = "^(.)"}}}}]}}',
    )  # fmt: skip
    ev = Evaluator(cfg)
    stop = threading.Event()
    t = threading.Thread(target=ev.run, args=(stop,), daemon=True)
    t.start()
    try:
        wait_for(lambda: len(ev.results) >= 1, timeout=180, what="version 0 evaluated")
        tok = ev.tokenizer
        publish_version(cfg, 1, forcing_state_dict(base_state(cfg), tok.convert_tokens_to_ids("1")))
        wait_for(lambda: len(ev.results) >= 2, timeout=180, what="version 1 evaluated")
    finally:
        stop.set()
        t.join(60)
    assert not t.is_alive()
    events = [r for _, r in read_topic(cfg, "metrics", "MetricEvent") if r["role"] == "eval"]
    by_version = {e["version"]: e["metrics"] for e in events}
    assert sorted(by_version) == [0, 1]
    # version 1 always answers "1": right only for the prompt "0>" (1 of 10), both samples of it
    assert by_version[1]["eval_pass_at_1"] == pytest.approx(0.1) and by_version[1]["eval_reward_mean"] == pytest.approx(
        0.1
    )
    assert by_version[1]["eval_answers"] == 20 and by_version[1]["eval_unscored"] == 0
