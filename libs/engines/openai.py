"""The OpenAI-compatible HTTP engine: any /v1/completions server that streams token ids and logprobs
(``vllm serve``, SGLang, or ``producers.openai_server`` for tests).

One streaming request per sample, each on its own thread and HTTP connection (so the server
does the batching). Requests carry the prompt as token ids and ask for ``logprobs=1``,
``return_tokens_as_token_ids=true`` (tokens come back as ``token_id:N``) and ``stop_token_ids``
(vLLM's extensions). Tokens arrive as server-sent events, so an aborted request keeps the
tokens it already has. Start vLLM with ``--logprobs-mode processed_logprobs`` so its logprobs are
``log_softmax(logits / T)`` like the other engines'.

Weights (``reload``, see docs/how-to/engines.md "Which reload mode for which server"):

* ``rlstream``: the engine verifies the checkpoint (sha256) and POSTs ``{uri, sha256, version,
  kind}`` to the server's reload endpoint (``producers.openai_server``'s ``/rlstream/load_weights``
  or a proxy), which must load them before it answers (and, if its answer names a ``version``, that
  version); a LoRA adapter (``kind = "adapter"``) adds ``adapter_dir`` (the PEFT directory beside
  the file: ``adapter_config.json`` + ``adapter_model.safetensors``), ``adapter_rank``,
  ``adapter_alpha``, ``adapter_target_modules`` and ``base_sha256``, and a server that cannot
  apply adapters must answer an error (the worker then stops loudly).
* ``vllm``: a stock vLLM server, reloaded from the notice's ``metadata.hf_dir`` through its
  development endpoints with a weight-version handshake (``libs.engines.vllm_server``).
* ``none``: someone else updates the server; the notice's version is trusted.

In every mode the engine's ``version`` changes only once the server has confirmed the load, and
only with nothing in flight (the worker drains, or aborts and resumes, first), so no request
tagged with the new version starts before the server holds it. Threads are supervised: an error
in a request thread is raised by ``step``.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from urllib.parse import urlsplit

from libs.engines.base import Engine, EngineContext, EngineHTTPError, GenOutput, GenRequest
from pipeline.checkpoint import read_bytes_verified
from pipeline.log import kv
from pipeline.records import adapter_fields, update_adapter, update_kind

log = logging.getLogger(__name__)
__all__ = ["EngineHTTPError", "OpenAIEngine"]  # EngineHTTPError lives in engines.base (vllm_server raises it too)


class _Call:
    def __init__(self, req: GenRequest):
        self.req = req
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.aborted = threading.Event()
        self.conn: http.client.HTTPConnection | None = None


class OpenAIEngine(Engine):
    name = "openai"
    step_wait_s = 0.01  # results arrive from HTTP threads: wait a little instead of spinning
    weight_kinds = frozenset({"full", "adapter"})  # the server applies them (or refuses: an HTTP error)

    def __init__(self, cfg, ctx: EngineContext):
        super().__init__(cfg, ctx)
        self.cfg = cfg
        self.tokenizer = ctx.tokenizer
        max_workers = max(8, ctx.max_inflight)
        u = urlsplit(cfg.base_url)
        self._scheme, self._host, self._port = u.scheme, u.hostname, u.port or (443 if u.scheme == "https" else 80)
        self._prefix = u.path.rstrip("/")
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="openai-req")
        self.calls: dict[str, tuple[_Call, Future]] = {}
        self.model = cfg.model or self._first_model()
        self.reloader = None
        """``reload = "vllm"``: the server's weight-version state (``vllm_server.VLLMReloader``)."""
        if cfg.reload == "vllm":
            from libs.engines.vllm_server import VLLMReloader

            root = self._prefix[: -len("/v1")] if self._prefix.endswith("/v1") else self._prefix
            self.reloader = VLLMReloader(self._json, cfg, root)

    # -- HTTP ------------------------------------------------------------------------------------
    def _conn(self, timeout: float | None = None) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
        return cls(self._host, self._port, timeout=timeout or self.cfg.timeout_s)

    def _headers(self) -> dict:
        h = {"Content-Type": "application/json"}
        if self.cfg.api_key:
            h["Authorization"] = f"Bearer {self.cfg.api_key}"
        return h

    def _json(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        """One call with a bounded socket timeout (``timeout_s`` unless given); a non-200 answer
        raises ``EngineHTTPError``. An empty or non-JSON 200 answer reads as ``{"text": ...}``."""
        conn = self._conn(timeout)
        try:
            conn.request(method, path, json.dumps(body) if body is not None else None, self._headers())
            resp = conn.getresponse()
            data = resp.read()
            if resp.status != 200:
                raise EngineHTTPError(f"{method} {path}: HTTP {resp.status}: {data[:500]!r}", status=resp.status)
            try:
                out = json.loads(data)
            except ValueError:
                return {"text": data.decode("utf-8", "replace")}
            return out if isinstance(out, dict) else {"value": out}
        finally:
            conn.close()

    def _first_model(self) -> str:
        models = self._json("GET", f"{self._prefix}/models").get("data") or []
        if not models:
            raise EngineHTTPError(f"{self.cfg.base_url}/models lists no model")
        return models[0]["id"]

    def _token_id(self, tok: str) -> int:
        if tok.startswith("token_id:"):
            return int(tok[len("token_id:") :])
        tid = self.tokenizer.convert_tokens_to_ids(tok)
        if tid is None or tid == self.tokenizer.unk_token_id:
            raise EngineHTTPError(f"server returned token {tok!r}; it must support return_tokens_as_token_ids")
        return tid

    def _run(self, call: _Call) -> GenOutput:
        req = call.req
        body = {
            "model": (self.reloader and self.reloader.model_override) or self.model,
            "prompt": list(req.context),
            "max_tokens": req.max_new_tokens,
            "temperature": req.temperature,
            "top_p": 1.0,
            "logprobs": 1,
            "stream": True,
            "return_tokens_as_token_ids": True,
            "stop_token_ids": sorted(req.stop_ids),
            "ignore_eos": self.tokenizer.eos_token_id not in req.stop_ids,
            "skip_special_tokens": False,
        }
        for attempt in range(self.cfg.max_retries + 1):
            if call.aborted.is_set():
                return GenOutput(req.rid, call.tokens, call.logprobs, "abort")
            try:
                if self.reloader is not None:  # the server must still hold this engine's version
                    self.reloader.check(force=attempt > 0)
                return self._stream(call, body)
            except (ConnectionError, http.client.HTTPException, TimeoutError, OSError, _Retry) as exc:
                if call.aborted.is_set():
                    return GenOutput(req.rid, call.tokens, call.logprobs, "abort")
                if call.tokens or attempt == self.cfg.max_retries:
                    raise EngineHTTPError(f"completion {req.rid} failed: {exc!r}") from exc
                log.warning("completion %s failed (%r), retrying", req.rid, exc)
                time.sleep(min(5.0, 0.2 * 2**attempt))
        raise AssertionError("unreachable")

    def _stream(self, call: _Call, body: dict) -> GenOutput:
        conn = call.conn = self._conn()
        try:
            conn.request("POST", f"{self._prefix}/completions", json.dumps(body), self._headers())
            resp = conn.getresponse()
            if resp.status >= 500:
                raise _Retry(f"HTTP {resp.status}: {resp.read()[:300]!r}")
            if resp.status != 200:
                raise EngineHTTPError(f"completions: HTTP {resp.status}: {resp.read()[:500]!r}")
            finish = None
            for raw in resp:
                if call.aborted.is_set():
                    break
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise EngineHTTPError(f"completions stream error: {chunk['error']}")
                choice = chunk["choices"][0]
                lp = choice.get("logprobs") or {}
                for tok, p in zip(lp.get("tokens") or [], lp.get("token_logprobs") or [], strict=True):
                    call.tokens.append(self._token_id(tok))
                    call.logprobs.append(float(p))
                finish = choice.get("finish_reason") or finish
            if call.aborted.is_set():
                return GenOutput(call.req.rid, call.tokens, call.logprobs, "abort")
            if finish is None:
                raise _Retry("stream ended without a finish_reason")
            return GenOutput(call.req.rid, call.tokens, call.logprobs, "length" if finish == "length" else "stop")
        finally:
            conn.close()

    # -- interface -------------------------------------------------------------------------------
    def submit(self, req: GenRequest) -> None:
        call = _Call(req)
        self.calls[req.rid] = (call, self.pool.submit(self._run, call))

    def inflight(self) -> int:
        return len(self.calls)

    def step(self, timeout: float = 0.0) -> list[GenOutput]:
        deadline = time.monotonic() + timeout
        while True:
            done = [rid for rid, (_, fut) in self.calls.items() if fut.done()]
            if done or not self.calls or time.monotonic() >= deadline:
                break
            time.sleep(min(0.005, max(0.0, deadline - time.monotonic())))
        # .result() re-raises a request thread's error here, in the worker's loop
        return [self.calls.pop(rid)[1].result() for rid in done]

    def abort(self, rids: list[str] | None = None) -> list[GenOutput]:
        ids = list(self.calls) if rids is None else [r for r in rids if r in self.calls]
        for rid in ids:
            call = self.calls[rid][0]
            call.aborted.set()
            conn = call.conn
            if conn is not None and conn.sock is not None:
                try:  # unblock a thread waiting for the next event
                    conn.sock.shutdown(2)
                except OSError:
                    pass
        out = []
        for rid in ids:
            call, fut = self.calls.pop(rid)
            res = fut.result(timeout=self.cfg.timeout_s)
            out.append(GenOutput(rid, res.tokens, res.logprobs, "abort"))
        return out

    def prepare_weights(self, update: dict):
        if self.reloader is not None:  # the server reads an HF directory, checked here
            from libs.engines.vllm_server import plan_load

            return plan_load(update, self.ctx.model_dir if self.ctx else None)
        read_bytes_verified(update["uri"], update["sha256"])  # fail here, not on the server
        return None

    def load_weights(self, update: dict, prepared) -> None:
        if self.calls:
            raise RuntimeError("load_weights with requests in flight")
        v = int(update["version"])
        if self.cfg.reload == "rlstream":
            got = self._json("POST", self.cfg.reload_path, reload_body(update), self.cfg.reload_timeout_s)
            if "version" in got and int(got["version"]) != v:
                raise EngineHTTPError(f"{self.cfg.reload_path} answered version {got['version']} for v{v}")
        elif self.reloader is not None:
            secs = self.reloader.load(update, prepared or self.prepare_weights(update))
            log.info("vLLM server reloaded %s", kv(version=v, seconds=round(secs, 3)))
        self.version = v  # only now: the server confirmed it holds v

    def close(self) -> None:
        self.abort()
        self.pool.shutdown(wait=True)


class _Retry(Exception):
    """A failure worth retrying (5xx, dropped stream) before any token arrived."""


def reload_body(update: dict) -> dict:
    """The JSON body of ``reload = "rlstream"`` for a WeightUpdate."""
    body = {
        "uri": update["uri"],
        "sha256": update["sha256"],
        "version": int(update["version"]),
        "kind": update_kind(update),
    }
    if body["kind"] == "adapter":
        ad = update_adapter(update)
        body.update(
            adapter_dir=update["uri"].rsplit("/", 1)[0],
            base_sha256=ad["base_sha256"],
            **adapter_fields(ad["rank"], ad["alpha"], ad["target_modules"]),
        )
    return body
