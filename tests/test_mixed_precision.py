"""Mixed precision: the torch engine's bf16 mode computes under bf16 autocast with float32 master
weights and float32 AdamW state, and its loss curve tracks the float32 run on the tiny model; the
DeepSpeed engine's bf16 mode (bf16 module, float32 ZeRO master partitions) does the same."""

import pytest

torch = pytest.importorskip("torch")

from consumers.trainer.engines import TrainContext, build_engine  # noqa: E402
from consumers.trainer.losses import LossFn  # noqa: E402
from consumers.trainer.step import train_samples  # noqa: E402
from pipeline.models import materialize  # noqa: E402
from rlstream.config import load_config  # noqa: E402
from tests.test_deepspeed import TINY, make_samples  # noqa: E402

STEPS = 10


def curve(engine_type: str, dtype: str):
    cfg = load_config(
        None,
        [*TINY, "trainer.lr=0.01", "trainer.micro_batch_size=4", f"trainer.engine.type={engine_type}",
         f"trainer.engine.dtype={dtype}"],
        environ={},
    )  # fmt: skip
    eng = build_engine(cfg.trainer.engine, TrainContext(materialize(cfg.model), cfg.trainer))
    losses = [
        train_samples(eng, make_samples(8), cfg.trainer, LossFn(cfg.trainer.loss), i)["loss"] for i in range(STEPS)
    ]
    return eng, losses


def assert_tracks(bf16, fp32):
    span = max(fp32) - min(fp32)
    assert span > 0.1  # the curve moves: the comparison means something
    assert bf16[0] == pytest.approx(fp32[0], abs=0.01 * span)  # same start
    assert max(abs(a - b) for a, b in zip(bf16, fp32, strict=True)) <= 0.05 * span
    assert bf16[-1] < bf16[0] - 0.5 * span  # and it learns as the float32 run does


def test_torch_bf16_keeps_float32_masters_and_tracks_the_float32_loss_curve():
    eng32, fp32 = curve("torch", "float32")
    eng16, bf16 = curve("torch", "bfloat16")
    assert eng16.autocast is torch.bfloat16 and eng32.autocast is None
    assert {p.dtype for p in eng16.module.parameters()} == {torch.float32}  # master weights
    state = [v for st in eng16.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    assert state and {v.dtype for v in state} == {torch.float32}  # AdamW moments: no bf16 optimizer state
    assert {v.dtype for v in eng16.state_dict().values()} == {torch.float32}  # published weights
    assert_tracks(bf16, fp32)
    # bf16 compute is really used: the losses are close but not bit-identical
    assert any(a != b for a, b in zip(bf16, fp32, strict=True))


@pytest.mark.deepspeed
def test_deepspeed_bf16_tracks_the_float32_loss_curve():
    pytest.importorskip("deepspeed")
    _, fp32 = curve("deepspeed", "float32")
    eng16, bf16 = curve("deepspeed", "bfloat16")
    assert {p.dtype for p in eng16.module.parameters()} == {torch.bfloat16}  # bf16 compute copy
    masters = eng16.optimizer.single_partition_of_fp32_groups  # ZeRO-2's float32 master partitions
    assert masters and {m.dtype for m in masters} == {torch.float32}
    assert {v.dtype for v in eng16.state_dict().values()} == {torch.float32}
    assert_tracks(bf16, fp32)


def test_auto_dtype_is_bf16_only_where_the_device_computes_it_natively():
    """``dtype = "auto"`` (trainer torch engine, hf rollout engine): bf16 on a CPU with AVX512-BF16
    or AMX, float32 on an AVX2-only CPU, where emulated bf16 made a real-model step take 221 s."""
    import torch

    from consumers.trainer.config import TorchEngineConfig
    from libs.engines.config import HFEngineConfig
    from pipeline.models import resolve_dtype

    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert resolve_dtype("auto", "cpu") == ("bfloat16" if native else "float32")
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16" and resolve_dtype("float32", "cpu") == "float32"
    assert TorchEngineConfig(dtype="auto").dtype == HFEngineConfig(dtype="auto").dtype == "auto"
