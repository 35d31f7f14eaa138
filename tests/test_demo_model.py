"""The demo's model has one shape everywhere it is shipped, and one that vLLM's CPU kernels take.

``rlstream.demo.DEMO_MODEL`` owns it; the example job, the compose job and the Helm values state it
again as TOML (they cannot import it), so they are read here and compared."""

from __future__ import annotations

import json
import tomllib

import pytest
import yaml

from libs.engines.vllm import CPU_HEAD_SIZES, check_cpu_head_size, head_size
from pipeline.errors import ConfigError
from pipeline.models import TinyModelConfig, materialize
from rlstream.demo import DEMO_MODEL, demo_settings
from tests.infra_tools import REPO

HELM = REPO / "infra/helm/rlstream"
SHIPPED = {
    "examples/next-digit.toml": lambda: tomllib.loads((REPO / "examples/next-digit.toml").read_text()),
    "infra/compose/job.toml": lambda: tomllib.loads((REPO / "infra/compose/job.toml").read_text()),
    "values.yaml": lambda: tomllib.loads(yaml.safe_load((HELM / "values.yaml").read_text())["config"]),
    "values-strimzi.yaml": lambda: tomllib.loads(yaml.safe_load((HELM / "values-strimzi.yaml").read_text())["config"]),
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_every_shipped_demo_job_states_the_demo_model(name):
    model = SHIPPED[name]()["model"]
    assert model.pop("type", "tiny") == "tiny"
    assert model == DEMO_MODEL, f"{name}: [model] differs from rlstream.demo.DEMO_MODEL"


def test_the_demo_sets_its_model_and_vllm_cpu_takes_its_head_size(tmp_path):
    sets = {k.removeprefix("model."): v for k, v in demo_settings(tmp_path, "x").items() if k.startswith("model.")}
    assert sets == DEMO_MODEL
    cfg = TinyModelConfig(**DEMO_MODEL)
    assert cfg.hidden_size // cfg.num_heads in CPU_HEAD_SIZES
    d = materialize(cfg, tmp_path / "models")  # the saved HF config says so too (what vLLM reads)
    assert head_size(d) == 32
    check_cpu_head_size(d)


def test_vllm_on_a_cpu_refuses_an_unsupported_head_size_at_once(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    with pytest.raises(ConfigError, match=r"head size is 16 .*model\.num_heads"):
        check_cpu_head_size(d)
