"""DeepSpeed engine on the CPU (gloo): the same batch gives the same loss, gradients and update as
the torch engine (ZeRO-2 and ZeRO-3, one process); ZeRO-2 with two real processes (torchrun)
matches one process; a DeepSpeed trainer stopped and resumed from its checkpoint ends with the
same weights as an uninterrupted run.

Run as a script (``torchrun --nproc_per_node 2 tests/test_deepspeed.py OUT``) it is the two-rank
worker of ``test_zero2_two_processes_match_one_process``.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "model.type=tiny",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.num_layers=1",
    "model.intermediate_size=64",
]


def config(*extra: str):
    from rlstream.config import load_config

    return load_config(None, [*TINY, "trainer.micro_batch_size=2", "trainer.lr=0.01", *extra], environ={})


def make_samples(n: int = 5):
    """Deterministic off-policy samples with environment tokens and two groups' advantages."""
    from consumers.trainer.batch import TrainSample

    rng = random.Random(7)
    out = []
    for i in range(n):
        n_resp = rng.randint(3, 9)
        mask = [1] * n_resp
        mask[1] = 0
        out.append(
            TrainSample(
                trajectory_id=f"g{i % 2}/{i}",
                prompt_group=f"g{i % 2}",
                partition=0,
                offset=i,
                prompt=[rng.randrange(4, 90) for _ in range(rng.randint(2, 6))],
                response=[rng.randrange(4, 90) for _ in range(n_resp)],
                logprobs=[-rng.uniform(3.5, 5.0) for _ in range(n_resp)],
                mask=mask,
                reward=float(i % 3),
                version_min=0,
                version_max=0,
                group_size=3,
                advantage=[1.0, -0.5, 0.25, -1.0, 0.5][i % 5],
            )
        )
    return out


def one_step(engine, cfg, rank: int = 0, world: int = 1):
    from consumers.trainer.batch import sample_weights, shard_micro_batches
    from consumers.trainer.losses import LossFn

    samples = make_samples()
    mbs = shard_micro_batches(samples, sample_weights(samples, cfg.trainer.loss), rank, world, 2)
    res = engine.train_step(mbs, LossFn(cfg.trainer.loss), capture_grads=True)
    return res, len(mbs)


def assert_close(a: dict, b: dict, atol: float = 1e-6, rtol: float = 1e-4):
    import torch

    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k].float(), b[k].float(), atol=atol, rtol=rtol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.deepspeed
@pytest.mark.parametrize("stage", [2, 3])
def test_torch_and_zero_give_the_same_loss_gradients_and_update(stage):
    from consumers.trainer.engines import TrainContext
    from consumers.trainer.engines.deepspeed_engine import DeepSpeedEngine
    from consumers.trainer.engines.torch_engine import TorchEngine
    from pipeline.models import materialize

    cfg_t = config("trainer.loss.type=cispo")
    cfg_d = config("trainer.loss.type=cispo", "trainer.engine.type=deepspeed", f"trainer.engine.zero_stage={stage}")
    model_dir = materialize(cfg_t.model)
    torch_eng, ds_eng = (
        TorchEngine(cfg_t.trainer.engine, TrainContext(model_dir, cfg_t.trainer)),
        DeepSpeedEngine(cfg_d.trainer.engine, TrainContext(model_dir, cfg_d.trainer)),
    )
    assert_close(torch_eng.state_dict(), ds_eng.state_dict(), atol=0, rtol=0)  # same start
    rt, n_micro = one_step(torch_eng, cfg_t)
    rd, _ = one_step(ds_eng, cfg_d)
    assert n_micro == 3  # gradient accumulation over micro-batches is exercised
    assert rd.loss == pytest.approx(rt.loss, rel=1e-5) and rt.loss != 0
    assert rd.grad_norm == pytest.approx(rt.grad_norm, rel=1e-4)
    assert_close(rt.grads, rd.grads)
    assert max(float(g.abs().max()) for g in rt.grads.values()) > 1e-4  # gradients are not all zero
    assert_close(torch_eng.state_dict(), ds_eng.state_dict())  # same AdamW update


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.deepspeed
@pytest.mark.slow
def test_zero2_two_processes_match_one_process(tmp_path):
    """torchrun starts two real processes (gloo on the CPU); each trains its shard of the batch. The
    summed loss, the full gradients and the updated weights equal one torch process on the batch."""
    import torch

    from consumers.trainer.engines import TrainContext
    from consumers.trainer.engines.torch_engine import TorchEngine
    from pipeline.models import materialize

    out = tmp_path / "rank0.pt"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(PYTHONPATH=str(REPO), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc_per_node=2",
        f"--master_port={_free_port()}",
        str(Path(__file__).resolve()),
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    got = torch.load(out, weights_only=False)
    assert got["world"] == 2 and got["n_micro"] == [2, 2]  # rank 1 ran one dummy micro-batch

    cfg = config()
    ref = TorchEngine(cfg.trainer.engine, TrainContext(materialize(cfg.model), cfg.trainer))
    res, _ = one_step(ref, cfg)
    assert got["loss"] == pytest.approx(res.loss, rel=1e-5)
    assert_close(res.grads, got["grads"])
    assert_close(ref.state_dict(), got["weights"])


def two_rank_main(out: str) -> None:
    """One rank of the two-process run (started by torchrun)."""
    import torch

    from consumers.trainer.engines import TrainContext
    from consumers.trainer.engines.base import all_reduce_sums, close_dist
    from consumers.trainer.engines.deepspeed_engine import DeepSpeedEngine
    from pipeline.models import materialize
    from pipeline.worker import exit_without_teardown

    cfg = config("trainer.engine.type=deepspeed", "trainer.engine.zero_stage=2")
    eng = DeepSpeedEngine(cfg.trainer.engine, TrainContext(materialize(cfg.model), cfg.trainer))
    res, n_micro = one_step(eng, cfg, eng.rank, eng.world_size)
    loss = all_reduce_sums([res.loss], eng.world_size)[0]
    counts = [0] * eng.world_size
    counts[eng.rank] = n_micro
    counts = [int(c) for c in all_reduce_sums(counts, eng.world_size)]
    weights = eng.state_dict()
    if eng.rank == 0:
        torch.save(
            {"loss": loss, "grads": res.grads, "weights": weights, "world": eng.world_size, "n_micro": counts}, out
        )
    close_dist(eng.world_size)
    exit_without_teardown(0, "two-rank test done")  # as ``rlstream train`` does (Trainer.teardown_hazards)


@pytest.mark.deepspeed
@pytest.mark.kafka
def test_deepspeed_trainer_resumes_to_the_same_weights(make_config, tmp_path):
    """Two steps, stop, restart for a third (DeepSpeed checkpoint: model, optimizer, scheduler,
    offsets) == three uninterrupted torch-engine steps on the same records."""
    from consumers.trainer.state import read_steps_log
    from consumers.trainer.worker import Trainer
    from tests.test_trainer import ScoredProducer, scored

    common = [
        *TINY,
        "rl.group_size=2",
        "rl.groups_per_step=1",
        "rl.max_staleness=4",
        "topics.scored.partitions=1",  # one arrival order, so both runs train the same steps
        "trainer.lr=0.01",
        "trainer.poll_timeout_s=0.2",
    ]
    records = [[scored(f"r{g}", i, 2, 0, float((g + i) % 2), seq=g) for i in range(2)] for g in range(3)]
    runs = {}
    for name, extra in (
        ("ds", ["trainer.engine.type=deepspeed", "trainer.engine.zero_stage=2"]),
        ("torch", []),
    ):
        cfg = make_config(*common, *extra, f"topics.prefix={name}{tmp_path.name[-8:]}.", f"run_dir={tmp_path / name}")
        sp = ScoredProducer(cfg)
        for recs in records:
            sp.send(recs)
        sp.close()
        for stop_at in (2, 3) if name == "ds" else (3,):
            t = Trainer(cfg, max_steps=stop_at)
            try:
                assert t.run() == stop_at
                runs[name] = t.engine.state_dict()
            finally:
                t.close()
        steps = read_steps_log(tmp_path / name / "trainer")
        assert [s["used"] for s in steps] == [[f"r{g}/0", f"r{g}/1"] for g in range(3)]
    # Adam divides by sqrt(v): last-bit differences of near-zero gradients show up as ~1e-6 here, while
    # a lost optimizer state or step count moves weights by O(lr) = 1e-2
    assert_close(runs["ds"], runs["torch"], atol=2e-5)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    two_rank_main(sys.argv[1])


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.parametrize("engine", [pytest.param("deepspeed", marks=pytest.mark.deepspeed), "torch"])
def test_cli_trainer_on_two_processes_resumes(make_config, cli_env, engine, tmp_path):
    """``torchrun --nproc_per_node 2 -m rlstream train --engine deepspeed`` (ZeRO-2), and the
    torch engine as DDP: rank 0 consumes and broadcasts, both ranks train; a second launch resumes
    from the two-rank checkpoint."""
    from consumers.trainer.state import read_steps_log
    from tests.test_trainer import ScoredProducer, read_topic, scored

    sets = [*TINY, "rl.group_size=4", "rl.groups_per_step=1", "rl.max_staleness=4", "topics.scored.partitions=1"]
    cfg = make_config(*sets)
    sp = ScoredProducer(cfg)
    for g in range(3):
        sp.send([scored(f"d{g}", i, 4, 0, float(i % 2), seq=g) for i in range(4)])
    sp.close()
    env = {k: v for k, v in cli_env.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))  # torchelastic_* dirs
    args = ["train", "--engine", engine, *[x for s in sets for x in ("--set", s)]]

    def launch(max_steps: int) -> str:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2"]
        cmd += [f"--master_port={_free_port()}", "-m", "rlstream", *args, "--max-steps", str(max_steps)]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
        return p.stderr

    first = launch(2)
    assert 'world="2"' in first and ('zero_stage="2"' in first or engine == "torch")
    # both ranks skip interpreter teardown, where gloo's worker threads can abort a finished run
    assert first.count('exiting without interpreter teardown world="2"') == 2
    second = launch(3)
    assert 'resumed="True"' in second and 'step="2"' in second
    root = Path(cfg.run_dir) / "trainer"
    steps = read_steps_log(root)
    assert [s["used"] for s in steps] == [[f"d{g}/{i}" for i in range(4)] for g in range(3)]
    assert [r["version"] for n, r in read_topic(cfg, "control") if n == "WeightUpdate"] == [1, 2, 3]
