"""docs/how-to/reward.md's complete custom reward (``my_rewards:sum_reward`` kept beside the job file): the
run's config.toml records the job file's directory (``reward.import_dirs``), so a role started by
hand with it (``rlstream reward -c runs/<job>/config.toml``) imports the module from any working
directory, in the worker and in its spawned scoring processes; without it the module is not found."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def doc_example() -> tuple[str, str]:
    """The example's ``my_rewards.py`` and ``sums.toml``, as docs/how-to/reward.md shows them."""
    text = (REPO / "docs" / "how-to" / "reward.md").read_text()
    code = re.search(r"`my_rewards\.py`:\n\n```python\n(.*?)```", text, re.S)
    job = re.search(r"`sums\.toml`:\n\n```toml\n(.*?)```", text, re.S)
    assert code and job, "docs/how-to/reward.md lost its complete custom reward example"
    return code.group(1), job.group(1)


def traj(response: str, answer: int) -> dict:
    return {"task": "sum", "response_text": response, "reference": json.dumps({"answer": answer})}


@pytest.fixture
def job_elsewhere(tmp_path, monkeypatch):
    """The example job in ``jobs/sums``, run from another directory, with a clean environment."""
    for k in [k for k in __import__("os").environ if k.startswith("RLSTREAM_")]:
        monkeypatch.delenv(k)
    job_dir = tmp_path / "jobs" / "sums"
    job_dir.mkdir(parents=True)
    code, job = doc_example()
    (job_dir / "my_rewards.py").write_text(code)
    (job_dir / "sums.toml").write_text(job)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    yield job_dir / "sums.toml"
    sys.modules.pop("my_rewards", None)


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_hand_started_reward_role_imports_the_module_beside_the_job_file(job_elsewhere, tmp_path, executor):
    from libs.rewards.pool import make_pool
    from pipeline.config import dump_toml
    from rlstream.config import load_config, record_job_dir
    from rlstream.job import resolve

    sets = [f"run_dir={json.dumps(str(tmp_path / 'runs'))}", f"reward.executor={json.dumps(executor)}",
            "reward.pool_size=1"]  # fmt: skip
    cfg = resolve(job_elsewhere, sets)
    record_job_dir(cfg, job_elsewhere)  # what `rlstream run` does before the launcher writes config.toml
    run_config = Path(cfg.run_dir) / "config.toml"
    run_config.parent.mkdir(parents=True)
    run_config.write_text(dump_toml(cfg))

    hand = load_config(run_config, [], environ={})  # rlstream reward -c runs/sums/config.toml
    assert hand.reward.import_dirs == [job_elsewhere.parent]
    pool = make_pool(hand.reward)
    try:
        out = pool.score([traj("17 + 25 = 42", 42), traj("41", 42), traj("no idea", 42)])
    finally:
        pool.close()
    assert [(o.ok, o.reward) for o in out] == [(True, 1.0), (True, 0.1), (True, 0.0)]
    assert out[0].details == {"my_rewards:sum_reward": 1.0, "my_rewards:sum_reward.parsed": 1.0,
                              "my_rewards:sum_reward.right": 1.0}  # fmt: skip


def test_without_the_job_dir_the_module_is_not_found_and_says_where_it_looked(job_elsewhere, tmp_path):
    from libs.rewards.base import TaskRouter
    from pipeline.errors import ConfigError
    from rlstream.job import resolve

    cfg = resolve(job_elsewhere, [f"run_dir={json.dumps(str(tmp_path / 'runs'))}"])
    with pytest.raises(ConfigError, match="cannot import my_rewards"):
        TaskRouter(cfg.reward)
    cfg.reward.import_dirs = [Path("..") / "jobs" / "sums"]  # relative: from the working directory
    assert TaskRouter(cfg.reward)(traj("42", 42)).reward == 1.0
