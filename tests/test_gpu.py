"""The GPU tier (``-m gpu``; scripts/gpu-check.sh runs it on a CUDA machine): HF engine generation
on CUDA with exact behaviour logprobs, a torch-engine bf16 step (float32 masters) tracking float32,
DeepSpeed ZeRO-2 on one GPU matching the torch engine, the LoRA path (train adapters, apply them
in the hf engine on the GPU), and a small end-to-end run through a real broker. Each prints a
``[gpu]`` line with its throughput (tokens/s or steps/s). Without CUDA every test skips with the
reason."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from consumers.trainer.engines import TrainContext, build_engine  # noqa: E402
from consumers.trainer.losses import LossFn  # noqa: E402
from consumers.trainer.step import train_samples  # noqa: E402
from pipeline.models import TinyModelConfig, load_model, load_tokenizer, materialize  # noqa: E402
from rlstream.config import load_config  # noqa: E402
from tests.test_deepspeed import TINY, assert_close, make_samples  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no CUDA device: the gpu tier runs on a GPU machine (scripts/gpu-check.sh)",
    ),
]
BIGGER = [
    "model.type=tiny",
    "model.hidden_size=512",
    "model.num_heads=8",
    "model.num_layers=4",
    "model.intermediate_size=1408",
]


def say(line: str) -> None:
    print(f"[gpu] {line}", flush=True)


def cfg_of(*sets):
    return load_config(None, list(sets), environ={})


def test_hf_engine_generates_on_cuda_with_exact_logprobs():
    from libs.engines import EngineContext
    from libs.engines.base import GenRequest
    from libs.engines.hf import HFEngine
    from producers.config import HFEngineConfig

    d = materialize(TinyModelConfig())
    tok = load_tokenizer(d)
    eng = HFEngine(HFEngineConfig(device="cuda"), EngineContext(d, tok, "gpu"))
    assert eng.device.type == "cuda"
    reqs = [GenRequest(f"r{i}", tok.encode(f"prompt {i}:"), 128, 1.0, frozenset()) for i in range(32)]
    eng.generate(reqs[:2])  # warm-up (CUDA context, kernels)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = eng.generate([GenRequest(f"b{r.rid}", r.context, r.max_new_tokens, 1.0, frozenset()) for r in reqs])
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n = sum(len(o.tokens) for o in outs)
    say(f"hf engine generation (tiny model, 32 x 128 tokens): {n / dt:,.0f} tokens/s")
    model = load_model(d, device="cuda")
    o = outs[0]
    ids = torch.tensor([reqs[0].context + o.tokens], device="cuda")
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)[len(reqs[0].context) - 1 : -1]
    ref = lp.gather(1, torch.tensor(o.tokens, device="cuda")[:, None]).squeeze(1).cpu()
    torch.testing.assert_close(ref, torch.tensor(o.logprobs), atol=2e-3, rtol=1e-3)


def _steps_per_s(eng, cfg, n: int = 10) -> float:
    train_samples(eng, make_samples(16), cfg.trainer, LossFn(cfg.trainer.loss), 0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        train_samples(eng, make_samples(16), cfg.trainer, LossFn(cfg.trainer.loss), i + 1)
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def test_torch_engine_bf16_step_keeps_float32_masters():
    curves = {}
    for dtype in ("float32", "bfloat16"):
        cfg = cfg_of(*BIGGER, "trainer.lr=0.001", "trainer.micro_batch_size=8", "trainer.engine.device=cuda",
                     f"trainer.engine.dtype={dtype}")  # fmt: skip
        eng = build_engine(cfg.trainer.engine, TrainContext(materialize(cfg.model), cfg.trainer))
        curves[dtype] = [
            train_samples(eng, make_samples(16), cfg.trainer, LossFn(cfg.trainer.loss), i)["loss"] for i in range(8)
        ]
        say(f"torch engine {dtype} (hidden 512, 4 layers, 16 samples/step): {_steps_per_s(eng, cfg):.1f} steps/s")
    assert {p.dtype for p in eng.module.parameters()} == {torch.float32}
    span = max(curves["float32"]) - min(curves["float32"])
    assert max(abs(a - b) for a, b in zip(curves["bfloat16"], curves["float32"], strict=True)) <= 0.1 * span + 1e-3


@pytest.mark.deepspeed
def test_deepspeed_zero2_on_one_gpu_matches_the_torch_engine():
    pytest.importorskip("deepspeed")
    sets = [*TINY, "trainer.lr=0.01", "trainer.micro_batch_size=2"]
    cfg_t = cfg_of(*sets, "trainer.engine.device=cuda")
    cfg_d = cfg_of(*sets, "trainer.engine.type=deepspeed", "trainer.engine.zero_stage=2")
    d = materialize(cfg_t.model)
    t = build_engine(cfg_t.trainer.engine, TrainContext(d, cfg_t.trainer))
    z = build_engine(cfg_d.trainer.engine, TrainContext(d, cfg_d.trainer))
    assert str(z.device).startswith("cuda")
    for eng, cfg in ((t, cfg_t), (z, cfg_d)):
        train_samples(eng, make_samples(5), cfg.trainer, LossFn(cfg.trainer.loss), 1)
    assert_close(t.state_dict(), z.state_dict(), atol=1e-5, rtol=1e-3)
    say(f"deepspeed ZeRO-2, one GPU (tiny model, 16 samples/step): {_steps_per_s(z, cfg_d):.1f} steps/s")


def test_lora_trains_on_cuda_and_the_hf_engine_applies_the_adapter(tmp_path):
    pytest.importorskip("peft")
    from consumers.trainer.publish import write_version
    from libs.engines import EngineContext
    from libs.engines.hf import HFEngine
    from pipeline.checkpoint import model_fingerprint
    from producers.config import HFEngineConfig

    cfg = cfg_of(*BIGGER, "trainer.lr=0.01", "trainer.micro_batch_size=8", "trainer.engine.device=cuda",
                 "trainer.engine.dtype=bfloat16", "trainer.lora.rank=16")  # fmt: skip
    d = materialize(cfg.model)
    eng = build_engine(cfg.trainer.engine, TrainContext(d, cfg.trainer))
    say(f"torch engine LoRA r=16 bf16 (hidden 512, 4 layers): {_steps_per_s(eng, cfg):.1f} steps/s")
    t0 = time.perf_counter()
    upd = write_version(eng, eng.state_dict(), str(tmp_path), 1, 1, cfg.trainer, 0, model_fingerprint(d))
    hf = HFEngine(HFEngineConfig(device="cuda"), EngineContext(d, load_tokenizer(d), "gpu"))
    t1 = time.perf_counter()
    hf.load_weights(upd, hf.prepare_weights(upd))
    torch.cuda.synchronize()
    say(
        f"adapter {upd['bytes']:,} bytes: write {1e3 * (t1 - t0):.0f} ms (incl. fingerprint), load {1e3 * (time.perf_counter() - t1):.0f} ms"
    )
    ids = torch.tensor([[5, 6, 7, 8, 9]], device="cuda")
    with torch.no_grad():
        want = eng.module(input_ids=ids).logits.float()
        got = hf.model(input_ids=ids).logits.float()
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)


@pytest.mark.kafka
@pytest.mark.slow
def test_small_end_to_end_run_on_cuda(make_config, topic_prefix, tmp_path):
    from consumers.trainer.state import read_steps_log
    from tests import rl_pipeline

    steps = 40
    task = rl_pipeline.write_task(tmp_path / "task.jsonl")
    cfg = make_config(
        *rl_pipeline.settings(task, topic_prefix, steps), "rollout.engine.device=cuda", "trainer.engine.device=cuda",
        "trainer.engine.dtype=bfloat16", "trainer.lr=0.003",
    )  # fmt: skip
    out = rl_pipeline.run(cfg, steps, rollout_workers=1)
    log = read_steps_log(Path(cfg.run_dir) / "trainer")
    curve = [e["reward_mean"] for e in log]
    say(f"end to end on CUDA (next digit, k=1): {steps / out['seconds']:.2f} steps/s; reward "
        f"{sum(curve[:10]) / 10:.2f} -> {sum(curve[-10:]) / 10:.2f}")  # fmt: skip
    assert sum(curve[-10:]) / 10 > sum(curve[:10]) / 10
