"""`rlstream export`: a published version as a Hugging Face directory that from_pretrained loads
and that reproduces the rollout engine's logprobs under those weights; a sharded version exports
(sharded again above ``trainer.shard_bytes``) with the same logits."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_cli
from tests.test_engine_hf import reqs, teacher_forced_logprobs

pytestmark = pytest.mark.kafka


def test_exported_directory_loads_and_reproduces_the_engines_logprobs(make_config, cli_env, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from libs.engines import EngineContext, build_engine
    from pipeline.models import load_model, load_tokenizer, materialize
    from producers.config import HFEngineConfig
    from tests.rollout_helpers import publish_version

    cfg = make_config()
    base = load_model(materialize(cfg.model)).state_dict()
    trained = {k: v + 0.02 * torch.randn_like(v) for k, v in base.items()}  # "version 3": different weights
    update = publish_version(cfg, 3, trained)
    out = tmp_path / "hf"
    printed = json.loads(run_cli(["export", str(out)], cli_env, timeout=180).stdout.strip().splitlines()[-1])
    assert printed["version"] == 3 and printed["sha256"] == update["sha256"]

    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tok = AutoTokenizer.from_pretrained(str(out))
    d = materialize(cfg.model)
    assert tok("Copy: apple\n").input_ids == load_tokenizer(d)("Copy: apple\n").input_ids
    eng = build_engine(HFEngineConfig(device="cpu"), EngineContext(d, load_tokenizer(d), "w"))
    eng.load_weights(update, eng.prepare_weights(update))
    for req, got in zip(rs := reqs(tok, 3, base=8), eng.generate(rs), strict=True):
        want = teacher_forced_logprobs(model, req.context, got.tokens)
        assert torch.allclose(torch.tensor(got.logprobs), want, atol=1e-4), (got.logprobs, want)
    bad = run_cli(["export", str(tmp_path / "x"), "--version", "7"], cli_env, check=False)
    lines = [line for line in (bad.stdout + bad.stderr).splitlines() if line.strip()]
    assert bad.returncode == 2 and lines == [
        "error: UnknownVersion: version 7 does not exist: the versions there are 3 (newest 3); 0 is the base model "
        "(model.path)"
    ], lines


def test_a_sharded_version_exports_sharded_and_loads(make_config, cli_env, tmp_path):
    from transformers import AutoModelForCausalLM

    from pipeline.checkpoint import INDEX_FILE, write_weights
    from pipeline.control import now_ms, publish_weight_update
    from pipeline.kafka import Producer, client_conf
    from pipeline.models import load_model, materialize

    cfg = make_config()
    ref = load_model(materialize(cfg.model)).eval()
    trained = {k: v + 0.02 * torch.randn_like(v) for k, v in ref.state_dict().items()}
    ref.load_state_dict(trained)
    uri, sha, nbytes = write_weights(cfg.store, 4, trained, shard_bytes=200_000)
    assert uri.endswith(INDEX_FILE)
    update = {"version": 4, "uri": uri, "sha256": sha, "bytes": nbytes, "step": 4, "created_at_ms": now_ms(),
              "trainer_id": "test", "format": "safetensors-sharded"}  # fmt: skip
    with Producer(client_conf(cfg, "test", kind="producer")) as p:
        publish_weight_update(p, cfg.topics.name("control"), update)
    out = tmp_path / "hf"
    run_cli(["export", str(out), "--set", "trainer.shard_bytes=300000"], cli_env, timeout=180)
    assert (out / INDEX_FILE).is_file() and len(list(out.glob("model-*-of-*.safetensors"))) >= 3
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
