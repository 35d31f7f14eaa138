"""The checkpoint policy: the trainer keeps the newest ``trainer.keep_weight_versions`` versions and,
beside them, the best one by held-out eval (``eval.best_metric``, recorded by the eval role in the
store: ``pipeline.best``), never deleted; a job run that finishes ok exports its final and its best
version as Hugging Face directories (``<run dir>/export/final``, ``export/best``; ``job.export``)."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.conftest import rlstream_cmd, run_cli


def _versions(store: Path) -> list[int]:
    return sorted(int(p.name[1:]) for p in store.iterdir() if p.name.startswith("v"))


def _make_store(tmp_path: Path, n: int) -> Path:
    store = tmp_path / "store"
    for v in range(1, n + 1):
        (store / f"v{v:08d}").mkdir(parents=True)
        (store / f"v{v:08d}" / "model.safetensors").write_bytes(b"x")
    return store


def update(store: Path, v: int) -> dict:
    return {"version": v, "uri": f"{store}/v{v:08d}/model.safetensors", "sha256": f"h{v}", "step": v}


def test_gc_never_deletes_the_best_version_nor_the_one_being_evaluated(tmp_path):
    from pipeline.best import note_score, pin_evaluating, read_best
    from pipeline.checkpoint import gc_versions

    store = _make_store(tmp_path, 6)
    rec = note_score(str(store), "pass_at_1", "max", {"version": 2, "eval_pass_at_1": 0.5}, update(store, 2))
    assert rec is not None and read_best(str(store))["uri"].endswith("v00000002/model.safetensors")
    pin_evaluating(str(store), update(store, 3))
    deleted = gc_versions(str(store), keep=2)
    assert _versions(store) == [2, 3, 5, 6]
    assert sorted(Path(d).name for d in deleted) == ["v00000001", "v00000004"]
    # the pins live outside the version directories: gc of everything keeps them and their versions
    gc_versions(str(store), keep=0)
    assert _versions(store) == [2, 3] and read_best(str(store))["version"] == 2


def test_the_best_record_keeps_the_newer_of_equals_and_follows_the_mode(tmp_path):
    from pipeline.best import note_score, read_best

    store = str(_make_store(tmp_path, 5))
    s = Path(store)

    def score(v: int, value: float, metric: str = "pass_at_1", mode: str = "max"):
        return note_score(store, metric, mode, {"version": v, f"eval_{metric}": value}, update(s, v) if v else None)

    assert score(0, 0.2)["uri"] is None  # version 0, the base model: no weights in the store
    assert score(1, 0.1) is None and read_best(store)["version"] == 0
    assert score(2, 0.2)["version"] == 2  # equal: the newer version has trained more
    assert score(3, 0.6)["version"] == 3
    assert score(4, 0.5) is None
    assert score(3, 0.0) is None and read_best(store)["score"] == 0.6  # a version scored again: its first score stands
    # another metric or mode starts a new record; min: lower is better
    assert score(4, 9.0, "response_tokens_mean", "min")["version"] == 4
    assert score(5, 10.0, "response_tokens_mean", "min") is None
    assert read_best(store) | {"evaluated_at_ms": 0} == {
        "version": 4, "metric": "response_tokens_mean", "mode": "min", "score": 9.0,
        "uri": f"{store}/v00000004/model.safetensors", "sha256": "h4", "step": 4, "evaluated_at_ms": 0,
    }  # fmt: skip


def test_bad_best_settings_are_refused_in_one_line(tmp_path):
    from rlstream.config import load_config

    for bad in ("eval.best_metric=accuracy", "eval.best_mode=up", "job.export=maybe"):
        with pytest.raises(Exception, match=bad.split("=")[0].split(".")[1]):
            load_config(None, [f"run_dir={tmp_path}", bad], environ={})


PROBE = '''
"""Held-out score set by the test: the number in score.txt beside this file."""
from pathlib import Path


def score(traj: dict) -> float:
    return float((Path(__file__).parent / "score.txt").read_text())
'''

JOB = """
[job]
name = "{name}"
rollout_workers = 1
reward_workers = 1
eval = true
dataset = {{ generator = "next_digit" }}

[rl]
max_staleness = 1
group_size = 4
groups_per_step = 2

[model]
type = "tiny"
charset = "0123456789+=>? "
hidden_size = 32
intermediate_size = 64
num_layers = 1
num_heads = 2
max_position_embeddings = 64

[feed]
epochs = 100000

[rollout]
max_inflight = 16
max_new_tokens = 2

[reward]
executor = "thread"
pool_size = 1
tasks = {{ next_digit = [{{ name = "exact_match", kwargs = {{ extract_regex = "^(.)" }} }}], probe = [{{ name = "probe_reward:score" }}] }}

[trainer]
lr = 0.003
keep_weight_versions = 2

[eval]
source = "{held_out}"
max_new_tokens = 1
"""


def write_job(tmp_path: Path, name: str) -> Path:
    """``job/<name>.toml`` with its held-out set (task ``probe``) and the probe's reward module beside it."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "probe_reward.py").write_text(textwrap.dedent(PROBE))
    (job_dir / "score.txt").write_text("0.0")
    (job_dir / "heldout.jsonl").write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": f"{i}>", "task": "probe", "reference": {}}) + "\n" for i in (1, 2))
    )
    job = job_dir / f"{name}.toml"
    job.write_text(JOB.format(name=name, held_out=job_dir / "heldout.jsonl"))
    return job


@pytest.mark.kafka
def test_the_best_version_outlives_the_window_and_both_are_exported(cli_env, tmp_path):
    """Run 1 (3 steps, ``job.export = false``): every version scores 1.0, so the best is the newest
    of them, version 3, and nothing is exported. Run 2 resumes to 8 steps where every version scores
    0.0: version 3 stays the best, its weights stay in the store though the window keeps 2 versions,
    and the end of the run exports version 8 to export/final and version 3 to export/best."""
    job = write_job(tmp_path, "policy")
    job_dir = job.parent
    run_dir = Path(cli_env["RLSTREAM_RUN_DIR"]) / "policy"
    store = run_dir / "checkpoints"

    def run(*args: str) -> subprocess.CompletedProcess:
        cmd = [*rlstream_cmd(), "run", str(job), "--no-live", *args]
        proc = subprocess.run(cmd, env=cli_env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        return proc

    (job_dir / "score.txt").write_text("1.0")
    first = run("--steps", "3", "--set", "job.export=false")
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "ok" and "export" not in report
    assert not (run_dir / "export").exists() and "export" not in first.stderr
    best = json.loads((store / "pins" / "best.json").read_text())
    assert (best["version"], best["metric"], best["score"]) == (3, "pass_at_1", 1.0)

    (job_dir / "score.txt").write_text("0.0")
    second = run("--steps", "8")
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "ok" and report["steps_completed"] == 8
    there = _versions(store)
    # 7 and 8 (the window), 3 (the best) and at most one the eval role was scoring at the last clean-up
    assert {3, 7, 8} <= set(there) and len(there) <= 4, there
    final, kept = report["export"]["final"], report["export"]["best"]
    assert final == {"version": 8, "dir": str(run_dir / "export" / "final")}
    assert kept == {"version": 3, "metric": "pass_at_1", "score": 1.0, "dir": str(run_dir / "export" / "best")}
    err = second.stderr
    assert f"export final: version 8 -> {run_dir / 'export' / 'final'} (" in err
    assert f"export best: version 3 (pass_at_1 1.000) -> {run_dir / 'export' / 'best'} (" in err
    assert (run_dir / "export" / "best" / "rlstream-version.txt").read_text().split()[0] == "3"
    assert not [p for p in (run_dir / "export").iterdir() if p.name.startswith(".")]  # no temp dirs left

    # export/final is what from_pretrained loads, with the final version's weights
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.checkpoint import read_weights

    version, sha256 = (run_dir / "export" / "final" / "rlstream-version.txt").read_text().split()
    want = read_weights(str(store / "v00000008" / "model.safetensors"), sha256)  # verified against the notice's sha256
    model = AutoModelForCausalLM.from_pretrained(run_dir / "export" / "final", dtype=torch.float32)
    got = model.state_dict()
    assert version == "8" and set(want) <= set(got) and all(torch.equal(got[k], want[k]) for k in want)
    # the kept best version is found by `rlstream export --version` like any version in the store
    env = {k: v for k, v in cli_env.items() if k != "RLSTREAM_RUN_DIR"} | {
        "RLSTREAM_CONFIG": str(run_dir / "config.toml")
    }
    printed = json.loads(
        run_cli(["export", str(tmp_path / "v3"), "--version", "3"], env).stdout.strip().splitlines()[-1]
    )
    assert printed["version"] == 3 and printed["sha256"] == best["sha256"]


@pytest.mark.kafka
def test_a_lora_run_exports_its_final_adapter_directory(cli_env, tmp_path):
    """A LoRA version has no full weights to write: its PEFT directory is copied, verified, as it is."""
    job = write_job(tmp_path, "policy-lora")  # a job name of its own: its consumer groups are its own
    run_dir = Path(cli_env["RLSTREAM_RUN_DIR"]) / "policy-lora"
    lora = ["trainer.lora.rank=4", "trainer.lora.alpha=8", 'trainer.lora.target_modules=["lm_head"]', "job.eval=false"]
    cmd = [*rlstream_cmd(), "run", str(job), "--no-live", "--steps", "2", *(a for s in lora for a in ("--set", s))]
    proc = subprocess.run(cmd, env=cli_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    final = run_dir / "export" / "final"
    assert f"export final: version 2 is a LoRA adapter: its PEFT directory -> {final} (load it on model.path)" in (
        proc.stderr
    )
    assert "export best: none (no held-out eval: job.eval = false)" in proc.stderr
    report = json.loads((run_dir / "report.json").read_text())
    assert report["export"] == {
        "final": {"version": 2, "dir": str(final), "kind": "adapter"},
        "best": {"version": None, "dir": None, "note": "no held-out eval: job.eval = false"},
    }
    from pipeline.checkpoint import read_adapter

    state, conf = read_adapter(str(final / "adapter_model.safetensors"))
    assert conf["r"] == 4 and json.loads((final / "adapter_config.json").read_text()) == conf
    assert all(".lora_" in k for k in state)
