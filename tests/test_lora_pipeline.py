"""LoRA through the real pipeline (real broker): with ``trainer.lora`` every WeightUpdate announces
an adapter (kind, rank, targets, base fingerprint) whose file is the adapter alone, the hf rollout
workers apply each version, and the reward rises on the next-digit task; a rollout worker whose
engine cannot load adapters refuses the notice loudly (typed error, non-zero exit)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests import rl_pipeline
from tests.conftest import rlstream_cmd

pytestmark = pytest.mark.kafka
pytest.importorskip("peft")

TINY = [
    "model.type=tiny",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.num_layers=1",
    "model.intermediate_size=64",
]
# Adapters on the output projection learn the tiny random model's task fastest (docs/reference/trainer.md).
LORA = ["trainer.lora.rank=8", "trainer.lora.alpha=16", 'trainer.lora.target_modules=["lm_head"]', "trainer.lr=0.02"]


def control_records(cfg):
    from pipeline import codec
    from pipeline.kafka import Consumer, client_conf

    with Consumer(client_conf(cfg, "test", kind="consumer")) as c:
        return [codec.decode(m.value()) for m in c.read_to_end(cfg.topics.name("control"), timeout=30.0)]


def test_a_worker_whose_engine_cannot_load_adapters_exits_non_zero(make_config, cli_env, tmp_path):
    """The sim engine loads full weights only: an adapter notice stops its worker with WeightFormatError."""
    from consumers.trainer.engines import TrainContext, build_engine
    from consumers.trainer.publish import write_version
    from pipeline.checkpoint import model_fingerprint
    from pipeline.control import publish_weight_update
    from pipeline.kafka import Producer, client_conf
    from pipeline.models import materialize

    cfg = make_config(*TINY, *LORA)
    d = materialize(cfg.model)
    eng = build_engine(cfg.trainer.engine, TrainContext(d, cfg.trainer))
    upd = write_version(eng, eng.state_dict(), str(tmp_path / "store"), 1, 1, cfg.trainer, 8, model_fingerprint(d))
    p = Producer(client_conf(cfg, "test", kind="producer"))
    publish_weight_update(p, cfg.topics.name("control"), upd)
    p.close()
    sets = [x for s in [*TINY, "rollout.exit_when_idle_s=60"] for x in ("--set", s)]
    proc = subprocess.run(
        [*rlstream_cmd(), "rollout", "--engine", "sim", *sets], env=cli_env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0
    assert "WeightFormatError" in proc.stderr and "'adapter' update" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_adapter_only_sync_learns_the_next_digit_task(make_config, topic_prefix, tmp_path):
    from consumers.trainer.state import read_steps_log
    from pipeline.checkpoint import model_fingerprint, read_adapter
    from pipeline.models import materialize

    steps = 60
    task = rl_pipeline.write_task(tmp_path / "task.jsonl")
    cfg = make_config(*rl_pipeline.settings(task, topic_prefix, steps, G=8, n=8, k=1), *LORA)
    out = rl_pipeline.run(cfg, steps, rollout_workers=1)

    log = read_steps_log(Path(cfg.run_dir) / "trainer")
    curve = [e["reward_mean"] for e in log]
    assert len(curve) == steps
    first, last = sum(curve[:10]) / 10, sum(curve[-10:]) / 10
    print(f"[lora e2e] {steps} steps in {out['seconds']:.0f} s; reward {first:.3f} -> {last:.3f}")
    assert first <= 0.25 and last >= first + 0.2, curve

    # every version was an adapter: the notice says so, and the file is the adapter alone
    notices = [r for name, r in control_records(cfg) if name == "WeightUpdate"]
    assert [r["version"] for r in notices] == list(range(1, steps + 1))
    base = model_fingerprint(materialize(cfg.model))
    full_bytes = (materialize(cfg.model) / "model.safetensors").stat().st_size
    for r in notices:
        assert r["kind"] == "adapter" and r["adapter_rank"] == 8 and r["adapter_target_modules"] == ["lm_head"]
        assert r["base_sha256"] == base and r["bytes"] < full_bytes / 5
    state, conf = read_adapter(notices[-1]["uri"], notices[-1]["sha256"])
    assert conf["r"] == 8 and all(".lora_" in k for k in state)
    # the rollout worker loaded adapters as they came (at least one version per k + 1 steps)
    stats = out["rollout"][0]
    assert stats["loads"] >= steps // 2
