"""The openai engine's reload modes against real servers.

* ``reload = "vllm"`` against a stock vLLM OpenAI server (``python -m
  vllm.entrypoints.openai.api_server`` with ``VLLM_SERVER_DEV_MODE=1``, the tiny model, CPU):
  a full update from ``metadata.hf_dir`` changes logprobs to those of transformers on that
  directory, the engine's version moves only after the server confirmed the load, an interrupted
  request does not block the reload, a reload back to the base re-reads the disk, a restarted
  worker skips what the server already holds, a server that lost its version stops requests, bad
  notices fail before the server is touched, and a LoRA adapter goes in through
  ``/v1/load_lora_adapter``. Marked ``vllm`` and ``slow``; skipped when no interpreter with vLLM is
  found: this one, then ``$RLSTREAM_CACHE/vllm-venv/bin/python`` (docs/how-to/engines.md shows how to
  make that venv without touching .venv).
* ``reload = "rlstream"`` (and its old name ``post``) and the ``vllm`` mode's refusal of a server
  without vLLM's development endpoints, against rlstream's own ``producers.openai_server``.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from libs.engines import EngineContext
from libs.engines.base import GenRequest
from libs.engines.openai import EngineHTTPError, OpenAIEngine
from libs.engines.vllm_server import NoHFDirectory, ServerVersionMismatch, version_tag
from pipeline.checkpoint import ChecksumError, version_dir, weights_format, write_hf_files, write_weights
from pipeline.errors import RlstreamError
from pipeline.models import TinyModelConfig, load_model, load_tokenizer, materialize
from pipeline.records import HF_DIR_KEY
from producers.config import OpenAIEngineConfig
from tests.test_engine_hf import reqs, teacher_forced_logprobs

CACHE = Path(os.environ.get("RLSTREAM_CACHE", Path.home() / ".cache" / "rlstream"))
SERVER_START_S = 420


def find_vllm_python() -> str | None:
    """An interpreter that can import vllm: this one, or the separate venv of docs/how-to/engines.md."""
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    py = CACHE / "vllm-venv" / "bin" / "python"
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    if py.is_file() and subprocess.run([str(py), "-c", probe], capture_output=True, timeout=120).returncode == 0:
        return str(py)
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(port: int, method: str, path: str, body: dict | None = None) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, json.dumps(body) if body is not None else None, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        assert resp.status == 200, (method, path, resp.status, data[:300])
        return json.loads(data)
    finally:
        conn.close()


def greedy(tok, n=4):
    return reqs(tok, n, base=12, temperature=0.0)


def assert_logprobs_of(model, rs, outs):
    for r, o in zip(rs, outs, strict=True):
        assert len(o.tokens) == len(o.logprobs) >= 1
        ref = teacher_forced_logprobs(model, r.context, o.tokens)
        assert torch.allclose(ref, torch.tensor(o.logprobs), atol=1e-4), (ref, o.logprobs)


def full_update(store: str, version: int, state: dict, base: Path, shard_bytes: int | None = None) -> dict:
    """A WeightUpdate as the trainer publishes it with ``trainer.publish_hf``: the version directory
    holds the weights (one file, or shards and their index) and the base's config and tokenizer,
    and ``metadata.hf_dir`` names it (``store`` may be a path or a file:// URI)."""
    uri, sha, size = write_weights(store, version, state, shard_bytes)
    vdir = version_dir(store, version)
    write_hf_files(base, vdir)
    return {"version": version, "uri": uri, "sha256": sha, "bytes": size, "kind": "full",
            "format": weights_format(uri), "metadata": {HF_DIR_KEY: vdir}}  # fmt: skip


# -- a stock vLLM server ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    py = find_vllm_python()
    if py is None:
        pytest.skip(
            f"vllm is not importable here nor in {CACHE / 'vllm-venv'} (scripts/setup-vllm-cpu.sh; docs/how-to/engines.md)"
        )
    base = materialize(TinyModelConfig())
    work = tmp_path_factory.mktemp("vllm-reload")
    port = _free_port()
    (work / "tmp").mkdir()
    env = {
        **os.environ,
        "TMPDIR": str(work / "tmp"),  # its ZMQ IPC sockets, not loose in /tmp
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(base), "--served-model-name", "tiny",
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "256",
           "--enforce-eager", "--logprobs-mode", "processed_logprobs", "--enable-lora", "--max-lora-rank", "8"]  # fmt: skip
    log_path = work / "server.log"
    t0 = time.monotonic()
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM server exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
            try:
                _http(port, "GET", "/v1/models")
                break
            except (OSError, AssertionError):
                if time.monotonic() - t0 > SERVER_START_S:
                    pytest.fail(f"vLLM server not up after {SERVER_START_S} s:\n{log_path.read_text()[-3000:]}")
                time.sleep(1)
        print(f"[vllm server] {py} up in {time.monotonic() - t0:.1f} s on port {port}")
        yield {"port": port, "base": base, "work": work, "proc": proc, "log": log_path}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the server's own process group (it started it)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def _engine(srv, **kw) -> OpenAIEngine:
    cfg = OpenAIEngineConfig(base_url=f"http://127.0.0.1:{srv['port']}/v1", reload="vllm", timeout_s=120, **kw)
    return OpenAIEngine(cfg, EngineContext(srv["base"], load_tokenizer(srv["base"])))


def _recording(eng: OpenAIEngine) -> list:
    """Record every control call of the reload mode with the engine's version at that moment."""
    calls, inner = [], eng.reloader._call

    def call(method, path, body=None, timeout=None):
        calls.append((path, eng.version))
        return inner(method, path, body, timeout)

    eng.reloader._call = call
    return calls


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_full_reload_handshake(vllm_server):
    srv, tmp = vllm_server, vllm_server["work"]
    base = srv["base"]
    tok = load_tokenizer(base)
    model = load_model(base)  # version 1: the base, perturbed
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    store = str(tmp / "store")

    eng = _engine(srv)
    assert eng.version == 0 and eng.model == "tiny"
    if eng.reloader.server_version == "default":  # a fresh server: the base model, version 0
        rs = greedy(tok)
        before = eng.generate(rs)
        assert_logprobs_of(load_model(base), rs, before)
    upd1 = full_update(store, 1, model.state_dict(), base, shard_bytes=256 * 1024)  # sharded, as big models are
    assert upd1["format"] == "safetensors-sharded"
    v1_dir = Path(upd1["metadata"][HF_DIR_KEY])
    calls = _recording(eng)
    t0 = time.monotonic()
    eng.load_weights(upd1, eng.prepare_weights(upd1))
    load_s = time.monotonic() - t0
    paths = [p for i, (p, _) in enumerate(calls) if i == 0 or calls[i - 1][0] != p]  # cache resets may repeat
    assert paths[-5:] == ["/weight_info", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version",
                          "/weight_info"], paths  # fmt: skip
    assert all(v == 0 for _, v in calls), calls  # the version moved only after the server's confirmation
    assert eng.version == 1 and _http(srv["port"], "GET", "/weight_info")["weight_version"] == version_tag(upd1)
    rs = greedy(tok)
    after = eng.generate(rs)
    assert_logprobs_of(load_model(v1_dir), rs, after)  # the server holds the new directory's weights
    base_model = load_model(base)
    assert any(
        not torch.allclose(
            teacher_forced_logprobs(base_model, r.context, o.tokens), torch.tensor(o.logprobs), atol=1e-3
        )
        for r, o in zip(rs, after, strict=True)
    )
    print(f"[vllm reload] v1 loaded in {load_s * 1e3:.0f} ms")

    # interrupt: a request aborted mid-stream, then at once back to the base weights (file:// URI)
    eng.submit(GenRequest("long", tok.encode("abc"), 240, 1.0, frozenset()))
    deadline = time.monotonic() + 60
    while len(eng.calls["long"][0].tokens) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    (part,) = eng.abort()
    assert part.finish_reason == "abort" and 3 <= len(part.tokens) < 240
    with pytest.raises(RuntimeError, match="in flight"):
        eng.submit(GenRequest("busy", tok.encode("x"), 50, 1.0, frozenset()))
        eng.load_weights(upd1, None)
    eng.abort()
    upd2 = full_update((tmp / "store").as_uri(), 2, base_model.state_dict(), base)  # a file:// store
    eng.load_weights(upd2, eng.prepare_weights(upd2))
    rs = greedy(tok)
    assert eng.version == 2
    assert_logprobs_of(base_model, rs, eng.generate(rs))  # the disk is read again, not a cached copy

    # a worker restarted beside a server that kept v2: no reload, same handshake
    eng2 = _engine(srv)
    calls2 = _recording(eng2)
    eng2.load_weights(upd2, eng2.prepare_weights(upd2))
    assert eng2.version == 2 and "/collective_rpc" not in [p for p, _ in calls2]
    assert_logprobs_of(base_model, rs, eng2.generate(rs))

    # bad notices fail on the worker, before the server is touched (a failed reload kills vLLM 0.32)
    no_dir = {**upd2, "version": 3, "metadata": {}}
    with pytest.raises(NoHFDirectory, match="publish_hf"):
        eng.prepare_weights(no_dir)
    with pytest.raises(RlstreamError, match="not an HF model directory"):
        eng.prepare_weights({**upd2, "version": 3, "metadata": {"hf_dir": str(tmp / "nowhere")}})
    with pytest.raises(RlstreamError, match="file:// URI"):
        eng.prepare_weights({**upd2, "version": 3, "metadata": {"hf_dir": "s3://bucket/v3"}})
    with pytest.raises(ChecksumError):
        eng.prepare_weights({**upd2, "version": 3, "sha256": "0" * 64})
    assert eng.version == 2 and srv["proc"].poll() is None
    eng.close()
    eng2.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_server_that_lost_its_version_stops_requests(vllm_server):
    srv, tmp = vllm_server, vllm_server["work"]
    tok = load_tokenizer(srv["base"])
    eng = _engine(srv, version_check_s=0.2)
    upd = full_update(str(tmp / "lost"), 5, load_model(srv["base"]).state_dict(), srv["base"])
    eng.load_weights(upd, eng.prepare_weights(upd))
    eng.generate(greedy(tok, 1))
    # what a server restarted underneath answers (its --model weights); restarting vLLM for real
    # costs a minute here, its answer is the same
    _http(srv["port"], "POST", "/update_weight_version", {"new_version": "default"})
    time.sleep(0.3)
    with pytest.raises(ServerVersionMismatch, match="'default'"):
        eng.generate(greedy(tok, 1))
    eng.abort()
    _http(srv["port"], "POST", "/update_weight_version", {"new_version": version_tag(upd)})
    eng.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_lora_adapter_through_load_lora_adapter(vllm_server):
    pytest.importorskip("peft")
    from consumers.trainer.engines import TrainContext
    from consumers.trainer.engines import build_engine as build_trainer
    from consumers.trainer.losses import LossFn
    from consumers.trainer.publish import write_version
    from consumers.trainer.step import train_samples
    from libs.engines.hf import HFEngine
    from pipeline.checkpoint import model_fingerprint
    from producers.config import HFEngineConfig
    from rlstream.config import load_config
    from tests.test_deepspeed import make_samples

    srv, tmp = vllm_server, vllm_server["work"]
    cfg = load_config(
        None, ["model.type=tiny", "trainer.lr=0.2", "trainer.micro_batch_size=4", "trainer.lora.rank=4"], environ={}
    )
    d = materialize(cfg.model)
    assert d == srv["base"], "the adapter must be trained on the server's base model"
    trainer = build_trainer(cfg.trainer.engine, TrainContext(d, cfg.trainer))
    for i in range(3):
        train_samples(trainer, make_samples(5), cfg.trainer, LossFn(cfg.trainer.loss), i)
    upd = write_version(trainer, trainer.state_dict(), str(tmp / "lora"), 7, 3, cfg.trainer, 3, model_fingerprint(d))
    assert upd["kind"] == "adapter"

    tok = load_tokenizer(d)
    eng = _engine(srv)
    eng.load_weights(upd, eng.prepare_weights(upd))
    assert eng.version == 7 and eng.reloader.model_override == "rlstream-lora"
    local = HFEngine(HFEngineConfig(), EngineContext(d, tok, "w"))
    local.load_weights(upd, local.prepare_weights(upd))
    rs = greedy(tok, 3)
    outs = eng.generate(rs)
    assert_logprobs_of(local.model, rs, outs)  # the server applies the same adapter
    # a full update afterwards goes back to the base model's name
    back = full_update(str(tmp / "lora"), 8, load_model(d).state_dict(), d)
    eng.load_weights(back, eng.prepare_weights(back))
    assert eng.reloader.model_override is None
    assert_logprobs_of(load_model(d), rs, eng.generate(rs))
    eng.close()
    local.close()


# -- rlstream's own server ---------------------------------------------------------------------------
def test_rlstream_mode_and_vllm_mode_refuse_a_server_without_dev_endpoints(tmp_path):
    from producers.openai_server import CompletionServer

    assert OpenAIEngineConfig(reload="post").reload == "rlstream"  # the old name still works
    d = materialize(TinyModelConfig())
    tok = load_tokenizer(d)
    srv = CompletionServer(d).start()
    try:
        with pytest.raises(EngineHTTPError, match="VLLM_SERVER_DEV_MODE"):
            OpenAIEngine(OpenAIEngineConfig(base_url=srv.base_url, reload="vllm"), EngineContext(d, tok))
        eng = OpenAIEngine(OpenAIEngineConfig(base_url=srv.base_url, reload="post"), EngineContext(d, tok))
        upd = full_update(str(tmp_path), 1, load_model(d).state_dict(), d)
        eng.load_weights(upd, eng.prepare_weights(upd))
        assert eng.version == 1 == srv.engine.version  # the server answered the version it loaded
        eng.close()
    finally:
        srv.stop()
    shutil.rmtree(tmp_path, ignore_errors=True)
