"""Checks before start: every mistake that can be known before a process starts is one
line from ``rlstream run`` within seconds, exit code 2, no traceback, and nothing is created: no run
dir, no generated data, no topics. The real CLI as a subprocess against the test broker, each job
run from another working directory than its job file's (as a user's job is)."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.conftest import rlstream_cmd

pytestmark = pytest.mark.kafka

CHAT = [{"role": "user", "content": "1>"}]
TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


def job_file(tmp_path, body: str, rows: list[dict] | None = None, files: dict[str, str] | None = None):
    """``jobs/t.toml`` (with ``data.jsonl`` of ``rows`` beside it, and ``files``), run from ``cwd/``."""
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    if rows is not None:
        (jobs / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        body = f"[feed]\nsource = {json.dumps(str(jobs / 'data.jsonl'))}\n{body}"
    for name, text in (files or {}).items():
        (jobs / name).write_text(text)
    (jobs / "t.toml").write_text('[job]\nname = "t"\nrollout_workers = 1\nreward_workers = 1\n' + body)
    (tmp_path / "cwd").mkdir()
    return jobs / "t.toml"


PLAIN = [{"id": "a", "prompt": "1>", "answer": "2"}]
CHATS = [{"id": "a", "messages": CHAT, "answer": "2"}]
CASES = {
    "missing feed.source": (
        '[feed]\nsource = "missing.jsonl"\n', None, None,
        ["ConfigError: feed.source missing.jsonl does not exist"],
    ),
    "empty dataset": ("", [], None, ["feed.source", "has no records"]),
    "record without a prompt": ("", [{"id": "a", "answer": "2"}], None, ["record 0 has no prompt text"]),
    "misspelt reward": (
        '[reward]\ndefault = [{ name = "exact_matc" }]\n', PLAIN, None,
        ["reward.default: unknown reward 'exact_matc'; built-ins: ", "exact_match"],
    ),
    "reward module that fails to import": (  # found beside the job file (reward.import_dirs), then it fails
        '[reward]\ndefault = [{ name = "myrew:score" }]\n', PLAIN,
        {"myrew.py": "import no_such_module_xyz\n\ndef score(t):\n    return 1.0\n"},
        ["reward.default: 'myrew:score': cannot import myrew (looked in ", "No module named 'no_such_module_xyz'"],
    ),
    "task without a reward": (
        '[reward]\ndefault = []\n', [{**PLAIN[0], "task": "sums"}], None,
        ["reward.tasks has no entry for task 'sums'"],
    ),
    "misspelt environment": (
        '[rollout.env]\ntasks = { guess = "guess_numbr" }\n', PLAIN, None,
        ["rollout.env.tasks.guess: unknown environment 'guess_numbr'"],
    ),
    "misspelt tool": (
        '[rollout.env]\ntasks = { sums = "tools" }\noptions = { sums = { tools = ["calculater"] } }\n', PLAIN, None,
        ["rollout.env.options.sums: unknown tool 'calculater'; built-ins: calculator, python"],
    ),
    "user loss that does not import": (
        '[trainer.loss]\ntype = "no_such_pkg_xyz.losses:MyLoss"\n', PLAIN, None,
        ["trainer.loss.type: 'no_such_pkg_xyz.losses:MyLoss': cannot import no_such_pkg_xyz.losses"],
    ),
    "bad model path": (
        '[model]\ntype = "pretrained"\npath = "/nonexistent/model"\n', PLAIN, None,
        ["ConfigError: model.path /nonexistent/model: no such directory"],
    ),
    "messages without a chat template": ("", CHATS, None, ["has chat messages (record 0)", "no chat template"]),
    'chat_template = "never" with messages': (
        f'[rollout]\nchat_template = "never"\n[model]\nchat_template = {json.dumps(TEMPLATE)}\n', CHATS, None,
        ['rollout.chat_template = "never"', "chat messages without prompt text (record 0)"],
    ),
    "generated data, misspelt reward": (  # checked before the generated data is written: no run dir
        '[job.dataset]\ngenerator = "next_digit"\n[reward]\ndefault = [{ name = "exact_matc" }]\n', None, None,
        ["unknown reward 'exact_matc'"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_a_mistake_known_before_start_is_one_line_and_creates_nothing(case, cli_env, make_config, tmp_path):
    from pipeline.admin import Admin
    from pipeline.kafka import client_conf

    body, rows, files, said = CASES[case]
    job = job_file(tmp_path, body, rows, files)
    t0 = time.monotonic()
    p = subprocess.run([*rlstream_cmd(), "run", str(job), "--no-live"], env=cli_env, capture_output=True,
                       text=True, timeout=120, cwd=tmp_path / "cwd")  # fmt: skip
    took = time.monotonic() - t0
    print(f"[preflight] {case}: exit {p.returncode} in {took:.1f} s")
    lines = [line for line in (p.stdout + p.stderr).splitlines() if line.strip()]
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: ConfigError: "), lines
    assert "Traceback" not in p.stderr
    assert all(s in lines[0] for s in said), lines[0]
    assert took < 60, f"took {took:.1f} s"  # a few seconds; generous for a loaded machine
    assert not (tmp_path / "runs").exists()  # no run dir, no generated data
    cfg = make_config(create=False)
    admin = Admin(client_conf(cfg, "admin"))
    try:
        assert not {t for t in admin.list_topics() if t.startswith(cfg.topics.prefix)}
    finally:
        admin.close()


def test_a_reward_module_beside_the_job_file_is_found_from_another_directory(cli_env, make_config, tmp_path):
    """The check imports a ``module:function`` reward as the job's roles will (the job file's
    directory first): a good module beside the job file passes, and the next check says its line."""
    job = job_file(
        tmp_path,
        '[reward]\ndefault = [{ name = "myrew:score" }]\n[rollout.env]\ntasks = { g = "nowhere_xyz:Env" }\n',
        PLAIN,
        {"myrew.py": "def score(t):\n    return 1.0\n"},
    )
    p = subprocess.run([*rlstream_cmd(), "run", str(job), "--no-live"], env=cli_env, capture_output=True,
                       text=True, timeout=120, cwd=tmp_path / "cwd")  # fmt: skip
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "rollout.env.tasks.g: 'nowhere_xyz:Env': cannot import nowhere_xyz" in p.stderr, p.stderr
    assert f"looked in {job.parent}" in p.stderr.replace("\n", ""), p.stderr  # the job file's directory first
    assert not (tmp_path / "runs").exists()


def test_the_checks_pass_a_good_job_and_read_generated_data_before_it_is_written(tmp_path, monkeypatch):
    """In process: a job with generated data passes (nothing written yet), and a chat dataset with a
    template passes too, its first prompt rendered."""
    from rlstream.job import plan, write_data
    from rlstream.preflight import check

    for k in [k for k in __import__("os").environ if k.startswith("RLSTREAM_")]:
        monkeypatch.delenv(k)
    job = tmp_path / "g.toml"
    job.write_text('[job]\nname = "g"\neval = true\n[job.dataset]\ngenerator = "arithmetic"\nheld_out = 0.2\n')
    cfg, data = plan(job, [f"run_dir={json.dumps(str(tmp_path / 'runs'))}"])
    assert set(data) == {cfg.feed.source, cfg.eval.source} and not (tmp_path / "runs").exists()
    check(cfg, data)
    assert not (tmp_path / "runs").exists()
    write_data(data)
    assert cfg.feed.source.read_text() == data[cfg.feed.source]

    (tmp_path / "chat").mkdir()
    chat = job_file(tmp_path / "chat", f"[model]\nchat_template = {json.dumps(TEMPLATE)}\n", CHATS)
    cfg, data = plan(chat, [f"run_dir={json.dumps(str(tmp_path / 'runs'))}"])
    assert not data
    check(cfg, data)


ENV_MODULE = """from producers.envs import Environment, StepResult


class Echo(Environment):
    def reset(self, prompt, sample_index):
        return "say something\\n"

    def step(self, text):
        return StepResult("", 1.0, True, {})
"""


def test_an_environment_module_beside_the_job_file_is_found_like_a_reward(tmp_path):
    """``rlstream run`` puts the job file's directory in rollout.env.import_dirs too: the checks and
    the rollout worker's env_factory find a ``module:Class`` kept there, without sys.path edits."""
    from pipeline.errors import ConfigError
    from producers.envs import Environment, env_factory
    from rlstream.config import Config, record_job_dir

    (tmp_path / "my_echo_env.py").write_text(ENV_MODULE)
    with pytest.raises(ConfigError):
        env_factory("my_echo_env:Echo")  # not on the import path
    cfg = Config()
    record_job_dir(cfg, tmp_path / "job.toml")
    assert [p.resolve() for p in cfg.rollout.env.import_dirs] == [tmp_path.resolve()]
    assert cfg.reward.import_dirs == cfg.rollout.env.import_dirs
    env = env_factory("my_echo_env:Echo", cfg.rollout.env.import_dirs)
    assert issubclass(env, Environment) and env.__name__ == "Echo"


def test_the_tiny_models_checks_build_its_tokenizer_only_for_a_template(tmp_path):
    """The tiny model's tokenizer (transformers: ~0.7 s of the launcher's start beside the fork
    server's imports) is built only when a prompt goes through its chat template: a plain job is
    checked without importing transformers, a chat job renders its first prompt."""
    import subprocess
    import sys

    code = (
        "import json, sys\n"
        "from rlstream.job import plan\n"
        "from rlstream.preflight import check\n"
        "cfg, data = plan(sys.argv[1], [f'run_dir={json.dumps(sys.argv[2])}'])\n"
        "check(cfg, data)\n"
        "print('transformers' in sys.modules)\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("RLSTREAM_")}
    plain = job_file(tmp_path, "", PLAIN)
    (tmp_path / "chat").mkdir()
    chat = job_file(tmp_path / "chat", f"[model]\nchat_template = {json.dumps(TEMPLATE)}\n", CHATS)
    got = [
        subprocess.run([sys.executable, "-c", code, str(job), str(tmp_path / "runs")], capture_output=True,
                       text=True, env=env, timeout=300)
        for job in (plain, chat)
    ]  # fmt: skip
    assert [g.returncode for g in got] == [0, 0], [g.stderr[-2000:] for g in got]
    assert [g.stdout.split()[-1] for g in got] == ["False", "True"]
