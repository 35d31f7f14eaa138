"""LoRA without a broker: the trainer trains only the adapters and publishes the adapter alone
(PEFT layout, config inside the verified file); the hf engine applies it through PEFT and then
computes exactly the trainer's logits; the in-place merge (vLLM's path) gives the same model; an
adapter for another base, or an engine without adapter support, is refused with a typed error;
WeightUpdate v1 notices still read (as full weights)."""

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from consumers.trainer.engines import TrainContext, build_engine  # noqa: E402
from consumers.trainer.losses import LossFn  # noqa: E402
from consumers.trainer.publish import write_version  # noqa: E402
from consumers.trainer.step import train_samples  # noqa: E402
from libs.engines import EngineContext  # noqa: E402
from libs.engines.adapters import BaseModelMismatch, BaseWeights, merged_weights, prepare_adapter  # noqa: E402
from pipeline.checkpoint import ChecksumError, model_fingerprint, read_adapter  # noqa: E402
from pipeline.models import TinyModelConfig, load_model, load_tokenizer, materialize  # noqa: E402
from rlstream.config import load_config  # noqa: E402
from tests.test_deepspeed import TINY, assert_close, make_samples  # noqa: E402

LORA = ["trainer.lora.rank=4", "trainer.lora.alpha=8", 'trainer.lora.target_modules=["q_proj", "v_proj", "down_proj"]']
IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])


def trained(tmp_path, *extra, steps=3):
    cfg = load_config(None, [*TINY, "trainer.lr=0.05", "trainer.micro_batch_size=2", *LORA, *extra], environ={})
    d = materialize(cfg.model)
    eng = build_engine(cfg.trainer.engine, TrainContext(d, cfg.trainer))
    for i in range(steps):
        train_samples(eng, make_samples(5), cfg.trainer, LossFn(cfg.trainer.loss), i)
    upd = write_version(eng, eng.state_dict(), str(tmp_path / "store"), 1, steps, cfg.trainer, 9, model_fingerprint(d))
    return cfg, d, eng, upd


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_only_adapters_train_and_the_adapter_alone_is_published(tmp_path):
    _, d, eng, upd = trained(tmp_path)
    base = load_model(d)
    assert eng.weights_kind == "adapter"
    assert all("lora_" in n for n, p in eng.module.named_parameters() if p.requires_grad)
    # the frozen base did not move
    frozen = {
        n.replace("base_model.model.", "").replace(".base_layer", ""): p for n, p in eng.module.named_parameters()
    }
    for n, p in base.named_parameters():
        assert torch.equal(frozen[n], p), n
    # the notice: kind, shape, base; the file: the adapter only, PEFT names, config in its header
    assert upd["kind"] == "adapter" and upd["adapter_rank"] == 4 and upd["adapter_alpha"] == 8.0
    assert upd["adapter_target_modules"] == ["down_proj", "q_proj", "v_proj"]
    assert upd["base_sha256"] == model_fingerprint(d) and upd["consumed_groups"] == 9
    state, conf = read_adapter(upd["uri"], upd["sha256"])
    assert sorted(state) == sorted(eng.state_dict()) and all(".lora_" in k for k in state)
    assert upd["bytes"] == Path(upd["uri"]).stat().st_size < 0.1 * (d / "model.safetensors").stat().st_size
    on_disk = json.loads((Path(upd["uri"]).parent / "adapter_config.json").read_text())
    assert on_disk == conf and conf["r"] == 4 and conf["peft_type"] == "LORA"
    bad = tmp_path / "bad.safetensors"
    raw = bytearray(Path(upd["uri"]).read_bytes())
    raw[-1] ^= 1
    bad.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError):
        read_adapter(str(bad), upd["sha256"])


def test_engine_checkpoint_holds_adapters_and_optimizer_and_resumes_exactly(tmp_path):
    cfg, d, a, _ = trained(tmp_path)
    a.save(tmp_path / "ck")
    saved = torch.load(tmp_path / "ck" / "engine.pt", weights_only=True)
    assert all("lora_" in k for k in saved["model"])  # not the frozen base
    b = build_engine(cfg.trainer.engine, TrainContext(d, cfg.trainer))
    b.load(tmp_path / "ck")
    for eng in (a, b):
        train_samples(eng, make_samples(5), cfg.trainer, LossFn(cfg.trainer.loss), 7)
    assert_close(a.state_dict(), b.state_dict(), atol=0, rtol=0)


def test_hf_engine_applies_the_adapter_through_peft_and_the_merge_agrees(tmp_path):
    from libs.engines.base import GenRequest
    from libs.engines.hf import HFEngine
    from producers.config import HFEngineConfig

    _, d, eng, upd = trained(tmp_path)
    tok = load_tokenizer(d)
    hf = HFEngine(HFEngineConfig(), EngineContext(d, tok, "w"))
    before = logits(hf.model)
    hf.load_weights(upd, hf.prepare_weights(upd))
    assert hf.version == 1
    want = logits(eng.module)
    torch.testing.assert_close(logits(hf.model), want, rtol=1e-5, atol=1e-5)
    assert (want - before).abs().max() > 1e-3  # the adapter changed the model
    out = hf.generate([GenRequest("x", [5, 6], 6, 1.0, frozenset())])[0]
    assert len(out.tokens) == 6 and all(lp <= 0 for lp in out.logprobs)
    # a second version goes into the same injected layers
    upd2 = dict(upd, version=2)
    hf.load_weights(upd2, hf.prepare_weights(upd2))
    assert hf.version == 2
    # the in-place merge the vllm engine uses: W0 + (alpha / r) B A into a plain model
    plain = load_model(d).eval()
    plain.load_state_dict(merged_weights(prepare_adapter(upd, d), BaseWeights(d)), strict=False)
    torch.testing.assert_close(logits(plain), want, rtol=1e-4, atol=1e-5)
    # full weights after adapters: back to a plain model
    base_state = load_model(d).state_dict()
    hf.load_weights({"version": 3, "uri": "x", "kind": "full"}, base_state)
    torch.testing.assert_close(logits(hf.model), before)


def test_adapters_for_another_base_or_an_engine_without_them_are_refused(tmp_path):
    from libs.engines.sim import SimEngine
    from pipeline.errors import RlstreamError
    from producers.config import SimEngineConfig
    from producers.weights import WeightFormatError, check_loadable

    _, d, _, upd = trained(tmp_path, steps=1)
    other = materialize(TinyModelConfig(hidden_size=32, num_heads=2, num_layers=1, intermediate_size=64, seed=1))
    with pytest.raises(BaseModelMismatch, match="another model"):
        prepare_adapter(upd, other)
    with pytest.raises(RlstreamError, match="notice"):
        prepare_adapter(dict(upd, adapter_rank=8), d)
    sim = SimEngine(SimEngineConfig(), EngineContext(d, load_tokenizer(d), "w"))
    with pytest.raises(WeightFormatError, match="adapter"):
        check_loadable(upd, sim)
    check_loadable({"version": 1, "format": "safetensors"}, sim)  # a v1 notice: full weights
    with pytest.raises(WeightFormatError, match="format"):
        check_loadable({"version": 1, "format": "gguf"}, sim)


def test_weight_update_v1_reads_as_full_weights():
    import io

    import fastavro

    import schemas
    from pipeline import codec

    v1 = next(i for i in schemas.all_schemas() if i.label == "WeightUpdate.v1")
    rec = {"version": 3, "uri": "/w/v3/model.safetensors", "sha256": "ab", "bytes": 10, "step": 3, "created_at_ms": 1}
    buf = io.BytesIO()
    buf.write(codec.MAGIC + v1.fingerprint)
    fastavro.schemaless_writer(buf, v1.parsed, {**rec, "format": "safetensors", "trainer_id": "", "metadata": {}})
    name, back = codec.decode(buf.getvalue())
    assert name == "WeightUpdate" and back["version"] == 3
    assert back["kind"] == "full" and back["consumed_groups"] == -1 and back["adapter_target_modules"] == []
    assert schemas.latest("WeightUpdate").version == 2
    new = codec.decode(codec.encode("WeightUpdate", {**rec, "kind": "adapter", "adapter_rank": 8}))[1]
    assert new["kind"] == "adapter" and new["adapter_rank"] == 8


@pytest.mark.deepspeed
def test_deepspeed_lora_matches_the_torch_engine(tmp_path):
    pytest.importorskip("deepspeed")
    _, d, eng_t, _ = trained(tmp_path / "t", steps=2)
    cfg_d, _, eng_d, upd = trained(tmp_path / "d", "trainer.engine.type=deepspeed", steps=2)
    assert eng_d.weights_kind == "adapter" and upd["kind"] == "adapter"
    assert_close(eng_t.state_dict(), eng_d.state_dict(), atol=1e-5, rtol=1e-4)
    eng_d.save(tmp_path / "ck" / "tag")
    other = build_engine(cfg_d.trainer.engine, TrainContext(d, cfg_d.trainer))
    other.load(tmp_path / "ck" / "tag")
    assert_close(eng_d.state_dict(), other.state_dict(), atol=0, rtol=0)
