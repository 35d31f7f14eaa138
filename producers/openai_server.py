"""A minimal OpenAI-compatible completions server over the hf engine, for tests and local runs.

Serves ``GET /v1/models``, ``POST /v1/completions`` (prompt as text or token ids; ``logprobs``;
``stream`` as server-sent events; vLLM's ``return_tokens_as_token_ids``, ``stop_token_ids`` and
``ignore_eos``) and ``POST /rlstream/load_weights`` ({uri, sha256, version}: verified, then loaded
once in-flight requests have finished). One engine thread owns the model and does continuous
batching; HTTP handlers only exchange queues with it. A client that disconnects aborts its
request. Logprobs are ``log_softmax(raw_logits / T)`` of the sampled token, as in the hf engine.

What this is not: a production server (no auth, no chat API, one model). Use ``vllm serve`` or
SGLang for real runs. Run it with ``python -m producers.openai_server MODEL_DIR --port 8000``.
"""

from __future__ import annotations

import argparse
import json
import logging
import queue
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from libs.engines import EngineContext
from libs.engines.base import GenRequest
from libs.engines.hf import HFEngine
from pipeline.models import load_tokenizer
from producers.config import HFEngineConfig

log = logging.getLogger(__name__)


class CompletionServer:
    def __init__(self, model_dir, host: str = "127.0.0.1", port: int = 0, model_name: str = "rlstream-policy"):
        self.tokenizer = load_tokenizer(model_dir)
        self.engine = HFEngine(
            HFEngineConfig(device="cpu", refill_every=2), EngineContext(model_dir, self.tokenizer, "server")
        )
        self.model_name = model_name
        self.inbox: queue.Queue = queue.Queue()
        self.requests_served = 0
        self._stop = threading.Event()
        self.error: BaseException | None = None
        server = self

        class Handler(_Handler):
            srv = server

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.base_url = f"http://{host}:{self.port}/v1"
        self._threads = [
            threading.Thread(target=self._engine_loop, name="server-engine", daemon=True),
            threading.Thread(target=self.httpd.serve_forever, name="server-http", daemon=True),
        ]

    def start(self) -> CompletionServer:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        for t in self._threads:
            t.join(10)

    # -- engine thread ---------------------------------------------------------------------------
    def _engine_loop(self) -> None:
        streams: dict[str, list] = {}  # rid -> [out queue, tokens sent]
        waiting: list = []  # generations held back while a weight load drains the engine
        loads: list = []
        try:
            while not self._stop.is_set():
                ops = []
                try:
                    ops.append(self.inbox.get(timeout=0.0 if self.engine.inflight() else 0.01))
                    while True:
                        ops.append(self.inbox.get_nowait())
                except queue.Empty:
                    pass
                for op in ops:
                    if op[0] == "gen" and loads:
                        waiting.append(op)
                    elif op[0] == "gen":
                        self._start(streams, op)
                    elif op[0] == "abort":
                        waiting = [g for g in waiting if g[1].rid != op[1]]
                        self.engine.abort([op[1]])
                        streams.pop(op[1], None)
                    elif op[0] == "load":
                        loads.append(op)
                if loads and not self.engine.inflight():
                    for _, body, reply in loads:
                        t0 = time.monotonic()
                        try:
                            update = {"sha256": None, **body, "version": int(body["version"])}
                            state = self.engine.prepare_weights(update)
                            self.engine.load_weights(update, state)
                            reply.put((200, {"version": self.engine.version, "load_ms": (time.monotonic() - t0) * 1e3}))
                        except Exception as exc:  # reported to the client, the server goes on
                            reply.put((500, {"error": repr(exc)}))
                    loads = []
                    for g in waiting:
                        self._start(streams, g)
                    waiting = []
                if self.engine.inflight():
                    finished = self.engine.step()
                    for row in self.engine.rows:
                        self._send(streams, row.req.rid, row.tokens, row.logprobs, None)
                    for out in finished:
                        self._send(streams, out.rid, out.tokens, out.logprobs, out.finish_reason)
        except BaseException as exc:  # supervised: handlers see the error, stop() joins
            log.exception("completion server engine thread died")
            self.error = exc
            for q, _ in streams.values():
                q.put(("error", repr(exc)))

    def _start(self, streams, op) -> None:
        _, req, q = op
        streams[req.rid] = [q, 0]
        self.engine.submit(req)
        self.requests_served += 1

    @staticmethod
    def _send(streams, rid, tokens, logprobs, finish) -> None:
        st = streams.get(rid)
        if st is None:
            return
        q, sent = st
        if len(tokens) > sent:
            q.put(("tokens", tokens[sent:], logprobs[sent:]))
            st[1] = len(tokens)
        if finish:
            q.put(("done", finish))
            streams.pop(rid)


class _Handler(BaseHTTPRequestHandler):
    srv: CompletionServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet
        log.debug("http %s", fmt % args)

    def _reply(self, code: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path.rstrip("/") == "/v1/models":
            return self._reply(200, {"object": "list", "data": [{"id": self.srv.model_name, "object": "model"}]})
        return self._reply(404, {"error": f"no route {self.path}"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/rlstream/load_weights":
            reply: queue.Queue = queue.Queue()
            self.srv.inbox.put(("load", body, reply))
            return self._reply(*reply.get())
        if self.path.rstrip("/") != "/v1/completions":
            return self._reply(404, {"error": f"no route {self.path}"})
        return self._complete(body)

    def _complete(self, body: dict) -> None:
        tok = self.srv.tokenizer
        prompt = body.get("prompt")
        ids = list(prompt) if isinstance(prompt, list) else tok.encode(str(prompt))
        max_tokens = int(body.get("max_tokens", 16))
        if not ids or len(ids) + max_tokens > self.srv.engine.max_model_len:
            return self._reply(400, {"error": f"prompt of {len(ids)} tokens + max_tokens {max_tokens} does not fit"})
        stops = set(body.get("stop_token_ids") or [])
        if not body.get("ignore_eos", False):
            stops.add(tok.eos_token_id)
        rid = f"cmpl-{uuid.uuid4().hex[:12]}"
        req = GenRequest(rid, ids, max_tokens, float(body.get("temperature", 1.0)), frozenset(stops))
        q: queue.Queue = queue.Queue()
        self.srv.inbox.put(("gen", req, q))
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        want_lp = body.get("logprobs") is not None

        def lp_obj(toks, lps):
            names = [f"token_id:{t}" if as_ids else tok.convert_ids_to_tokens(t) for t in toks]
            return {
                "tokens": names,
                "token_logprobs": lps,
                "top_logprobs": [{n: p} for n, p in zip(names, lps, strict=True)],
            }

        if not body.get("stream"):
            toks, lps, finish = [], [], None
            while finish is None:
                item = q.get()
                if item[0] == "error":
                    return self._reply(500, {"error": item[1]})
                if item[0] == "tokens":
                    toks += item[1]
                    lps += item[2]
                else:
                    finish = item[1]
            choice = {"index": 0, "text": tok.decode(toks), "finish_reason": finish}
            choice["logprobs"] = lp_obj(toks, lps) if want_lp else None
            usage = {"prompt_tokens": len(ids), "completion_tokens": len(toks), "total_tokens": len(ids) + len(toks)}
            return self._reply(200, {"id": rid, "object": "text_completion", "model": self.srv.model_name,
                                     "choices": [choice], "usage": usage})  # fmt: skip
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            while True:
                item = q.get()
                if item[0] == "error":
                    self.wfile.write(f"data: {json.dumps({'error': item[1]})}\n\n".encode())
                    break
                choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": None}
                if item[0] == "tokens":
                    choice["text"] = tok.decode(item[1])
                    choice["logprobs"] = lp_obj(item[1], item[2]) if want_lp else None
                else:
                    choice["finish_reason"] = item[1]
                chunk = {"id": rid, "object": "text_completion", "model": self.srv.model_name, "choices": [choice]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
                if item[0] == "done":
                    self.wfile.write(b"data: [DONE]\n\n")
                    break
        except (BrokenPipeError, ConnectionResetError):
            self.srv.inbox.put(("abort", rid))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    srv = CompletionServer(a.model_dir, a.host, a.port).start()
    print(srv.base_url, flush=True)
    try:
        while srv.error is None:
            time.sleep(1)
    finally:
        srv.stop()
    raise SystemExit(f"engine thread died: {srv.error!r}")


if __name__ == "__main__":
    main()
