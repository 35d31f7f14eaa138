"""The openai engine against a real OpenAI-compatible HTTP server on 127.0.0.1 (the tiny HF model
behind producers.openai_server): token ids, logprobs, streaming abort, weight reload, errors."""

import http.client
import json
import time

import pytest
import torch

from libs.engines import EngineContext
from libs.engines.base import GenRequest
from libs.engines.openai import EngineHTTPError, OpenAIEngine
from pipeline.checkpoint import write_weights
from pipeline.models import TinyModelConfig, load_model, load_tokenizer, materialize
from producers.config import OpenAIEngineConfig
from producers.openai_server import CompletionServer
from tests.rollout_helpers import forcing_state_dict
from tests.test_engine_hf import reqs, teacher_forced_logprobs


@pytest.fixture(scope="module")
def server():
    d = materialize(TinyModelConfig())
    srv = CompletionServer(d).start()
    yield srv, load_tokenizer(d), load_model(d)
    srv.stop()


def test_completions_with_logprobs_match_the_model(server):
    srv, tok, model = server
    eng = OpenAIEngine(OpenAIEngineConfig(base_url=srv.base_url), EngineContext(None, tok))
    assert eng.model == "rlstream-policy"
    rs = reqs(tok, 5)
    outs = eng.generate(rs)
    for r, o in zip(rs, outs, strict=True):
        assert o.finish_reason in ("stop", "length") and len(o.tokens) == len(o.logprobs) >= 1
        ref = teacher_forced_logprobs(model, r.context, o.tokens)
        assert torch.allclose(ref, torch.tensor(o.logprobs), atol=1e-4)
    eng.close()


def test_plain_client_sees_an_openai_shaped_answer(server):
    srv = server[0]
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "hello", "max_tokens": 5, "logprobs": 1}))
    body = json.loads(conn.getresponse().read())
    choice = body["choices"][0]
    assert len(choice["logprobs"]["token_logprobs"]) == 5 == body["usage"]["completion_tokens"]
    assert choice["text"] == "".join(choice["logprobs"]["tokens"])


def test_abort_keeps_streamed_tokens_and_frees_the_server(server):
    srv, tok, _ = server
    eng = OpenAIEngine(OpenAIEngineConfig(base_url=srv.base_url), EngineContext(None, tok))
    eng.submit(GenRequest("long", tok.encode("abc"), 450, 1.0, frozenset()))
    call = eng.calls["long"][0]
    deadline = time.monotonic() + 30
    while len(call.tokens) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    (out,) = eng.abort()
    assert out.finish_reason == "abort" and 5 <= len(out.tokens) < 450 and len(out.logprobs) == len(out.tokens)
    deadline = time.monotonic() + 10
    while srv.engine.inflight() and time.monotonic() < deadline:  # the disconnect aborted it server-side
        time.sleep(0.05)
    assert srv.engine.inflight() == 0
    eng.close()


def test_reload_posts_the_checkpoint_and_changes_generation(server, tmp_path):
    srv, tok, model = server
    eng = OpenAIEngine(OpenAIEngineConfig(base_url=srv.base_url), EngineContext(None, tok))
    z = tok.convert_tokens_to_ids("Z")
    uri, sha, _ = write_weights(str(tmp_path), 1, forcing_state_dict(model.state_dict(), z))
    upd = {"version": 1, "uri": uri, "sha256": sha}
    eng.load_weights(upd, eng.prepare_weights(upd))
    try:
        outs = eng.generate(reqs(tok, 2))
        assert eng.version == 1 and srv.engine.version == 1 and all(set(o.tokens) == {z} for o in outs)
        bad = {"version": 2, "uri": uri, "sha256": "0" * 64}
        with pytest.raises(Exception, match="sha256"):
            eng.prepare_weights(bad)
    finally:  # back to the version-0 weights for the other tests
        uri0, sha0, _ = write_weights(str(tmp_path), 0, model.state_dict())
        eng.load_weights({"version": 0, "uri": uri0, "sha256": sha0}, None)
        eng.close()


def test_server_errors_surface_as_typed_errors(server):
    srv, tok, _ = server
    with pytest.raises(EngineHTTPError, match="404"):
        OpenAIEngine(OpenAIEngineConfig(base_url=f"http://127.0.0.1:{srv.port}/nope"), EngineContext(None, tok))
    eng = OpenAIEngine(OpenAIEngineConfig(base_url=srv.base_url, model="m"), EngineContext(None, tok))
    eng.submit(GenRequest("bad", [], 5, 1.0, frozenset()))  # the server refuses an empty prompt
    with pytest.raises(EngineHTTPError, match="400"):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            eng.step(0.1)
    assert srv.error is None
    eng.close()
