"""The loop a person iterates in, through the real CLI and a real broker: a job knows what it is
(a changed reward or model is refused naming the keys; a changed lr and ``--steps`` resume and say
so; another run dir of the same name is refused; a ``--steps`` already reached is refused), a
job forks from version N of another (the fork's version 0 is exactly those weights, evaluates as
they do, and learns on), ``rlstream jobs`` lists them, ``jobs rm`` and ``--restart`` leave
nothing of the job behind. And every key of the config is classified (``rlstream.identity``)."""

from __future__ import annotations

import json
import os
import time
import typing
import uuid
from pathlib import Path

import pytest
from pydantic import BaseModel

from tests.conftest import REPO, run_cli

JOB = REPO / "examples/next-digit.toml"
FAST = ["rollout.max_inflight=32", "reward.session_timeout_ms=6000", "rollout.session_timeout_ms=6000",
        "trainer.keep_weight_versions=50", "job.dataset.held_out=0.3"]  # fmt: skip


def config_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every leaf key of a pydantic config, walking nested models and union members."""
    out = []
    for name, f in model.model_fields.items():
        ann = f.annotation
        if typing.get_origin(ann) is typing.Annotated:
            ann = typing.get_args(ann)[0]
        members = [a for a in (typing.get_args(ann) or (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if members:
            for m in members:
                out += config_keys(m, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return sorted(set(out))


def test_every_config_key_is_classified_and_every_class_entry_is_used():
    from rlstream.config import Config
    from rlstream.identity import CLASSES, classify

    keys = config_keys(Config)
    assert not [k for k in keys if classify(k) is None], "classify these keys in rlstream.identity.CLASSES"
    unused = [p for p in CLASSES if not any(k == p or k.startswith(p + ".") for k in keys)]
    assert not unused, f"CLASSES entries that name no config key: {unused}"
    assert classify("model.hidden_size") == "learned" and classify("trainer.lr") == "safe"
    assert classify("reward.tasks.math[0].kwargs.x") == "learned" and classify("job.rollout_workers") == "safe"


def test_changes_name_the_key_where_the_values_differ():
    from rlstream.identity import changes

    old = {
        "reward": {"tasks": {"t": [{"name": "exact_match", "kwargs": {"extract_regex": "^(.)"}}]}},
        "trainer": {"lr": 1e-5},
    }
    new = {
        "reward": {"tasks": {"t": [{"name": "exact_match", "kwargs": {"extract_regex": "^(..)"}}]}},
        "trainer": {"lr": 5e-6},
    }
    got = [(c.key, c.kind, str(c)) for c in changes(old, new)]
    assert got == [
        ("reward.tasks.t[0].kwargs.extract_regex", "learned", 'reward.tasks.t[0].kwargs.extract_regex "^(.)" -> "^(..)"'),
        ("trainer.lr", "safe", "trainer.lr 1e-05 -> 5e-06"),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def env(kafka_bootstrap, tmp_path_factory):
    """The CLI's environment: the test broker, a run dir of the module's, the job's own topic names
    (no prefix from the environment: a fork takes its own from its name)."""
    base = tmp_path_factory.mktemp("iterate")
    e = {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM_")}
    e.update(RLSTREAM_KAFKA__BOOTSTRAP_SERVERS=kafka_bootstrap, RLSTREAM_RUN_DIR=str(base / "runs"),
             RLSTREAM_HOME=str(base / "home"), PYTHONUNBUFFERED="1")  # fmt: skip
    return e


def sets(*extra: str) -> list[str]:
    return [x for s in [*FAST, *extra] for x in ("-s", s)]


@pytest.fixture(scope="module")
def parent(env):
    """A next-digit job of 6 steps."""
    name = f"it{uuid.uuid4().hex[:8]}"
    run_cli(["run", str(JOB), "--steps", "6", "--no-live", *sets(f"job.name={name}")], env, timeout=900)
    return name, Path(env["RLSTREAM_RUN_DIR"]) / name


def on_broker(env, prefix: str, what: str = "topics") -> set[str]:
    """The topics (or consumer groups) on the test broker whose names start with ``prefix``."""
    from pipeline.admin import Admin

    admin = Admin({"bootstrap.servers": env["RLSTREAM_KAFKA__BOOTSTRAP_SERVERS"]})
    try:
        names = admin.list_topics() if what == "topics" else admin.list_groups()
        return {t for t in names if t.startswith(prefix)}
    finally:
        admin.close()


def refused(env, args: list[str], pattern: str) -> str:
    t0 = time.monotonic()
    proc = run_cli(args, env, timeout=300, check=False)
    took = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    errors = [x for x in out.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and __import__("re").search(pattern, errors[0]), out[-3000:]
    assert took < 120, f"a refusal took {took:.0f} s"
    return errors[0]


@pytest.mark.kafka
@pytest.mark.slow
def test_a_changed_job_is_refused_naming_the_keys_and_safe_changes_resume(env, parent):
    name, run_dir = parent
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    stamp = (run_dir / "job.json").stat().st_mtime_ns
    topics = on_broker(env, f"{name}.")
    line = refused(env, ["run", str(JOB), "--steps", "8", "--no-live",
                         *sets(f"job.name={name}", 'reward.tasks.next_digit=[{name="exact_match",kwargs={extract_regex="^(..)"}}]')],
                   "JobChanged")  # fmt: skip
    assert 'reward.tasks.next_digit[0].kwargs.extract_regex "^(.)" -> "^(..)"' in line and "--restart" in line
    line = refused(env, ["run", str(JOB), "--steps", "8", "--no-live", *sets(f"job.name={name}", "model.hidden_size=32")],
                   "JobChanged")  # fmt: skip
    assert "model.hidden_size 64 -> 32" in line
    other = Path(env["RLSTREAM_RUN_DIR"]).parent / "elsewhere"
    line = refused(env, ["run", str(JOB), "--steps", "8", "--no-live", *sets(f"job.name={name}", f"run_dir={other}")],
                   "JobChanged")  # fmt: skip
    assert str(run_dir) in line and not other.exists()
    refused(env, ["run", str(JOB), "--steps", "6", "--no-live", *sets(f"job.name={name}")], "NothingToTrain: .* step 6")
    # nothing was created or changed by the refusals
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before
    assert (run_dir / "job.json").stat().st_mtime_ns == stamp and on_broker(env, f"{name}.") == topics

    proc = run_cli(["run", str(JOB), "--steps", "8", "--no-live", *sets(f"job.name={name}", "trainer.lr=0.001")], env,
                   timeout=900)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert f"resuming {name} at step 6; changed: trainer.lr 0.003 -> 0.001, trainer.max_steps 6 -> 8" in out, out[
        -3000:
    ]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "ok" and report["steps_completed"] == 8
    stored = json.loads((run_dir / "job.json").read_text())
    assert stored["settings"]["trainer"]["lr"] == 0.001 and stored["run_dir"] == str(run_dir)


@pytest.mark.kafka
@pytest.mark.slow
def test_a_fork_starts_from_exactly_version_n_and_learns_on(env, parent):
    from safetensors.torch import load_file

    from pipeline.checkpoint import read_weights
    from pipeline.versions import find_update
    from rlstream.config import load_config

    name, run_dir = parent
    fork = f"{name}-f"
    args = ["run", str(JOB), "--fork", fork, "--from-version", "4", "--steps", "3", "--no-live",
            *sets(f"job.name={name}")]  # fmt: skip
    proc = run_cli(args, env, timeout=900)
    fork_dir = Path(env["RLSTREAM_RUN_DIR"]) / fork
    report = json.loads((fork_dir / "report.json").read_text())
    assert report["status"] == "ok" and report["steps_completed"] == 3, (proc.stdout + proc.stderr)[-3000:]
    assert report["forked_from"]["job"] == name and report["forked_from"]["version"] == 4
    assert f"forked from {name} v4" in report["title"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(fork_dir / "tensorboard"))
    ea.Reload()
    assert any(f"forked from {name} v4" in e.tensor_proto.string_val[0].decode() for e in ea.Tensors("run"))

    # the fork's base is exactly the parent's version 4
    pcfg = load_config(run_dir / "config.toml", [], environ={})
    pcfg.kafka.bootstrap_servers = env["RLSTREAM_KAFKA__BOOTSTRAP_SERVERS"]
    update = find_update(pcfg, 4)
    want, got = read_weights(update["uri"], update["sha256"]), load_file(str(fork_dir / "base" / "model.safetensors"))
    assert report["forked_from"]["sha256"] == update["sha256"]
    for key, tensor in want.items():
        assert key in got and got[key].equal(tensor.to(got[key].dtype)), key

    # ... and evaluates as it: the same greedy answers on the same held-out prompts
    def answers(cfg_path: Path, version: int) -> list:
        out = run_cli(["-c", str(cfg_path), "eval", "--version", str(version)], env, timeout=600).stdout
        result = json.loads(out.strip().splitlines()[-1])
        rows = [json.loads(x) for x in Path(result["answers_file"]).read_text().splitlines() if x.strip()]
        return sorted((r["prompt_text"], r["response_text"], r["reward"]) for r in rows)

    assert answers(run_dir / "config.toml", 4) == answers(fork_dir / "config.toml", 0)

    # running the same command again resumes the fork; another --from-version is another job
    again = ["run", str(JOB), "--fork", fork, "--steps", "4", "--no-live", *sets(f"job.name={name}")]
    proc = run_cli(again, env, timeout=900)
    assert f"resuming {fork} at step 3" in proc.stdout + proc.stderr
    refused(env, ["run", str(JOB), "--fork", fork, "--from-version", "5", "--steps", "5", "--no-live",
                  *sets(f"job.name={name}")], "another job")  # fmt: skip

    # rlstream jobs lists both; jobs rm leaves no topic, group or file of the fork
    rows = [json.loads(x) for x in run_cli(["jobs", "--json"], env).stdout.splitlines() if x.strip()]
    by = {r["job"]: r for r in rows}
    assert by[fork]["forked_from"]["job"] == name and by[fork]["version"] == 4 and not by[fork]["running"]
    assert by[name]["run_dir"] == str(run_dir) and by[name]["version"] >= 8
    run_cli(["jobs", "rm", fork], env, timeout=300)
    assert not on_broker(env, f"{fork}.") and not fork_dir.exists()
    assert not on_broker(env, f"{fork}-", "groups")


@pytest.mark.kafka
@pytest.mark.slow
def test_restart_deletes_the_job_then_trains_it_from_scratch(env, parent):
    name, run_dir = parent
    old_run_id = json.loads((run_dir / "report.json").read_text())["run_id"]
    proc = run_cli(["run", str(JOB), "--restart", "--steps", "2", "--no-live", *sets(f"job.name={name}")], env,
                   timeout=900)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert f"deleting job {name}: topics " in out and str(run_dir) in out, out[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "ok" and report["steps_completed"] == 2 and report["run_id"] != old_run_id
    from consumers.trainer.state import read_steps_log

    assert [s["step"] for s in read_steps_log(run_dir / "trainer")] == [1, 2]
    run_cli(["jobs", "rm", name], env, timeout=300)
    assert not on_broker(env, f"{name}.") and not run_dir.exists() and not on_broker(env, f"{name}-", "groups")


def test_a_fork_that_would_share_its_parents_checkpoint_store_is_refused(tmp_path):
    from pipeline.errors import ConfigError
    from rlstream.job import launch_fork

    job = tmp_path / "j.toml"
    job.write_text(
        f'checkpoint_store = "{tmp_path / "store"}"\n[job]\nname = "j"\ndataset = {{ generator = "next_digit" }}\n'
    )
    with pytest.raises(ConfigError, match=r"checkpoint_store .* is j's too"):
        launch_fork(job, [f"run_dir={tmp_path}"], "k", None)
    assert not (tmp_path / "k").exists()
